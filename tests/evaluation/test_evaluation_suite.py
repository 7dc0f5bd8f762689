"""End to end: `mmalign eval` on the shapes and digits suites, `mmalign report`, features, edits.

A freshly initialised micro model stands in for a trained one: these tests check the
plumbing and the definitions, not the accuracy.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torchvision import transforms as T

from data_pipelines import shapes
from mmalign.cli import main
from mmalign.evaluation.counterfactual import edit_pairs, run_counterfactuals
from mmalign.evaluation.features import encode_images


@pytest.fixture(scope="module")
def run_dir(shapes_dir, tmp_path_factory):
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.arch import resolve_arch
    from mmalign.models.io import save_pretrained
    from mmalign.models.two_tower import TwoTower

    run = tmp_path_factory.mktemp("evalrun")
    torch.manual_seed(0)
    model = TwoTower(resolve_arch(ModelConfig(preset="micro")))
    save_pretrained(
        model,
        run / "final",
        preprocess=preprocess_cfg(model.image_size),
        extra={"train_config": {"data": {"val": f"{shapes_dir}/val/00000.tar"}, "eval": {"suite": "shapes"}}},
    )
    keys = [
        "loss",
        "loss_floor",
        "logit_scale",
        "pos_rank",
        "hardest_neg_prob",
        "top1",
        "probe_image_effective_rank",
        "probe_text_effective_rank",
        "samples_per_s",
    ]
    rows = [
        {"step": s, **{k: 1.0 / s + i for i, k in enumerate(keys)}, "grad_norm": float("nan")}
        for s in range(1, 21)
    ]
    (run / "metrics.jsonl").write_text(
        "\n".join(json.dumps(r) for r in rows) + '\n{"step": 21, "lo'
    )  # torn last line
    return run


@pytest.mark.integration
def test_eval_shapes_full_writes_clip_benchmark_records(run_dir, tmp_path):
    out = tmp_path / "full.json"
    assert main(["eval", "--model", str(run_dir), "--suite", "shapes_full", "--output", str(out)]) == 0
    records = {r["dataset"]: r for r in json.loads(out.read_text())}
    assert {r["task"] for r in records.values()} == {
        "zeroshot_classification",
        "zeroshot_retrieval",
        "linear_probe",
        "embedding_diagnostics",
        "counterfactual",
    }
    for r in records.values():
        assert set(r) >= {"dataset", "model", "pretrained", "task", "metrics", "language"}
    assert set(records["shapes_full/shape"]["metrics"]) >= {"acc1", "acc5", "mean_per_class_recall"}
    assert set(records["shapes_full/shape"]["slices"]) == {"background", "size"}
    assert sum(v["n"] for v in records["shapes_full/shape"]["slices"]["size"].values()) == 120
    assert "text_retrieval_recall@5" in records["shapes_full/retrieval"]["metrics"]
    assert records["shapes_full/shape_probe"]["features"] == "joint"
    assert records["shapes_full/shape_probe_backbone"]["features"] == "pre_projection"
    assert "linear_best_C" in records["shapes_full/shape_probe_backbone"]["metrics"]
    cf = records["shapes_full/counterfactual"]
    assert cf["expected"]["rerender/colour"] == "changes" and cf["expected"]["rerender/shape"] == "keeps"
    assert 0.0 <= cf["metrics"]["rerender_colour_flip_rate"] <= 1.0
    # the default suite through the same code gives the same zero-shot numbers
    assert main(["eval", "--model", str(run_dir), "--out", str(tmp_path / "plain.json")]) == 0
    plain = {r["dataset"]: r for r in json.loads((tmp_path / "plain.json").read_text())}
    assert plain["shapes/shape"]["metrics"] == records["shapes_full/shape"]["metrics"]


@pytest.mark.integration
def test_eval_digits_suite_with_limit(run_dir, tmp_path):
    out = tmp_path / "digits.json"
    assert (
        main(["eval", "--model", str(run_dir), "--suite", "digits", "--output", str(out), "--limit", "150"])
        == 0
    )
    records = {r["dataset"]: r for r in json.loads(out.read_text())}
    assert records["digits/digit"]["n_images"] == 150
    assert records["digits/digit"]["metrics"]["chance_acc1"] == pytest.approx(0.1)
    assert records["digits/digit_probe_backbone"]["features"] == "pre_projection"


def test_unknown_suite_is_a_one_line_error(run_dir, capsys):
    assert main(["eval", "--model", str(run_dir), "--suite", "nope"]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


@pytest.mark.integration
def test_report_writes_html_and_pngs(run_dir, tmp_path, capsys):
    assert main(["report", "--run", str(run_dir), "--output", str(tmp_path / "rep"), "--limit", "60"]) == 0
    # progress off a terminal: a closing line with the count (issue 15 point 4)
    assert "mmalign: report: embedding the sample: 60 of 60 images" in capsys.readouterr().out
    page = (tmp_path / "rep" / "index.html").read_text()
    for name in ("curves.png", "similarity.png", "tsne.png", "recall.png"):
        assert f"src='{name}'" in page
        with Image.open(tmp_path / "rep" / name) as im:
            assert im.width > 300 and im.height > 200
    assert "20 logged steps" in page and "positive_negative_auc" in page


def test_pre_projection_features_come_from_one_pass_and_restore_the_head(run_dir):
    from mmalign.pretrained import load

    model = load(run_dir).model
    x = torch.randn(5, 3, 16, 16)
    feats = encode_images(model, x, pre_projection=True)
    torch.testing.assert_close(feats["joint"], model.encode_image(x))
    proj = model.visual.proj
    assert isinstance(proj, torch.nn.Parameter) and "visual.proj" in dict(model.named_parameters())
    torch.testing.assert_close(F.normalize(feats["pre_projection"] @ proj.detach(), dim=-1), feats["joint"])
    assert not torch.allclose(feats["pre_projection"], feats["joint"])


def _scene(**kw):
    attrs = {
        "shape": "square",
        "colour": "red",
        "background": "white",
        "size": "large",
        "grid": [1, 1],
        "position": "center",
        **kw,
    }
    return {
        "key": "k",
        "image": shapes.draw(dict(attrs, jitter=[0.3, -0.2]), 32),
        "captions": [],
        "json": attrs,
    }


def test_edits_change_what_they_say():
    samples = [_scene(), _scene(colour="blue", shape="circle")]
    before, after, metas = edit_pairs(samples, {"name": "rerender", "field": "colour"}, seed=1)
    for s, b, a, m in zip(samples, before, after, metas):
        assert m["colour"] != s["json"]["colour"] and {k: v for k, v in m.items() if k != "colour"} == {
            k: v for k, v in dict(s["json"], jitter=[0.0, 0.0]).items() if k != "colour"
        }
        b, a = np.asarray(b), np.asarray(a)
        changed = (b != a).any(axis=2)
        assert changed.any()
        assert (b[changed] == shapes.COLOURS[s["json"]["colour"]]).all()  # only the shape's pixels changed
        assert (a[changed] == shapes.COLOURS[m["colour"]]).all()
    _, flipped, _ = edit_pairs(samples, {"name": "hflip"})
    assert np.array_equal(np.asarray(flipped[0]), np.asarray(samples[0]["image"])[:, ::-1])
    _, cropped, _ = edit_pairs(samples, {"name": "crop", "scale": 0.5})
    assert cropped[0].size == samples[0]["image"].size


class _MeanColour(torch.nn.Module):
    """A stand-in model whose image embedding is the normalised mean RGB."""

    def encode_image(self, x):
        return F.normalize(x.mean(dim=(2, 3)) + 1e-3, dim=-1)


def test_counterfactual_metrics_against_direct_computation():
    rng = np.random.default_rng(0)
    samples = [_scene(colour=str(c), background="black") for c in rng.choice(list(shapes.COLOURS), 12)]
    names = list(shapes.COLOURS)
    weights = F.normalize(
        torch.tensor([shapes.COLOURS[n] for n in names], dtype=torch.float32), dim=-1
    ).T  # (3, C)
    clf = {"colour": {"weights": weights, "label_field": "colour", "classnames": names}}
    edits = [{"name": "hflip"}, {"name": "rerender", "field": "colour"}]
    metrics, expected = run_counterfactuals(
        _MeanColour(), T.ToTensor(), samples, edits, clf, batch_size=5, seed=2
    )
    assert metrics["hflip_cosine_mean"] == pytest.approx(1.0, abs=1e-6)
    assert metrics["hflip_colour_flip_rate"] == 0.0
    before, after, _ = edit_pairs(samples, edits[1], seed=2)
    emb = lambda ims: F.normalize(torch.stack([T.ToTensor()(i) for i in ims]).mean(dim=(2, 3)) + 1e-3, dim=-1)  # noqa: E731
    b, a = emb(before), emb(after)
    assert metrics["rerender_cosine_mean"] == pytest.approx(float((b * a).sum(1).mean()), abs=1e-6)
    want_flip = float(((b @ weights).argmax(1) != (a @ weights).argmax(1)).float().mean())
    assert metrics["rerender_colour_flip_rate"] == pytest.approx(want_flip)
    assert metrics["rerender_colour_flip_rate"] > 0.5  # mean colour on black does see the recolouring
    assert expected == {"hflip/colour": "keeps", "rerender/colour": "changes"}


def test_extends_resolves_a_sibling_file_or_a_builtin_suite(tmp_path):
    from mmalign.config import ConfigError
    from mmalign.evaluation import load_suite

    outside = tmp_path / "mine.yaml"  # not next to eval/: "shapes" must come from eval/
    outside.write_text("name: mine\nextends: shapes\ntasks:\n  - name: geometry\n    type: diagnostics\n")
    suite = load_suite(str(outside))
    names = [t["name"] for t in suite["tasks"]]
    assert names[:3] == ["shape", "colour", "retrieval"] and names[-1] == "geometry"
    assert suite["name"] == "mine" and suite["dataset"].endswith("data/shapes/val/00000.tar")
    (tmp_path / "base.yaml").write_text(
        "name: base\ndataset: x.tar\ntasks:\n  - name: g\n    type: diagnostics\n"
    )
    (tmp_path / "child.yaml").write_text("name: child\nextends: base\n")
    assert [t["name"] for t in load_suite(str(tmp_path / "child.yaml"))["tasks"]] == ["g"]
    (tmp_path / "orphan.yaml").write_text("name: orphan\nextends: nowhere\n")
    with pytest.raises(ConfigError, match="unknown suite 'nowhere'"):
        load_suite(str(tmp_path / "orphan.yaml"))


def test_zero_shot_never_embeds_the_dataset_captions(run_dir, shapes_dir):
    """Text-encoder rows: the class prompts only, unless a task reads the dataset's captions."""
    from mmalign.evaluation import load_suite, run_suite
    from mmalign.pretrained import load

    loaded = load(run_dir)
    rows = []
    encode_text = loaded.model.encode_text

    def counting(tokens, *a, **kw):
        rows.append(tokens.shape[0])
        return encode_text(tokens, *a, **kw)

    loaded.model.encode_text = counting
    suite = load_suite("shapes")
    zeroshot = [t for t in suite["tasks"] if t["type"] == "zeroshot"]
    prompts = sum(len(t["classnames"]) * len(t["templates"]) for t in zeroshot)
    val = f"{shapes_dir}/val/00000.tar"
    only = run_suite(loaded.model, loaded.preprocess, loaded.tokenizer, {**suite, "tasks": zeroshot}, val)
    assert sum(rows) == prompts and all(r["n_captions"] == 0 for r in only)
    rows.clear()
    full = run_suite(
        loaded.model, loaded.preprocess, loaded.tokenizer, suite, val
    )  # + retrieval: 2 captions each
    assert sum(rows) == prompts + 240
    assert [r["metrics"] for r in only] == [r["metrics"] for r in full[: len(zeroshot)]]


