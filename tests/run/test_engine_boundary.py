"""Only mmalign/run/engine.py (and its adapter, mmalign/layout/ds_adapter.py) reaches into DeepSpeed's engine (issue 18): everything else asks the
:class:`mmalign.run.engine.Engine` (``train_mode``, ``named_buffers``, ``partition_fragments`` ...)."""

from __future__ import annotations

import ast

from tests.harness import ROOT


def _ds_attributes(path) -> list[int]:
    """Line numbers of every ``<anything>.ds`` in ``path``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return sorted(
        node.lineno for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "ds"
    )


def test_no_module_but_the_engine_touches_ds():
    package = ROOT / "mmalign"
    engine = package / "run" / "engine.py"
    assert _ds_attributes(engine), "the walk finds the engine's own .ds (the premise of this test)"
    offenders = [
        f"{path.relative_to(ROOT)}:{line}"
        for path in sorted(package.rglob("*.py"))
        if path != engine
        for line in _ds_attributes(path)
    ]
    assert offenders == [], offenders
