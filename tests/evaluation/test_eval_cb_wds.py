"""``mmalign eval --cb-dataset DIR`` / ``--suite cb:DIR``: clip_benchmark's WebDataset layout read
natively, its numbers equal to clip_benchmark's own on the same model and files, its record
clip_benchmark's; a broken layout is one line naming what is missing, exit 2."""

from __future__ import annotations

import json
import math
import shutil
import sys
import tarfile
from pathlib import Path

import pytest
import torch

pytest.importorskip("clip_benchmark", reason="clip_benchmark is a test extra: pip install -e '.[test]'")
pytest.importorskip("requests", reason="clip_benchmark's CLI imports requests: pip install -e '.[test]'")

from mmalign.cli import main  # noqa: E402
from mmalign.data.transforms import preprocess_cfg  # noqa: E402
from mmalign.errors import UsageError  # noqa: E402
from mmalign.evaluation import load_suite  # noqa: E402
from mmalign.models import TwoTower  # noqa: E402
from mmalign.models.io import save_pretrained  # noqa: E402
from mmalign.models.presets import PRESETS  # noqa: E402
from mmalign.pretrained import clip_benchmark_loader  # noqa: E402
from tests.harness.cb_reference import cb_classification  # noqa: E402
from tests.harness.cb_wds_gen import write_wds  # noqa: E402

BATCH = "16"  # the same on both sides: identical batches, identical embeddings


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("cbwds")
    torch.manual_seed(3)
    model = TwoTower(PRESETS["micro"], init_logit_scale=math.log(50.0))
    save_pretrained(model, root / "model", preprocess=preprocess_cfg(model.image_size))
    return root / "model"


def _eval(model_dir: Path, *args: str) -> int:
    return main(["eval", "--model", str(model_dir), "--batch-size", BATCH, *args])


def test_classification_equals_clip_benchmark_and_writes_its_record(model_dir, tmp_path):
    data = tmp_path / "wds_vtab-pets"
    write_wds(data, "classification", n=36, shards=2, image_ext="jpg")  # two shards, JPEG
    out = tmp_path / "rec.json"
    assert _eval(model_dir, "--cb-dataset", str(data), "--output", str(out)) == 0
    record = json.loads(out.read_text())
    assert list(record) == ["dataset", "model", "pretrained", "task", "metrics", "language"]
    assert record["dataset"] == "wds/vtab-pets" and record["task"] == "zeroshot_classification"
    assert (record["model"], record["pretrained"], record["language"]) == ("mmalign", str(model_dir), "en")
    assert list(record["metrics"]) == ["acc1", "acc5", "mean_per_class_recall"]
    want = cb_classification(*clip_benchmark_loader(pretrained=model_dir), data, batch=int(BATCH))
    for key, value in want.items():
        assert abs(record["metrics"][key] - value) <= 1e-6, (key, record["metrics"], want)
    assert 0 < want["acc5"] < 1  # neither trivial


