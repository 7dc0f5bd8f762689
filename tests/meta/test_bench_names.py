"""Every bench script's functions read only globals that exist.

Benchmarks are scripts that no test runs end to end (they take minutes to an hour), so a
helper deleted in a refactor while a caller still names it surfaced only as a NameError an
hour into a benchmark (bench/quality_cifar10.py lost ``speed()`` this way).  Importing each
script and resolving every ``LOAD_GLOBAL`` of its code objects against the module's
namespace and the builtins catches that class of mistake in a second.
"""

from __future__ import annotations

import builtins
import dis
import importlib.util
import re
import sys
import types

import pytest

from tests.harness import ROOT

BENCH = ROOT / "bench"


def _global_reads(code: types.CodeType):
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            yield ins.argval, ins.positions.lineno if ins.positions else None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _global_reads(const)


def _unresolved(source: str, namespace: dict) -> list[str]:
    code = compile(source, "<bench>", "exec")
    missing = []
    for const in code.co_consts:  # the module's functions and classes (module-level code ran on import)
        if isinstance(const, types.CodeType):
            missing += [
                f"{name} (line {line})"
                for name, line in _global_reads(const)
                if name not in namespace and not hasattr(builtins, name)
            ]
    return missing


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("*.py")))
def test_bench_script_names_resolve(script, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # the scripts import their sibling helpers by name
    spec = importlib.util.spec_from_file_location(f"_bench_{script[:-3]}", BENCH / script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)  # main() is guarded: nothing runs
    assert _unresolved((BENCH / script).read_text(), vars(module)) == []


def test_the_check_sees_a_missing_helper():
    source = "def main():\n    return speed(1)\n"
    assert _unresolved(source, {}) == ["speed (line 2)"]
    assert _unresolved(source, {"speed": len}) == []


def _index() -> tuple[set[str], set[str]]:
    """bench/README.md's index: the files named in its tables' first column, and those it lists as removed."""
    text = (BENCH / "README.md").read_text()
    named = {
        m
        for row in text.splitlines()
        if row.startswith("| `")
        for m in re.findall(r"`(\w+\.py)`", row.split("|")[1])
    }
    removed = set(re.findall(r"^- `(\w+\.py)`", text, re.M))
    return named, removed


def test_the_index_names_every_bench_file_and_only_those():
    named, removed = _index()
    files = {p.name for p in BENCH.glob("*.py")} - {"__init__.py"}
    assert files - named == set(), "bench/README.md does not index these"
    assert named - files == set(), "bench/README.md indexes files that are gone"
    assert removed and not removed & files, "a script listed as removed is still there"
