"""`mmalign report` lists what `mmalign eval` wrote (``eval_cli_*.json``, in the run directory
and in final/) beside the run's own eval.json (issue 39, point 6)."""

import json

from mmalign.evaluation.report import cli_eval_files, write_report


def _records(dataset: str, value: float) -> list[dict]:
    return [{"dataset": dataset, "task": "zeroshot_classification", "metrics": {"acc1": value}}]


def test_report_lists_eval_cli_results_beside_eval_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "eval.json").write_text(json.dumps(_records("shapes/shape", 0.5)))
    (run / "eval_cli_cifar10.json").write_text(json.dumps(_records("cifar10/zeroshot", 0.375)))
    (run / "eval_cli_cifar10_step_20.json").write_text(json.dumps(_records("cifar10/zeroshot", 0.125)))
    # clip_benchmark's record, as `mmalign eval --cb-dataset` writes it: one object
    (run / "eval_cli_cb_cars.json").write_text(json.dumps(_records("wds/cars", 0.0625)[0]))
    (run / "eval_cli_broken.json").write_text("{not json")
    (run / "eval_cli_benchmark_datacomp").mkdir()  # a benchmark's folder is not a results file
    assert [p.name for p in cli_eval_files(run)] == [
        "eval_cli_broken.json",
        "eval_cli_cb_cars.json",
        "eval_cli_cifar10.json",
        "eval_cli_cifar10_step_20.json",
    ]
    page = write_report(run, tmp_path / "report").read_text()
    names = [
        "eval.json",
        "eval_cli_broken.json (mmalign eval)",
        "eval_cli_cb_cars.json (mmalign eval)",
        "eval_cli_cifar10.json (mmalign eval)",
        "eval_cli_cifar10_step_20.json (mmalign eval)",
    ]
    starts = [page.index(f"<h2>{n}</h2>") for n in names]
    assert starts == sorted(starts)
    ends = starts[1:] + [len(page)]
    for i, value in ((0, "0.5"), (2, "0.0625"), (3, "0.375"), (4, "0.125")):
        assert f"<td>{value}</td>" in page[starts[i] : ends[i]], names[i]
    assert "unreadable" in page[starts[1] : ends[1]]
