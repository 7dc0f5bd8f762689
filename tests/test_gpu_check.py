"""bench/gpu_check.py's CPU dry run: every part of the one-GPU check runs end to end here,
so the script cannot rot between the sessions that are lent a GPU."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration


def test_gpu_check_dry_run_writes_every_row(tmp_path):
    doc = tmp_path / "bench.md"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--doc", str(doc)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = doc.read_text()
    assert "## GPU check (bench/gpu_check.py)" in text and "--dry-run" in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    parts = [r.split("|")[1].strip() for r in rows]
    assert parts.count("gpu tests") == 1 and parts.count("loss") == 2 and parts.count("step") == 2
    assert parts.count("bf16 accumulation") == 4
    assert not any("FAILED" in r for r in rows), rows
    errors = {r.split("|")[2].strip(): float(r.split("|")[3]) for r in rows if "rel. grad error" in r}
    assert len(errors) == 3 and all(0 < e < 0.2 for e in errors.values()), errors
