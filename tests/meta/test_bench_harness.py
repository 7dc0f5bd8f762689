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