def test_retrieval_equals_clip_benchmarks_cli(model_dir, tmp_path, monkeypatch):
    from clip_benchmark import cli, models

    data = tmp_path / "wds_flickr8k"
    write_wds(data, "retrieval", n=30, seed=4)
    ours = tmp_path / "ours.json"
    assert _eval(model_dir, "--suite", f"cb:{data}", "--output", str(ours)) == 0
    monkeypatch.setitem(models.TYPE2FUNC, "mmalign", clip_benchmark_loader)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "clip_benchmark",
            "eval",
            "--model_type",
            "mmalign",
            "--model",
            "mmalign",
            "--pretrained",
            str(model_dir),
            "--dataset",
            "wds/flickr8k",
            "--dataset_root",
            str(data),
            "--task",
            "zeroshot_retrieval",
            "--recall_k",
            "1",
            "5",
            "10",
            "--no_amp",
            "--num_workers",
            "0",
            "--batch_size",
            BATCH,
            "--output",
            str(tmp_path / "cb.json"),
        ],
    )
    models.MODEL_TYPES.append("mmalign")  # the CLI imported this very list: extend it in place
    try:
        cli.main()
    finally:
        models.MODEL_TYPES.remove("mmalign")
    theirs, mine = json.loads((tmp_path / "cb.json").read_text()), json.loads(ours.read_text())
    assert list(mine) == list(theirs) and list(mine["metrics"]) == list(theirs["metrics"])
    assert {k: v for k, v in mine.items() if k != "metrics"} == {
        k: v for k, v in theirs.items() if k != "metrics"
    }
    for key, value in theirs["metrics"].items():
        assert abs(mine["metrics"][key] - value) <= 1e-6, (key, mine["metrics"], theirs["metrics"])
    assert 0 < theirs["metrics"]["text_retrieval_recall@5"] < 1
    # without dataset_type.txt the task is read off the samples (.txt): the same record
    bare = tmp_path / "wds_flickr8k_bare" / "wds_flickr8k"
    shutil.copytree(data, bare)
    (bare / "dataset_type.txt").unlink()
    assert _eval(model_dir, "--cb-dataset", str(bare), "--output", str(tmp_path / "bare.json")) == 0
    assert json.loads((tmp_path / "bare.json").read_text())["metrics"] == mine["metrics"]


def test_cb_suite_loads_anywhere_a_suite_name_goes(tmp_path):
    data = tmp_path / "wds_cifar10"
    write_wds(data, "classification", n=8, split="train")
    with pytest.raises(UsageError, match=r"split folder test/ not found \(splits here: train"):
        load_suite(f"cb:{data}")
    from mmalign.evaluation.cb_wds import cb_suite

    suite = cb_suite(data, "train")
    (task,) = suite["tasks"]
    assert suite["dataset"]["type"] == "cb_wds" and task["record_dataset"] == "wds/cifar10"
    assert task["classnames"] == ["circle", "square", "triangle", "star", "cross", "diamond"]
    assert task["templates"] == ["a photo of a {c}.", "a drawing of a {c}."]


def _tar(path: Path, members: dict[str, bytes]) -> None:
    import io

    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _broken(root: Path, what: str) -> Path:
    """A classification dataset with one thing wrong."""
    write_wds(root, "classification", n=4, shards=2)
    if what == "nshards":
        (root / "test" / "nshards.txt").unlink()
    elif what == "shard":
        (root / "test" / "1.tar").unlink()
    elif what in ("classnames", "templates"):
        (
            root / ("classnames.txt" if what == "classnames" else "zeroshot_classification_templates.txt")
        ).unlink()
    elif what == "image":
        _tar(root / "test" / "1.tar", {"k1.cls": b"0"})
    elif what == "label_or_captions":
        _tar(root / "test" / "0.tar", {"k0.png": _png()})  # the first sample: an image alone
    elif what == "type":
        (root / "dataset_type.txt").write_text("multilabel\n")
    elif what == "label":
        _tar(root / "test" / "1.tar", {"k1.png": _png(), "k1.cls": b"9"})
    elif what == "cls":
        _tar(root / "test" / "1.tar", {"k1.png": _png(), "k1.cls": b"cat"})
    elif what == "many_shards":
        (root / "test" / "nshards.txt").write_text("5000000\n")
    elif what.startswith("templates:"):
        (root / "zeroshot_classification_templates.txt").write_text(what.split(":", 1)[1])
    return root


def _png() -> bytes:
    import io

    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (8, 8)).save(out, "PNG")
    return out.getvalue()