@pytest.fixture(scope="module")
def sorted_shards(tmp_path_factory):
    """Class-sorted shards (as --no-shuffle writes CIFAR's tar): 3 classes x 20, 20 per shard, one class each."""
    import io
    import random

    from data_pipelines.build import build_shards
    from data_pipelines.sources import Captioner, image_folder
    from tests.harness import pick_seed

    root, rng = tmp_path_factory.mktemp("sorted"), random.Random(pick_seed(199))
    for c in ("bird", "cat", "dog"):
        (root / "src" / c).mkdir(parents=True)
        for i in range(20):
            buf = io.BytesIO()
            Image.frombytes("RGB", (16, 16), rng.randbytes(16 * 16 * 3)).save(buf, format="PNG")
            (root / "src" / c / f"{i:04d}.png").write_bytes(buf.getvalue())
    build_shards(
        image_folder(root / "src", Captioner(["a photo of a {c}."]))[1],
        root / "shards",
        per_shard=20,
        progress=False,
    )
    suite = root / "sorted.yaml"
    suite.write_text(
        "name: sorted\ndataset: null\ntasks:\n  - name: cls\n    type: zeroshot\n"
        "    label_field: classname\n    classnames: [bird, cat, dog]\n    templates: ['a {c}.']\n"
        "    slices: [classname]\n"
    )
    return {"suite": suite, "data": f"{root}/shards/{{00000..00002}}.tar"}


