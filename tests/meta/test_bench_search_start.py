"""bench/search_start.py end to end at a tiny size: the corpus is built per contract C2, every
path (the mapped one, the unmapped one, the base revision's pandas frame) opens it in a fresh
process and reads back the rows the generator wrote, and the section is written. No timing is
asserted."""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration

SECTION = "## Search start-up: memory-mapped against a pandas frame (bench/search_start.py)"


def test_the_bench_opens_every_path_and_writes_its_section(tmp_path):
    if subprocess.run(["git", "cat-file", "-e", "4346fd8^{commit}"], cwd=ROOT).returncode:
        pytest.skip("the base revision 4346fd8 is not in this checkout (a shallow clone?)")
    doc = tmp_path / "bench.md"
    doc.write_text("# Benchmarks\n\n## Another section\n\nkept\n")
    work = tmp_path / "work"
    argv = ["--rows", "20000", "--old-rows", "5000", "--vectors", "5000", "--lookups", "50", "--queries", "5"]
    argv += ["--work", str(work), "--json", str(tmp_path / "r.json"), "--write-doc", "--doc", str(doc)]
    proc = subprocess.run(
        [sys.executable, "bench/search_start.py", *argv, "--allow-loaded"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    points = json.loads((tmp_path / "r.json").read_text())
    paths = [(p["rows"], p["path"].split(" (")[0]) for p in points]
    assert paths == [(20000, "new, mmap"), (5000, "new, mmap"), (5000, "new, no mmap"), (5000, "today's")]

    # the looked-up row is the one in the file (the bench also checks it against its generator)
    table = ipc.open_file(pa.memory_map(str(work / "rows-20000" / "metadata.arrow"))).read_all()
    assert table.num_rows == 20000 and table.column("key")[123].as_py() == "000000123"
    for p in points:
        row = p["result"]["first_row"]
        assert p["result"]["first"]["url"].endswith(f"/images/{row:09d}.jpg")
        assert len(p["result"]["hit_rows"]) == 10 and max(p["result"]["hit_rows"]) < p["rows"]

    text = doc.read_text()
    assert SECTION in text and "## Another section\n\nkept" in text
    assert text.count("| 5,000 |") == 3 and "at 20,000 rows it would hold" in text and "this machine" in text


def test_a_disk_too_small_is_one_line(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "bench/search_start.py",
            "--rows",
            str(10**15),
            "--old-rows",
            "10",
            "--work",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "GB free" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
