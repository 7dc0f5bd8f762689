"""bench/distill_cifar10.py: the goal line (distilled >= scratch + 2 points beyond the spread), its
table, and the whole script at ``--quick`` size (slow: real trainings on CIFAR-10; skipped without
the images)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest

from tests.harness import ROOT


def _load():
    sys.path.insert(0, str(ROOT / "bench"))  # the script's `import _bootstrap`
    try:
        spec = importlib.util.spec_from_file_location(
            "bench_distill_under_test", ROOT / "bench" / "distill_cifar10.py"
        )
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return mod


bench = _load()
CIFAR = ROOT.parent / "shared" / "data" / "cifar10"


def test_mean_and_sample_std_by_hand():
    m, s = bench.mean_std([40.0, 42.0, 47.0])
    assert m == pytest.approx(43.0)
    assert s == pytest.approx(math.sqrt((9 + 1 + 16) / 2))
    assert bench.mean_std([41.5]) == (41.5, 0.0)


@pytest.mark.parametrize(
    ("scratch", "distilled", "verdict"),
    [
        ([40.0, 40.0, 40.0], [42.0, 42.0, 42.0], "met"),  # +2 with no spread: exactly the goal
        ([40.0, 40.0, 40.0], [41.9, 41.9, 41.9], "not met"),
        ([39.0, 40.0, 41.0], [43.0, 44.0, 45.0], "met"),  # +4, spread 1 + 1: 2 beyond it
        ([39.0, 40.0, 41.0], [42.5, 43.5, 44.5], "not met"),  # +3.5, spread 2: 1.5 beyond it
        ([45.0, 46.0, 47.0], [40.0, 41.0, 42.0], "not met"),
    ],
)
def test_goal_counts_the_spread_of_both_arms(scratch, distilled, verdict):
    line = bench.goal_line(scratch, distilled)
    assert line.endswith(f"goal >= +2: {verdict})")


def test_table_rows_and_a_goal_line_per_distill_weight():
    runs = [
        {"arm": "scratch", "weight": 0.0, "acc1": 0.40, "process_s": 100.0},
        {"arm": "scratch", "weight": 0.0, "acc1": 0.42, "process_s": 120.0},
        {"arm": "distilled", "weight": 1.0, "acc1": 0.47, "process_s": 110.0},
        {"arm": "distilled", "weight": 1.0, "acc1": 0.47, "process_s": 130.0},
        {"arm": "distilled", "weight": 5.0, "acc1": 0.43, "process_s": 100.0},
        {"arm": "distilled", "weight": 5.0, "acc1": 0.41, "process_s": 100.0},
    ]
    text = bench.results_table(runs)
    assert "| scratch | 2 | 40.00, 42.00 | 41.00 +- 1.41 | 110 |" in text
    assert "| distilled, weight 1 | 2 | 47.00, 47.00 | 47.00 +- 0.00 | 120 |" in text
    assert "| distilled, weight 5 | 2 | 43.00, 41.00 | 42.00 +- 1.41 | 100 |" in text
    lines = text.splitlines()
    assert lines.index("| scratch | 2 | 40.00, 42.00 | 41.00 +- 1.41 | 110 |") == 2  # scratch first
    ten = bench.results_table([*runs, {"arm": "distilled", "weight": 10.0, "acc1": 0.4, "process_s": 1.0}])
    assert ten.index("weight 5 |") < ten.index("weight 10 |")  # by weight, not as text
    assert "- distilled, weight 1 - scratch: +6.00 points" in text and text.count("goal >= +2") == 2
    assert "goal >= +2: met" in text and "goal >= +2: not met" in text
    assert "not evaluated" in bench.results_table(runs[:2])


def test_run_names_keep_weight_1_under_the_plain_name():
    assert bench.run_name("scratch", 2, 0.0) == "scratch_seed2"
    assert bench.run_name("distilled", 0, 1.0) == "distilled_seed0"
    assert bench.run_name("distilled", 1, 5.0) == "distilled_w5_seed1"


@pytest.mark.slow
@pytest.mark.skipif(not (CIFAR / "train.tar").is_file(), reason="CIFAR-10 tars not in ../shared/data/cifar10")
def test_quick_run_trains_both_arms_from_a_stored_teacher(tmp_path):
    work = tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, "bench/distill_cifar10.py", "--quick", "--work", str(work), "--data", str(CIFAR)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((work / "results.json").read_text())
    assert sorted(r["arm"] for r in results["runs"]) == ["distilled", "scratch"]
    assert all(0.0 <= r["acc1"] <= 1.0 for r in results["runs"])
    info = json.loads((work / "teacher_shards" / "teacher.json").read_text())
    assert info["count"] == 2000 and info["embed_dim"] == 160
    assert "| distilled, weight 1 | 1 |" in results["markdown"] and "goal >= +2" in results["markdown"]


def test_a_finished_run_is_found_again_by_its_settings(tmp_path):
    """The stamp round-trips through JSON (tuples come back as lists): the same settings find the
    run (a rerun resumes), other settings do not."""
    want = {"sets": ("model.embed_dim=160", "model.vision.layers=5"), "steps": 250, "batch": 256}
    stamp = tmp_path / "teacher.json"
    stamp.write_text(json.dumps({"want": want, "result": {"acc1": 0.5}}))
    assert bench._cached(stamp, want) == {"acc1": 0.5}
    assert bench._cached(stamp, {**want, "steps": 300}) is None
    assert bench._cached(tmp_path / "absent.json", want) is None
