"""bench/harness.py's small pieces, against hand-written expectations: the command line a reader
types again, the ratio cell, the markdown table, the machine and device lines. No bench is run."""

from __future__ import annotations

import platform
import sys

import pytest

harness = pytest.importorskip("bench.harness")


def test_command_is_the_script_and_its_arguments_quoted(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["bench/loss.py", "--sizes", "1024", "--label", "a b"])
    assert harness.command() == "python bench/loss.py --sizes 1024 --label 'a b'"
    assert harness.command([]) == "python bench/loss.py"
    assert harness.command(["--dry-run"], "gpu_check.py") == "python bench/gpu_check.py --dry-run"


def test_ratio_is_value_over_anchor_with_two_decimals():
    assert harness.ratio(3.0, 2.0) == "1.50x"
    assert harness.ratio(1.0, 3.0) == "0.33x"
    assert harness.ratio(5.0, 0.0) == "-"  # no anchor: no ratio


def test_table_is_markdown():
    assert harness.table(["case", "s"], [["a", 1.5], ["b", "2"]]) == (
        "| case | s |\n|---|---|\n| a | 1.5 |\n| b | 2 |\n"
    )


def test_cpu_line_names_architecture_cores_bf16_flags_and_threads(monkeypatch):
    monkeypatch.setattr(harness, "usable_cores", lambda: 3)
    monkeypatch.setattr(harness, "bf16_flags", lambda: "no native bf16")
    assert harness.cpu_line() == f"{platform.machine()}, 3 CPU cores (no native bf16)"
    assert harness.cpu_line(2).endswith("(no native bf16), 2 torch threads")


def test_device_line_on_the_cpu_says_dry_run():
    assert harness.device_line("cpu").startswith("CPU dry run (")


def test_paths_are_the_repository_s():
    assert (harness.ROOT / "bench" / "harness.py").is_file()
    assert harness.DOC == harness.ROOT / "docs" / "benchmarks.md"


_REUSE = r"""
import json, numpy as np
from bench.harness import reset_peak, status_mb
CHUNK, N = 8192, 3000  # 64 KiB float64 blocks: below glibc's mmap threshold, so heap memory
held = [np.ones(CHUNK) for _ in range(N)]
held = held[::10]  # 9 of 10 freed; the survivors keep the freed pages inside the heap
before = reset_peak() if TRIM else (open("/proc/self/clear_refs", "w").write("5"), status_mb("VmRSS"))[1]
again = [np.ones(CHUNK) for _ in range(N - N // 10)]  # the step: as much as was freed, touched
print(json.dumps(status_mb("VmHWM") - before))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and glibc")
def test_reset_peak_makes_a_step_that_reuses_freed_memory_count_it():
    """A step that reuses the set-up's freed memory: with reset_peak its own peak shows it (~170
    MB allocated and touched); with clear_refs alone (the naive reset) it reads near zero. Each
    in a fresh process, so that the heap starts the same."""
    import json
    import subprocess

    from bench.harness import ROOT

    def step_mb(trim: bool) -> float:
        code = f"TRIM = {trim}\n" + _REUSE
        out = subprocess.run(
            [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout.strip().splitlines()[-1])

    allocated = (3000 - 300) * 8192 * 8 / 2**20  # MB the step allocates
    assert step_mb(True) > 0.8 * allocated
    assert step_mb(False) < 0.2 * allocated  # the premise: without the hand-back the reuse is unseen
