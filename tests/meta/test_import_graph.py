"""The import graph of ``mmalign/``: no cycles, and no import that climbs back up the layering.

Every import statement counts, also the ones inside functions (a lazy import that breaks a
cycle at run time still ties the two modules together for a reader). ``from pkg import sub``
depends on the submodule only, not on the package's ``__init__``.

Data flows one way: what a layer may import is what lies below it in :data:`LAYERS`. What is
still wrong would be listed in :data:`KNOWN_CYCLES` and :data:`KNOWN_UPWARD` with the work that
removes it; both are empty now. The test fails both on a new violation and on a listed one that
is gone (so the lists only shrink).
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.harness import ROOT

PACKAGE = ROOT / "mmalign"

# low to high; a module's layer is that of its first dotted part below mmalign
LAYERS = [
    "errors extras progress resources sentencepiece_file dirlock",  # no mmalign imports at all, or only each other
    "layout",  # names in a run directory, DeepSpeed's private layout: shared by run (writes) and models (reads)
    "config",  # the typed config: schema, loading, resolving, the domain rules
    "dist",  # process groups and their collectives, clusters, the launcher and its supervisor
    "data losses models",  # inputs, pure kernels, towers
    "objective evaluation",  # what a step's loss or an evaluation computes
    "run",  # a training run: the loop, the engine, checkpoints, logs, monitors
    "export search pretrained",  # what ships a model
    "quickstart commands cli cli_train cli_eval cli_wise_ft cli_embed cli_model",  # entry points
]
LAYER = {name: level for level, names in enumerate(LAYERS) for name in names.split()}
TOP = len(LAYERS) - 1  # the package's __init__ (mmalign.load, the public face): with the entry points

# cycles still in the graph (each a sorted tuple of its modules) and what removes them
KNOWN_CYCLES: set[tuple[str, ...]] = set()
KNOWN_UPWARD: set[tuple[str, str]] = set()


def modules() -> dict[str, Path]:
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _targets(node: ast.AST, here: str, mods: dict[str, Path]) -> set[str]:
    """The mmalign modules an import statement in module ``here`` loads."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:  # ImportFrom
        if node.level:
            package = here.split(".") if mods[here].name == "__init__.py" else here.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in mods]
        names = subs + ([base] if len(subs) < len(node.names) else [])
    found = set()
    for name in names:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        if name.startswith("mmalign") and name != here:
            found.add(name)
    return found


def graph() -> dict[str, set[str]]:
    mods = modules()
    edges = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        edges[name] = set().union(
            *(_targets(n, name, mods) for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)))
        )
    return edges


def cycles(edges: dict[str, set[str]]) -> set[tuple[str, ...]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), set()
    for root in edges:
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.add(tuple(sorted(component)))
    return found


def layer(module: str) -> int:
    parts = module.split(".")
    return TOP if len(parts) == 1 else LAYER[parts[1]]


def test_every_module_has_a_layer():
    names = {m.split(".")[1] for m in modules() if "." in m}
    assert sorted(names - set(LAYER)) == [], "add the new module or package to LAYERS"
    assert sorted(set(LAYER) - names) == [], "a module in LAYERS is gone: remove it"


def test_no_import_cycles_beyond_the_listed_ones():
    assert cycles(graph()) == KNOWN_CYCLES


def test_no_import_climbs_the_layering_beyond_the_listed_ones():
    upward = {(a, b) for a, targets in graph().items() for b in targets if layer(b) > layer(a)}
    assert upward == KNOWN_UPWARD


def test_the_checks_see_a_cycle_and_an_upward_import():
    """The graph builder on a made-up graph and on the real one: it must find what it is for."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(edges) == {("a", "b", "c")}
    real = graph()
    assert (
        "mmalign.dist.distributed" in real["mmalign.run.train"]
    )  # `from mmalign import distributed as mdist`
    assert "mmalign.models.misfit" in real["mmalign.models.timm_tower"]  # an import inside a function
    assert (
        layer("mmalign.cli")
        > layer("mmalign.run.train")
        > layer("mmalign.models.io")
        > layer("mmalign.config")
    )
