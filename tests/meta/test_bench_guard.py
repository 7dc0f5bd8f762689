"""bench/idle.py, the load guard of the benchmark tables: an idle run writes its section with the
two loads, a loaded run leaves the document alone and says why in one line (exit status 3), and
``--allow-loaded`` writes the section marked as taken under load.  Every bench script that writes
a doc table goes through it (bench/harness.py re-exports it) and accepts ``--allow-loaded``; only
bench/_bootstrap.py changes ``sys.path``.  No bench is run here: the load average and the core
count are patched."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import os
import subprocess
import sys
import time

import pytest

from tests.harness import ROOT

BENCH = ROOT / "bench"
HEADING = "## Some bench (bench/some.py)"
TEXT = f"{HEADING}\n\nCommand: `python bench/some.py`\n\n| a | b |\n|---|---|\n| 1 | 2 |\n"


def _load_idle():
    spec = importlib.util.spec_from_file_location("bench_idle_under_test", BENCH / "idle.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture
def idle():
    return _load_idle()


def machine(
    monkeypatch, loads: list[float], cpu_count: int = 2, affinity: int | None = None, own: float = 0.0
) -> None:
    """The 1-minute load averages successive os.getloadavg() calls return, the core counts, and the
    bench's own CPU use (cores busy over a 10 s run; successive os.times() / monotonic readings)."""
    it = iter(loads)
    cpu = iter([0.0, 10.0 * own])
    clock = iter([100.0, 110.0])
    monkeypatch.setattr(os, "times", lambda: os.times_result((next(cpu), 0.0, 0.0, 0.0, 0.0)))
    monkeypatch.setattr(time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(os, "getloadavg", lambda: (next(it), 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: cpu_count)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity or cpu_count)), raising=False)


