"""``mmalign eval --benchmark``: DataComp's tasks found under --root (each main metric as DataComp
defines it, their average marked partial, the absent tasks listed) and a user's YAML list of
suites.  Every main metric is recomputed here from clip_benchmark's own reader, classifier,
logits and retrieval evaluation (metrics from its logits by sklearn or by a naive loop), never
from mmalign's evaluation code."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("clip_benchmark", reason="clip_benchmark is a test extra: pip install -e '.[test]'")

from mmalign.cli import main  # noqa: E402
from mmalign.data.transforms import preprocess_cfg  # noqa: E402
from mmalign.evaluation import datacomp  # noqa: E402
from mmalign.models import TwoTower  # noqa: E402
from mmalign.models.io import save_pretrained  # noqa: E402
from mmalign.models.presets import PRESETS  # noqa: E402
from mmalign.pretrained import clip_benchmark_loader  # noqa: E402
from tests.harness.cb_reference import cb_classification, cb_logits, cb_retrieval  # noqa: E402
from tests.harness.cb_wds_gen import write_wds  # noqa: E402

BATCH = 16
# DataComp task -> (folder under root, how it is written)
DATASETS = {
    "vtab/cifar100": ("wds_vtab-cifar100", dict(task="classification", seed=1)),  # acc1
    "vtab/pets": (
        "wds_vtab-pets_test",
        dict(task="classification", seed=2, image_ext="jpg"),
    ),  # mean per-class recall
    "retrieval/mscoco_2014_5k_test_image_text_retrieval": (
        "wds_mscoco_captions",
        dict(task="retrieval", seed=3),
    ),
    "fairness/geode": ("geode", dict(task="classification", seed=4, groups=3)),  # worst-group accuracy
    "wilds/iwildcam": ("wds_wilds-iwildcam", dict(task="classification", seed=5)),  # macro F1
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    torch.manual_seed(1)  # a random model that predicts more than one class: no metric is degenerate
    model = TwoTower(PRESETS["micro"], init_logit_scale=math.log(50.0))
    save_pretrained(model, tmp / "model", preprocess=preprocess_cfg(model.image_size))
    truth = {key: write_wds(tmp / "data" / folder, n=30, **kw) for key, (folder, kw) in DATASETS.items()}
    return tmp, truth, clip_benchmark_loader(pretrained=tmp / "model")


def _naive_macro_f1(pred: np.ndarray, target: np.ndarray) -> float:
    scores = []
    for c in np.unique(target):
        tp = int(((pred == c) & (target == c)).sum())
        fp, fn = int(((pred == c) & (target != c)).sum()), int(((pred != c) & (target == c)).sum())
        scores.append(2 * tp / (2 * tp + fp + fn) if tp + fp + fn else 0.0)
    return float(np.mean(scores))


def _reference(tmp, truth, cb) -> dict[str, float]:
    """Each present task's main metric from clip_benchmark's numbers."""
    data = tmp / "data"
    cifar = cb_classification(*cb, data / "wds_vtab-cifar100", BATCH)
    pets = cb_classification(*cb, data / "wds_vtab-pets_test", BATCH)
    coco = cb_retrieval(*cb, data / "wds_mscoco_captions", BATCH)
    logits, target = cb_logits(*cb, data / "geode", BATCH)
    hits = (logits.argmax(dim=1) == target).numpy()
    groups = np.array([s["group"] for s in truth["fairness/geode"]])
    assert (target.numpy() == [s["label"] for s in truth["fairness/geode"]]).all()  # same sample order
    logits_w, target_w = cb_logits(*cb, data / "wds_wilds-iwildcam", BATCH)
    return {
        "vtab/cifar100": cifar["acc1"],
        "vtab/pets": pets["mean_per_class_recall"],
        "retrieval/mscoco_2014_5k_test_image_text_retrieval": 0.5
        * (coco["image_retrieval_recall@1"] + coco["text_retrieval_recall@1"]),
        "fairness/geode": min(float(hits[groups == g].mean()) for g in set(groups.tolist())),
        "wilds/iwildcam": _naive_macro_f1(logits_w.argmax(dim=1).numpy(), target_w.numpy()),
    }


def test_datacomp_reports_present_tasks_lists_absent_ones_and_a_partial_average(setup, capsys):
    tmp, truth, cb = setup
    out = tmp / "dc"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tmp / "model"),
                "--benchmark",
                "datacomp",
                "--root",
                str(tmp / "data"),
                "--output",
                str(out),
                "--batch-size",
                str(BATCH),
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    want = _reference(tmp, truth, cb)
    rows = {r["task"]: r for r in summary["tasks"]}
    assert set(rows) == set(want) == set(summary["present"])
    main_metric = {key: metric for key, _, metric in datacomp.TASKS}
    for key, value in want.items():
        assert rows[key]["main_metric"] == main_metric[key]
        assert abs(rows[key]["value"] - value) <= 1e-6, (key, rows[key], value)
    assert abs(summary["average"] - float(np.mean(list(want.values())))) <= 1e-6
    assert summary["average_over"] == 5 and summary["partial"] is True
    scored = [k for k, _, m in datacomp.TASKS if m is not None]
    assert len(scored) == 38
    assert sorted(summary["absent"]) == sorted(set(scored) - set(want) - {"misc/winogavil"})
    assert summary["unsupported"] == ["misc/winogavil"]
    assert summary["not_scored"] == ["fairness/fairface", "fairness/utkface"]
    assert "nlphuji" in rows["retrieval/mscoco_2014_5k_test_image_text_retrieval"]["note"]  # source said
    # each task's record is clip_benchmark's, named as DataComp's clip_benchmark dataset
    record = json.loads((out / rows["vtab/cifar100"]["file"]).read_text())
    assert record["dataset"] == "wds/vtab/cifar100" and record["task"] == "zeroshot_classification"
    assert list(record) == ["dataset", "model", "pretrained", "task", "metrics", "language"]
    printed = capsys.readouterr().out.splitlines()
    absent_lines = [line for line in printed if line.startswith("absent (")]
    assert len(absent_lines) == 1 and "imagenet1k" in absent_lines[0] and "vtab/pets" not in absent_lines[0]
    assert any(line.startswith("average over 5 task(s):") and "partial" in line for line in printed)


def test_group_metric_without_npy_falls_back_and_says_so():
    logits = torch.tensor([[2.0, 1.0, 0.0], [0.0, 2.0, 1.0], [0.0, 1.0, 2.0], [2.0, 0.0, 1.0]])  # (4, 3)
    labels = torch.tensor([0, 0, 2, 0])
    metric, value, note = datacomp.prediction_metric("acc_wg", logits, labels, [{"label": 0}] * 4)
    assert (metric, value) == ("acc1", 0.75) and "acc_wg" in note and ".npy" in note
    metas = [
        {"npy": [0]},
        {"npy": [0]},
        {"npy": [1]},
        {"npy": [1]},
    ]  # groups: rows 0-1 (1/2 right), 2-3 (2/2)
    assert datacomp.prediction_metric("acc_wg", logits, labels, metas) == ("acc_wg", 0.5, "")


def test_a_yaml_benchmark_of_suites(setup, tmp_path):
    tmp, truth, cb = setup
    suite = tmp_path / "mini_digits.yaml"
    suite.write_text(
        "name: mini_digits\n"
        "dataset: {type: digits, size: 16, per_class: 3}\n"
        "tasks:\n"
        "  - {name: digit, type: zeroshot, label_field: classname,\n"
        "     templates: ['a photo of the number: \"{c}\".'],\n"
        "     classnames: [zero, one, two, three, four, five, six, seven, eight, nine]}\n"
        "  - {name: geometry, type: diagnostics}\n"
    )
    bench = tmp_path / "mine.yaml"
    bench.write_text(
        "- cb:wds_vtab-cifar100\n"
        "- {suite: 'cb:wds_vtab-pets_test', main_metric: mean_per_class_recall}\n"
        "- cb:wds_not_here\n"
        "- mini_digits.yaml\n"
    )
    out = tmp_path / "out"
    assert (
        main(
            [
                "eval",
                "--model",
                str(tmp / "model"),
                "--benchmark",
                str(bench),
                "--root",
                str(tmp / "data"),
                "--output",
                str(out),
                "--batch-size",
                str(BATCH),
            ]
        )
        == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["benchmark"] == "mine"
        and summary["absent"] == ["cb:wds_not_here"]
        and summary["partial"] is True
    )
    rows = {r["dataset"]: r for r in summary["tasks"]}
    assert set(rows) == {
        "wds/vtab-cifar100",
        "wds/vtab-pets_test",
        "mini_digits/digit",
        "mini_digits/geometry",
    }
    assert rows["mini_digits/geometry"]["main_metric"] is None  # a diagnostics task is written, not scored
    # references: clip_benchmark on the wds folders; on the digits, its classifier and logits
    from clip_benchmark.metrics import zeroshot_classification as cb_zs

    from mmalign.evaluation import load_suite
    from mmalign.evaluation.datasets import dataset_spec, iter_dataset

    model, transform, tokenizer = cb
    digits = load_suite(str(suite))
    samples = list(iter_dataset(dataset_spec(digits)))
    names = digits["tasks"][0]["classnames"]
    items = [(transform(s["image"]), names.index(s["json"]["classname"])) for s in samples]
    loader = torch.utils.data.DataLoader(items, batch_size=BATCH)
    weights = cb_zs.zero_shot_classifier(
        model, tokenizer, names, digits["tasks"][0]["templates"], "cpu", amp=False
    )
    logits, target = cb_zs.run_classification(model, weights, loader, "cpu", amp=False)
    want = {
        "wds/vtab-cifar100": cb_classification(*cb, tmp / "data" / "wds_vtab-cifar100", BATCH)["acc1"],
        "wds/vtab-pets_test": cb_classification(*cb, tmp / "data" / "wds_vtab-pets_test", BATCH)[
            "mean_per_class_recall"
        ],
        "mini_digits/digit": (logits.argmax(dim=1) == target).float().mean().item(),
    }
    for name, value in want.items():
        assert abs(rows[name]["value"] - value) <= 1e-6, (name, rows[name], value)
    assert rows["wds/vtab-pets_test"]["main_metric"] == "mean_per_class_recall"
    assert (
        abs(summary["average"] - float(np.mean(list(want.values())))) <= 1e-6 and summary["average_over"] == 3
    )
    assert (out / rows["mini_digits/digit"]["file"]).is_file()


def test_benchmark_mistakes_are_one_line(setup, tmp_path, capsys):
    tmp, _, _ = setup
    bad = tmp_path / "bad.yaml"
    bad.write_text("suite: shapes\n")
    typo = tmp_path / "typo.yaml"
    typo.write_text("- {suite: shapes, metric: acc1}\n")
    model = ["eval", "--model", str(tmp / "model")]
    cases = [
        (["--benchmark", "datacomp"], "--benchmark datacomp needs --root DIR"),
        (["--benchmark", "datacomp", "--root", str(tmp_path / "nope")], "--root: no such folder"),
        (["--benchmark", "nope"], "neither a shipped benchmark (datacomp) nor a YAML file"),
        (["--benchmark", str(bad)], "must be a non-empty YAML list of suites"),
        (["--benchmark", str(typo)], "unknown keys ['metric']"),
        (
            ["--benchmark", "datacomp", "--root", str(tmp), "--suite", "shapes"],
            "--benchmark runs its own tasks",
        ),
    ]
    for args, message in cases:
        assert main(model + args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("mmalign: error: ") and err.count("\n") == 1 and message in err, (args, err)
