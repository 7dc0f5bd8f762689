"""The headline results (issue 28, point 9): zero-shot top-1 / top-5 and R@1/5/10 from a run's
eval.json (clip_benchmark's metric names), as the end of a run prints them and as the report
puts them at the top of its page. A real run's final lines are checked in
tests/cli/test_progress.py (under a zero-size terminal)."""

from __future__ import annotations

import json
import random

from mmalign.evaluation import headline, report
from mmalign.run.runlog import say


def sample_records(seed: int) -> list[dict]:
    """An eval.json as a shapes-suite run writes it, with random metric values (and one a NaN
    the evaluation stored as null), plus a task kind the headline leaves out."""
    rng = random.Random(seed)
    value = lambda: rng.random()  # noqa: E731
    return [
        {
            "dataset": "shapes/shape",
            "task": "zeroshot_classification",
            "n_images": 120,
            "n_captions": 240,
            "metrics": {
                "acc1": value(),
                "acc5": value(),
                "mean_per_class_recall": value(),
                "chance_acc1": 1 / 6,
            },
        },
        {
            "dataset": "shapes/colour",
            "task": "zeroshot_classification",
            "n_images": 120,
            "n_captions": 240,
            "metrics": {"acc1": value(), "acc5": None, "chance_acc1": 1 / 7},
        },
        {
            "dataset": "shapes/retrieval",
            "task": "zeroshot_retrieval",
            "n_images": 120,
            "n_captions": 240,
            "metrics": {
                f"{side}_retrieval_recall@{k}": value() for side in ("text", "image") for k in (10, 1, 5)
            },
        },
        {
            "dataset": "shapes/probe",
            "task": "linear_probe",
            "features": "joint",
            "metrics": {"linear_acc1": value()},
        },
    ]


def test_the_headline_lines_hold_eval_json_values_and_its_path(tmp_path, seed):
    records = sample_records(seed)
    path = tmp_path / "run" / "eval.json"
    shape, colour, recall = (r["metrics"] for r in records[:3])
    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    assert headline.lines(records, path) == [
        f"results ({path}):",
        f"  shapes/shape: zero-shot top-1 {pct(shape['acc1'])}, top-5 {pct(shape['acc5'])}; chance top-1 16.7%",
        f"  shapes/colour: zero-shot top-1 {pct(colour['acc1'])}, top-5 n/a; chance top-1 14.3%",
        "  shapes/retrieval: text->image "
        + ", ".join(f"R@{k} {pct(recall[f'image_retrieval_recall@{k}'])}" for k in (1, 5, 10))
        + "; image->text "
        + ", ".join(f"R@{k} {pct(recall[f'text_retrieval_recall@{k}'])}" for k in (1, 5, 10)),
    ]
    assert headline.lines(records[3:], path) == [
        f"results: no zero-shot or retrieval task in this suite; every metric is in {path}"
    ]


def test_a_run_prints_the_headline_on_stdout_and_in_train_log(tmp_path, capsys, caplog, seed):
    records = sample_records(seed)
    with caplog.at_level("INFO", logger="mmalign.run.train"):
        headline.announce(records, tmp_path / "eval.json", say)
    printed = capsys.readouterr().out.splitlines()
    assert printed == [f"mmalign: {line}" for line in headline.lines(records, tmp_path / "eval.json")]
    assert [r.getMessage() for r in caplog.records] == headline.lines(records, tmp_path / "eval.json")


def test_the_report_opens_with_the_headline_of_the_last_evaluation(tmp_path, monkeypatch, seed):
    run = tmp_path / "run"
    run.mkdir()
    records = sample_records(seed)
    (run / "eval_step00000010.json").write_text(json.dumps(sample_records(seed + 1)))
    (run / "eval.json").write_text(json.dumps(records))

    def no_model(*args, **kwargs):
        raise FileNotFoundError("no final/ in the run")  # the report's own branch for a run without weights

    monkeypatch.setattr(report, "_embed_run", no_model)
    page = report.write_report(run).read_text()
    sections = page.split("<h2>")
    assert sections[1].startswith("Headline results") and f"<code>{run / 'eval.json'}</code>" in sections[1]
    acc1 = f"{100 * records[0]['metrics']['acc1']:.1f}%"
    r10 = f"{100 * records[2]['metrics']['image_retrieval_recall@10']:.1f}%"
    assert (
        f"<td>shapes/shape</td><td>zero-shot top-1</td><td>{acc1}</td>" in sections[1]
        and f"<td>shapes/retrieval</td><td>text-&gt;image R@10</td><td>{r10}</td>" in sections[1]
    )
    assert "linear_acc1" not in sections[1]  # the probes stay in the full tables below

    (run / "eval.json").unlink()  # a run stopped before its end: the newest step evaluation
    assert f"<code>{run / 'eval_step00000010.json'}</code>" in report.headline_section(run)
    (run / "eval_step00000010.json").write_text('[{"dataset": ')
    assert "unreadable" in report.headline_section(run)
    (run / "eval_step00000010.json").unlink()
    assert "no eval.json" in report.headline_section(run)