def _doc(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n\n## Other (bench/other.py)\n\nkept\n")
    return doc


def test_idle_run_writes_the_section_with_both_loads(idle, monkeypatch, tmp_path, capsys):
    machine(monkeypatch, [0.4, 1.9])
    watch = idle.LoadWatch()
    doc = _doc(tmp_path)
    idle.write_section(doc, TEXT, watch, allow_loaded=False)
    text = doc.read_text()
    assert watch.describe() == "load 0.4 at start, 1.9 at end (the bench itself used 0.0), 2 cores"
    assert (
        f"{HEADING}\n\nIdle machine: load 0.4 at start, 1.9 at end (the bench itself used 0.0), 2 cores"
        in text
    )
    assert "| 1 | 2 |" in text and "## Other (bench/other.py)\n\nkept" in text  # the other section stays
    assert "under load" not in text.lower()
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("loads", [[0.5, 3.1], [2.6, 1.2]], ids=["loaded-at-end", "loaded-at-start"])
def test_loaded_run_leaves_the_doc_alone_and_says_why_in_one_line(idle, monkeypatch, tmp_path, capsys, loads):
    machine(monkeypatch, loads)
    watch = idle.LoadWatch()
    doc = _doc(tmp_path)
    before = doc.read_text()
    with pytest.raises(SystemExit) as exc:
        idle.write_section(doc, TEXT, watch, allow_loaded=False)
    assert exc.value.code == idle.EXIT_LOADED == 3
    assert doc.read_text() == before
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert (
        "not written" in err
        and f"load {loads[0]:.1f} at start, {loads[1]:.1f} at end (the bench itself used 0.0), 2 cores" in err
    )
    assert "--allow-loaded" in err


def test_loaded_run_does_not_create_a_missing_doc(idle, monkeypatch, tmp_path):
    machine(monkeypatch, [4.0, 4.0])
    doc = tmp_path / "docs" / "benchmarks.md"
    with pytest.raises(SystemExit):
        idle.write_section(doc, TEXT, idle.LoadWatch(), allow_loaded=False)
    assert not doc.exists()


def test_allow_loaded_writes_the_section_marked_as_taken_under_load(idle, monkeypatch, tmp_path, capsys):
    machine(monkeypatch, [0.5, 3.1])
    doc = _doc(tmp_path)
    idle.write_section(doc, TEXT, idle.LoadWatch(), allow_loaded=True)
    text = doc.read_text()
    assert (
        f"{HEADING}\n\nTaken under load (load 0.5 at start, 3.1 at end (the bench itself used 0.0), 2 cores): not comparable"
        in text
    )
    assert "| 1 | 2 |" in text and "Idle machine" not in text
    assert capsys.readouterr().err == ""


def test_load_equal_to_the_core_count_is_not_loaded(idle, monkeypatch):
    machine(monkeypatch, [2.0, 2.0])
    assert not idle.LoadWatch().loaded
    machine(monkeypatch, [2.0, 2.01])
    assert idle.LoadWatch().loaded


def test_the_bench_own_cpu_use_is_not_counted_as_load(idle, monkeypatch):
    # an idle machine: the bench kept 2 cores busy with 3 runnable processes (2 loader workers + main)
    machine(monkeypatch, [0.1, 3.0], own=2.0)
    watch = idle.LoadWatch()
    assert not watch.loaded and "the bench itself used 2.0" in watch.describe()
    # the same bench beside another job that kept 1.5 cores busy
    machine(monkeypatch, [0.1, 4.5], own=2.0)
    assert idle.LoadWatch().loaded
    # the start reading is judged as it is (the bench has not run yet)
    machine(monkeypatch, [2.5, 2.5], own=2.0)
    assert idle.LoadWatch().loaded


def test_affinity_narrower_than_the_machine_sets_the_core_count(idle, monkeypatch):
    machine(monkeypatch, [0.2, 3.0], cpu_count=16, affinity=2)
    watch = idle.LoadWatch()
    assert watch.cores == 2 and watch.loaded
    assert watch.describe().endswith(", 2 cores")
    machine(monkeypatch, [0.2, 3.0], cpu_count=16)
    assert not idle.LoadWatch().loaded


def test_the_end_is_read_once(idle, monkeypatch):
    machine(monkeypatch, [0.1, 0.3, 9.0])
    watch = idle.LoadWatch()
    watch.stop()  # the bench ends here; the doc is written later
    assert watch.end == 0.3 and not watch.loaded and "0.3 at end" in watch.note()


def test_add_flag(idle):
    p = argparse.ArgumentParser()
    idle.add_flag(p)
    assert p.parse_args(["--allow-loaded"]).allow_loaded is True
    assert p.parse_args([]).allow_loaded is False


# ------------------------------------------------------------ every doc-writing bench script


def _calls(tree: ast.AST, name: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (
            (isinstance(n.func, ast.Name) and n.func.id == name)
            or (isinstance(n.func, ast.Attribute) and n.func.attr == name)
        )
    ]


def _doc_writers() -> dict[str, ast.AST]:
    """bench scripts that write a section of a doc (they call a ``write_section``)."""
    out = {}
    for path in sorted(BENCH.glob("*.py")):
        if path.stem in ("idle", "docsection", "harness", "_bootstrap", "__init__"):
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        if _calls(tree, "write_section"):
            out[path.stem] = tree
    return out


def test_every_doc_writing_bench_goes_through_the_guard_and_accepts_allow_loaded():
    writers = _doc_writers()
    # the detection must find the scripts known to write docs/benchmarks.md (and pair_policies.md)
    assert {
        "bf16_accum",
        "eval",
        "gpu_check",
        "gradcache",
        "loader",
        "loss",
        "pair_policies",
        "quality_cifar10",
    } <= set(writers), sorted(writers)
    for name, tree in writers.items():
        sources = {
            (n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names
        }
        assert ("bench.harness", "write_section") in sources, (
            f"bench/{name}.py writes its doc through the harness's guard (bench/idle.py)"
        )
        assert not {("docsection", "write_section"), ("bench.docsection", "write_section")} & sources, (
            f"bench/{name}.py imports the unguarded writer"
        )
        flag = (
            _calls(tree, "add_flag")
            or [c for c in _calls(tree, "parser") if ("bench.harness", "parser") in sources]
            or [
                c
                for c in _calls(tree, "add_argument")
                if any(isinstance(a, ast.Constant) and a.value == "--allow-loaded" for a in c.args)
            ]
        )
        assert flag, f"bench/{name}.py has no --allow-loaded flag"
        assert any(isinstance(n, ast.Attribute) and n.attr == "allow_loaded" for n in ast.walk(tree)), (
            f"bench/{name}.py never passes args.allow_loaded on"
        )
        for call in _calls(tree, "write_section"):
            assert len(call.args) + len(call.keywords) >= 4, (
                f"bench/{name}.py line {call.lineno}: no watch/flag"
            )


def test_harness_parser_has_the_flags():
    harness = pytest.importorskip("bench.harness")
    p = harness.parser("One line.\n\nMore.")
    assert p.description == "One line."
    args = p.parse_args(["--write-doc", "--allow-loaded"])
    assert args.write_doc is True and args.allow_loaded is True
    assert not hasattr(harness.parser(None, write_doc=None).parse_args([]), "write_doc")


# ------------------------------------------------------------ sys.path: one place


def _changes_sys_path(tree: ast.AST) -> list[int]:
    """Lines that call a method of ``sys.path`` (insert, append, ...) or assign to it."""
    return [
        n.lineno
        for n in ast.walk(tree)
        if (
            isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Attribute)
            and n.value.attr == "path"
            and isinstance(n.value.value, ast.Name)
            and n.value.value.id == "sys"
        )
        or (
            isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Attribute) and t.attr == "path" for t in n.targets)
        )
    ]