def test_limit_draws_a_seeded_stratified_sample_not_the_first_n(run_dir, sorted_shards, tmp_path):
    from mmalign.evaluation.datasets import iter_dataset

    spec = {"type": "shards", "urls": sorted_shards["data"], "stratify": "label"}
    assert [s["json"]["classname"] for s in iter_dataset(dict(spec, limit=12))].count(
        "bird"
    ) == 4  # 12 x 20/60
    drawn = lambda **kw: [s["json"]["source_path"] for s in iter_dataset(dict(spec, **kw))]  # noqa: E731
    assert drawn(limit=12) == drawn(limit=12, seed=0) != drawn(limit=12, seed=1)
    assert (
        drawn(limit=12) != drawn()[:12] and drawn(limit=60) == drawn()
    )  # not the first N; all when N >= size
    assert len(drawn(limit=12, per_class=5)) == 12
    assert {p.split("/")[0] for p in drawn(limit=9, per_class=5)} == {"bird", "cat", "dog"}
    with pytest.raises(Exception, match="limit must be >= 1"):
        drawn(limit=0)
    # mmalign eval --limit: the per-class slices count the sample's class mix
    out = tmp_path / "e.json"
    assert (
        main(
            [
                "eval",
                "--model",
                str(run_dir),
                "--suite",
                str(sorted_shards["suite"]),
                "--data",
                sorted_shards["data"],
                "--limit",
                "9",
                "--output",
                str(out),
            ]
        )
        == 0
    )
    (record,) = json.loads(out.read_text())
    assert record["n_images"] == 9
    assert {k: v["n"] for k, v in record["slices"]["classname"].items()} == {"bird": 3, "cat": 3, "dog": 3}


