"""bench/gpu_vs_openclip.py's CPU dry run: every arm (mmalign / open_clip x eager / compiled) runs
end to end on micro towers, so the side-by-side GPU benchmark cannot rot between the sessions
that are lent a GPU (~15 s here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration


def test_gpu_vs_openclip_dry_run_writes_a_row_per_arm(tmp_path):
    doc = tmp_path / "bench.md"
    proc = subprocess.run(
        [sys.executable, "bench/gpu_vs_openclip.py", "--dry-run", "--doc", str(doc)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    text = doc.read_text()
    assert "## GPU: mmalign vs open_clip_train (bench/gpu_vs_openclip.py)" in text and "--dry-run" in text
    rows = [
        [c.strip() for c in line.split("|")[1:-1]]
        for line in text.splitlines()
        if line.startswith(("| mmalign |", "| open_clip |"))
    ]
    assert [(r[0], r[1]) for r in rows] == [
        ("mmalign", "eager"),
        ("open_clip", "eager"),
        ("mmalign", "compiled"),
        ("open_clip", "compiled"),
    ], rows
    assert "FAILED" not in text and "SKIPPED" not in text, rows
    for r in rows:
        assert len(r[2].split("(")[1].split(",")) == 2, r  # two alternated turns per arm
        float(r[2].split()[0])  # samples/s
        # both tools' towers ran under bf16 autocast: features recorded before any float() cast
        assert r[6] == "bfloat16 / bfloat16", r
        assert r[7].endswith("CPU ops"), r  # the profiler probe ran (device kernels on a GPU)
    assert "eager vs eager" in text and "compiled vs compiled" in text and "not judged (CPU dry run)" in text