def test_only_the_bootstrap_changes_sys_path():
    found = {
        path.name: lines
        for path in sorted(BENCH.glob("*.py"))
        if (lines := _changes_sys_path(ast.parse(path.read_text())))
    }
    assert set(found) == {"_bootstrap.py"}, found
    assert _changes_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')\n")) == [2]  # the check sees one


def test_every_script_starts_with_the_bootstrap():
    """A script run as ``python bench/x.py`` has bench/, not the repository root, on sys.path: each
    one that imports ``bench.*`` at the top imports ``_bootstrap`` before."""
    for path in sorted(BENCH.glob("*.py")):
        tree = ast.parse(path.read_text())
        mains = [
            n
            for n in tree.body
            if isinstance(n, ast.If)
            and isinstance(n.test, ast.Compare)
            and ast.unparse(n.test.left) == "__name__"
        ]
        top = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
        first_party = [
            i
            for i, n in enumerate(top)
            if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("bench")
        ]
        if not mains or not first_party:
            continue
        boot = [i for i, n in enumerate(top) if isinstance(n, ast.Import) and n.names[0].name == "_bootstrap"]
        assert boot and boot[0] < first_party[0], (
            f"bench/{path.name} imports bench.* without _bootstrap first"
        )


def test_a_script_runs_from_the_repository_root():
    """``python bench/cli_latency.py --help`` (bench/ on sys.path, not the root) finds bench.harness."""
    proc = subprocess.run(
        [sys.executable, "bench/cli_latency.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--write-doc" in proc.stdout and "--allow-loaded" in proc.stdout


def test_bench_modules_import_each_other_through_the_package():
    """``from bench.x import ...``, never ``from x import ...`` (which needs bench/ on sys.path and
    breaks when the importer is itself imported), in function bodies too."""
    names = {p.stem for p in BENCH.glob("*.py")} - {"_bootstrap"}
    bare = [
        f"bench/{path.name}:{n.lineno}"
        for path in sorted(BENCH.glob("*.py"))
        for n in ast.walk(ast.parse(path.read_text()))
        if (isinstance(n, ast.ImportFrom) and n.level == 0 and n.module in names)
        or (isinstance(n, ast.Import) and any(a.name in names for a in n.names))
    ]
    assert bare == []
