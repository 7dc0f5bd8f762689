"""Recall@k over class-template captions carries one caveat wherever it is printed (issue 39,
point 4): ``mmalign eval``'s table, a run's headline, the HTML report and ``index_recall``."""

from __future__ import annotations

import logging

import pytest

from mmalign.cli import main
from mmalign.evaluation import caveats, headline
from mmalign.evaluation.caveats import TEMPLATE_CAVEAT, looks_templated
from mmalign.search.recall import index_recall
from tests.evaluation.test_evaluation_suite_fit import CIFAR, cifar_like
from tests.harness.searchdata import save_random_model

TEMPLATES = ["a photo of a {c}.", "a blurry photo of a {c}.", "a photo of the big {c}."]


def test_template_captions_are_told_from_captions_that_describe_images():
    # 3 templates x 10 classes over 200 images: 30 distinct captions
    templated = [TEMPLATES[i % 3].format(c=CIFAR[i % 10]) for i in range(200)]
    assert len(set(templated)) == 30 and looks_templated(templated, 200)
    described = [f"a {size} {colour} thing" for size in range(20) for colour in range(10)]
    assert not looks_templated(described, 200)
    assert not looks_templated(templated[:20], 20)  # too few images to tell


def _retrieval(dataset: str, templated: bool) -> dict:
    record = {
        "dataset": dataset,
        "task": "zeroshot_retrieval",
        "n_images": 100,
        "metrics": {"image_retrieval_recall@1": 0.1, "text_retrieval_recall@1": 0.2},
    }
    return {**record, "template_captions": True} if templated else record


def test_the_headline_and_the_eval_table_print_the_caveat(capsys, monkeypatch):
    from mmalign.cli_eval import _print_table

    records = [_retrieval("cifar/retrieval", True), _retrieval("coco/retrieval", False)]
    text = "\n".join(headline.lines(records, "eval.json"))
    assert text.count(TEMPLATE_CAVEAT) == 1 and f"cifar/retrieval: {TEMPLATE_CAVEAT}" in text
    monkeypatch.setenv("COLUMNS", "200")
    _print_table(records)
    out = capsys.readouterr().out
    assert out.count(TEMPLATE_CAVEAT) == 1 and f"note: cifar/retrieval: {TEMPLATE_CAVEAT}" in out
    assert caveats.note_lines([_retrieval("coco/retrieval", False)]) == []


def test_the_report_uses_the_same_words():
    import inspect

    from mmalign.evaluation import report

    assert "TEMPLATE_CAVEAT" in inspect.getsource(report)


@pytest.fixture(scope="module")
def cifar_index(tmp_path_factory):
    """A random model, CIFAR-like shards (template captions), their embeddings and an index."""
    root = tmp_path_factory.mktemp("caveat")
    shard = cifar_like(root / "val" / "00000.tar", n=60)
    model = save_random_model(root / "model", seed=5)
    assert main(["embed", "--model", model, "--data", str(shard), "--out", str(root / "emb")]) == 0
    assert main(["index", "--emb", str(root / "emb"), "--out", str(root / "idx")]) == 0
    return {"model": model, "shard": shard, "idx": root / "idx"}


def test_index_recall_warns_on_template_captions(cifar_index, caplog):
    with caplog.at_level(logging.WARNING, logger="mmalign.search"):
        metrics = index_recall(cifar_index["idx"], (1, 5))
    assert set(metrics) == {
        "image_retrieval_recall@1",
        "image_retrieval_recall@5",
        "text_retrieval_recall@1",
        "text_retrieval_recall@5",
    }
    assert [r.getMessage().endswith(TEMPLATE_CAVEAT) for r in caplog.records] == [True]


def test_mmalign_eval_marks_retrieval_on_template_captions(cifar_index, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "r.json"
    assert (
        main(
            [
                "eval",
                "--model",
                cifar_index["model"],
                "--suite",
                "retrieval",
                "--data",
                str(cifar_index["shard"]),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert f"note: retrieval/retrieval: {TEMPLATE_CAVEAT}" in printed
    import json

    assert json.loads(out.read_text())[0]["template_captions"] is True
