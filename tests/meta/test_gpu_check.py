"""bench/gpu_check.py's CPU dry run: every part of the one-GPU check runs end to end here,
so the script cannot rot between the sessions that are lent a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration


def test_gpu_check_dry_run_writes_every_row(tmp_path):
    doc = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--doc", str(doc)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = doc.read_text()
    assert "## GPU check (bench/gpu_check.py)" in text and "--dry-run" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    parts = [r.split("|")[1].strip() for r in rows]
    assert parts.count("gpu tests") == 1 and parts.count("loss") == 2 and parts.count("step") == 2
    assert not any("FAILED" in r for r in rows), rows
    accum = [r for r in rows if r.split("|")[1].strip() == "bf16 accumulation"]
    assert (
        len(accum) == 2
        and "before: accumulate bfloat16" in accum[0]
        and "after: accumulate float32" in accum[1]
    )
    exact = [float(r.rsplit("chunk grads", 1)[1].strip(" |")) for r in accum]
    assert exact[1] < exact[0] / 10, exact  # fp32 accumulation removes the summation error
