"""bench/search_serve.py end to end at a tiny size: the base tree comes out of git, both servers
start on the same index and model, every point gets answers from both, and the section is
written. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration

SECTION = "## Search server throughput (bench/search_serve.py)"


def test_the_bench_runs_both_servers_and_writes_its_section(tmp_path):
    if subprocess.run(["git", "cat-file", "-e", "4346fd8^{commit}"], cwd=ROOT).returncode:
        pytest.skip("the base revision 4346fd8 is not in this checkout (a shallow clone?)")
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\n## Another section\n\nkept\n")
    argv = ["--n", "500", "--dim", "32", "--seconds", "0.5", "--warmup", "0.2", "--clients", "1", "2"]
    argv += ["--json", str(tmp_path / "r.json"), "--write-doc", "--doc", str(doc), "--allow-loaded"]
    proc = subprocess.run(
        [sys.executable, "bench/search_serve.py", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "r.json").read_text())
    for name in ("base", "new"):
        for clients in ("1", "2"):
            point = results[name][clients]
            assert point["ok"] > 0 and point["errors"] == 0, (name, clients, point)
    text = doc.read_text()
    assert SECTION in text and "## Another section\n\nkept" in text
    rows = [ln for ln in text.splitlines() if ln.startswith("| 1 |") or ln.startswith("| 2 |")]
    assert len(rows) == 2 and "Goal (issue 41): at 2 clients" in text
