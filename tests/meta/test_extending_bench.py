"""docs/architecture.md, "Adding a benchmark", followed as written: its script goes into the bench/
folder of a scratch copy of the repository (the harness, the load guard and a copy of
docs/benchmarks.md), runs as ``python bench/sort.py`` with a tiny workload, and writes its section
(command, CPU line, a ratio column against the anchor) without touching the others."""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness import ROOT

GUIDE = ROOT / "docs" / "architecture.md"
HARNESS = ("__init__.py", "_bootstrap.py", "harness.py", "idle.py", "docsection.py")
HEADING = "## Sorting (bench/sort.py)"


def _guide_script() -> str:
    text = GUIDE.read_text()
    section = text.split("## Adding a benchmark", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 1, "the walk-through has one script"
    return blocks[0]


def _sections(doc: str) -> dict[str, str]:
    parts = re.split(r"(?m)^(?=## )", doc)
    return {p.split("\n", 1)[0]: p for p in parts if p.startswith("## ")}


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    """A repository root with bench/'s harness, the guide's script and a copy of the benchmarks doc."""
    (tmp_path / "bench").mkdir()
    for name in HARNESS:
        shutil.copy(ROOT / "bench" / name, tmp_path / "bench" / name)
    (tmp_path / "bench" / "sort.py").write_text(_guide_script())
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "benchmarks.md", tmp_path / "docs" / "benchmarks.md")
    return tmp_path


def _run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "bench/sort.py", *args], cwd=root, capture_output=True, text=True, timeout=120
    )


def test_the_guide_s_benchmark_writes_its_table(scratch):
    before = (scratch / "docs" / "benchmarks.md").read_text()
    args = ("--n", "2000", "--repeats", "2", "--write-doc", "--allow-loaded")
    proc = _run(scratch, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    after = (scratch / "docs" / "benchmarks.md").read_text()
    old, new = _sections(before), _sections(after)
    assert HEADING not in old and HEADING in new
    assert {h: t.rstrip() for h, t in new.items() if h != HEADING} == {h: t.rstrip() for h, t in old.items()}
    section = new[HEADING]
    # the load note under the heading (idle or marked as taken under load: --allow-loaded)
    note = section.split("\n")[2]
    assert note.startswith(("Idle machine: load ", "Taken under load (load ")), section
    command_line = next(line for line in section.splitlines() if line.startswith("Command: "))
    assert command_line.startswith(f"Command: `python bench/sort.py {' '.join(args)}` · ")
    assert f"{platform.machine()}, " in command_line and " CPU cores (" in command_line
    rows = [
        [c.strip() for c in line.strip("|").split("|")]
        for line in section.splitlines()
        if line.startswith("|")
    ]
    assert rows[0] == ["case", "ms", "vs list.sort()"] and len(rows) == 4
    assert rows[2][0] == "list.sort()" and rows[2][2] == "1.00x"  # the anchor against itself
    assert rows[3][0] == "sorted()" and re.fullmatch(r"\d+\.\d\dx", rows[3][2]), rows[3]


def test_the_guide_s_benchmark_reruns_in_place_and_prints_without_write_doc(scratch):
    assert _run(scratch, "--n", "500", "--repeats", "1", "--write-doc", "--allow-loaded").returncode == 0
    assert "--n 500" in (scratch / "docs" / "benchmarks.md").read_text()
    assert _run(scratch, "--n", "600", "--repeats", "1", "--write-doc", "--allow-loaded").returncode == 0
    twice = (scratch / "docs" / "benchmarks.md").read_text()
    assert twice.count(HEADING) == 1 and "--n 600" in twice and "--n 500" not in twice
    proc = _run(scratch, "--n", "300", "--repeats", "1")
    assert proc.returncode == 0 and HEADING in proc.stdout and "--n 300" in proc.stdout
    assert (scratch / "docs" / "benchmarks.md").read_text() == twice  # no --write-doc: the doc is left alone