@pytest.mark.integration
def test_report_shows_eval_files_config_time_data_and_warns(run_dir, sorted_shards, tmp_path):
    import os
    import shutil

    from mmalign.evaluation.report import run_time, write_report

    run = tmp_path / "run"
    shutil.copytree(run_dir / "final", run / "final")

    def record(v):
        return [{"dataset": "sorted/cls", "task": "zeroshot_classification", "metrics": {"acc1": v}}]

    (run / "eval_step00000010.json").write_text(json.dumps(record(0.125)))
    (run / "eval_step00000020.json").write_text(json.dumps(record(0.25)))
    (run / "eval.json").write_text(json.dumps(record(0.5)))
    (run / "config.yaml").write_text(
        f"# hash abc\nseed: 7\ndata:\n  train: {sorted_shards['data']}\n  val: {sorted_shards['data']}\n"
    )
    (run / "train.log").write_text(
        "2026-11-30 10:00:00,123 INFO mmalign.run.train: start\nno stamp here\n"
        "2026-11-30 10:02:05,001 INFO mmalign.run.train: done\n"
    )
    suite = sorted_shards["suite"]
    page = write_report(
        run, tmp_path / "all", suite=str(suite), data=sorted_shards["data"], limit=30
    ).read_text()
    headings = [
        h
        for h in ("eval_step00000010.json", "eval_step00000020.json", "eval.json")
        if f"<h2>{h}</h2>" in page
    ]
    assert headings == ["eval_step00000010.json", "eval_step00000020.json", "eval.json"]
    # each file's own value under its own heading (other tables may hold the same numbers)
    starts = [page.index(f"<h2>{h}</h2>") for h in headings] + [len(page)]
    for i, value in enumerate(("0.125", "0.25", "0.5")):
        assert f"<td>{value}</td>" in page[starts[i] : starts[i + 1]], (headings[i], value)
    assert "seed: 7" in page and "0h 02m 05s" in page
    assert "3 of 3 shards present, 60 samples (sizes.json)" in page
    assert "classes (classname)</td><td>3: bird 10, cat 10, dog 10" in page  # a stratified 30 of 60
    assert "holds one class" not in page and "retrieval not meaningful" not in page
    (run / "train.log").write_text("no timestamps\n")  # then file times: config.yaml to the last output
    os.utime(run / "config.yaml", (1_000_000, 1_000_000))
    for p in [run / "final", *run.glob("eval*.json")]:
        os.utime(p, (1_000_000 + 3725, 1_000_000 + 3725))
    assert run_time(run).startswith("1h 02m 05s (file times")
    # one shard of a class-sorted set: the sample holds one class, and the page says so
    one = sorted_shards["data"].replace("{00000..00002}", "00001")
    page = write_report(run, tmp_path / "one", suite=str(suite), data=one, limit=10).read_text()
    assert "the embedded sample holds one class (classname = cat)" in page
    # a suite whose captions are class templates: retrieval is marked
    templated = tmp_path / "templated.yaml"
    templated.write_text("template_captions: true\n" + suite.read_text())
    page = write_report(
        run, tmp_path / "tpl", suite=str(templated), data=sorted_shards["data"], limit=12
    ).read_text()
    assert "retrieval not meaningful" in page and "src='recall.png'" in page