@pytest.mark.parametrize(
    "what, message",
    [
        ("nshards", "test/nshards.txt not found"),
        ("shard", "shard test/1.tar not found"),
        ("classnames", "classnames.txt not found"),
        ("templates", "zeroshot_classification_templates.txt not found"),
        ("image", "has no image (.webp, .png, .jpg or .jpeg)"),
        ("label_or_captions", "has neither .cls (a label) nor .txt (captions)"),
        ("type", "dataset_type.txt says 'multilabel'"),
        ("label", "label 9 is not a class index (0..5"),
        ("cls", ".cls holds 'cat', not a label index"),
        ("many_shards", "shard test/2.tar not found (and 4999997 more of 5000000)"),
        ("templates:\n\n\n", "zeroshot_classification_templates.txt is empty"),
        ("templates:a {c}.\n\n", "zeroshot_classification_templates.txt: line 2 '' is blank"),
        ("templates:a {c}.\n{x} of {c}\n", "templates.txt: line 2 '{x} of {c}' has the field {x}"),
        ("templates:a {}.\n", "line 1 'a {}.' has the field {}"),
        ("templates:a { of {c}\n", "line 1 'a { of {c}' does not format"),
    ],
)
def test_a_broken_layout_is_one_line_naming_what_is_missing(model_dir, tmp_path, capsys, what, message):
    data = _broken(tmp_path / "wds_x", what)
    assert _eval(model_dir, "--cb-dataset", str(data), "--output", str(tmp_path / "o.json")) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmalign: error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "o.json").exists()


def test_a_huge_shard_count_is_refused_from_the_folder_at_once(tmp_path):
    import time

    from mmalign.evaluation.cb_wds import inspect

    data = _broken(tmp_path / "wds_big", "many_shards")
    start = time.monotonic()
    with pytest.raises(UsageError, match=r"shard test/2.tar not found \(and 4999997 more of 5000000\)"):
        inspect(data)
    assert time.monotonic() - start < 2  # not five million stats (217 s)
    (data / "test" / "nshards.txt").write_text("2\n")
    assert [Path(u).name for u in inspect(data).urls] == ["0.tar", "1.tar"]
    (data / "test" / "3.tar").write_bytes((data / "test" / "1.tar").read_bytes())
    (data / "test" / "nshards.txt").write_text("4\n")  # 0, 1 and 3 present: 2 missing, counted right
    with pytest.raises(UsageError, match=r"shard test/2.tar not found$"):
        inspect(data)


def test_cb_flag_mistakes_are_one_line(model_dir, tmp_path, capsys):
    data = tmp_path / "wds_y"
    write_wds(data, "classification", n=4)
    cases = [
        (["--cb-dataset", str(tmp_path / "nope")], "no such folder"),
        (["--cb-dataset", str(data), "--suite", "shapes"], "give one of --suite and --cb-dataset"),
        (
            ["--cb-dataset", str(data), "--data", str(data)],
            "--data: a clip_benchmark dataset reads its own shards",
        ),
        (["--suite", "digits", "--cb-split", "train"], "--cb-split goes with --cb-dataset"),
        (["--cb-dataset", str(data), "--root", str(data)], "--root goes with --benchmark"),
    ]
    for args, message in cases:
        assert _eval(model_dir, *args) == 2, args
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (args, err)


def test_a_training_config_evaluates_a_cb_suite(micro_overrides, tmp_path):
    """``eval.suite: cb:DIR``: the run's final evaluation reads the clip_benchmark folder."""
    from tests.harness import cli_main

    data = tmp_path / "wds_cifar10"
    write_wds(data, "classification", n=12)
    overrides = [o for o in micro_overrides if not o.startswith("train.steps=")]
    overrides += ["train.steps=2", f"eval.suite=cb:{data}", "monitor.probe_size=0"]
    res = cli_main("train", *[a for o in overrides for a in ("--set", o)])
    assert res.returncode == 0, res.stderr[-3000:]

    def records(node):
        if isinstance(node, dict):
            if node.get("dataset") == "wds/cifar10":
                yield node
            for value in node.values():
                yield from records(value)
        elif isinstance(node, list):
            for value in node:
                yield from records(value)

    (record,) = records(json.loads((tmp_path / "run" / "eval.json").read_text()))
    assert record["task"] == "zeroshot_classification" and record["n_images"] == 12
    assert 0 <= record["metrics"]["acc1"] <= 1
