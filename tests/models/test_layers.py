"""The layer rules, read from the imports of every module in mmalign/ (ast, function bodies too):

* only ``mmalign/dist/distributed.py`` imports ``torch.distributed``, only ``mmalign/run/engine.py``
  imports ``deepspeed``;
* nothing in mmalign/ imports ``data_pipelines`` (data flows one way: data_pipelines -> mmalign);
* the heavy optional dependencies are imported inside functions (never when a module is
  imported), each in its owning module.

Attribute use such as ``torch.distributed.is_initialized()`` without an import is not
checked; every form of import is (``import``, ``from ... import``, relative imports,
``importlib.import_module("...")`` / ``__import__("...")`` with a literal name).
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.harness import ROOT

# Where the layer rules allow each guarded import (paths relative to the repository root).
ONLY_IN = {
    "torch.distributed": ("mmalign/dist/distributed.py",),
    "deepspeed": ("mmalign/run/engine.py", "mmalign/layout/ds_adapter.py"),
}  # the adapter: DeepSpeed's private layout
HEAVY = ("faiss", "onnx", "onnxruntime", "transformers", "matplotlib", "sklearn", "tensorboard", "datasets")
# A heavy dependency used by more than one module, with why; every other one has at most one owner.
SHARED_OWNERS = {
    # search reads the index files that index builds
    "faiss": {"mmalign/search/index.py", "mmalign/search/searcher_shards.py"},
    # the Hugging Face export: the model and its tokenizer; an HF text tower's tokenizer (models/hf_text.py)
    "transformers": {
        "mmalign/export/to_hf.py",
        "mmalign/export/hf_tokenizer.py",
        "mmalign/data/tokenizer.py",
        # the SigLIP family: transformers' own towers, a folder's configs and tokenizer, its export
        "mmalign/models/siglip_modules.py",
        "mmalign/models/siglip_hf.py",
        "mmalign/export/to_hf_siglip.py",
    },
    # four unrelated tools of evaluation: digits data, linear probes, t-SNE, DataComp's macro F1
    "sklearn": {
        "mmalign/evaluation/datasets.py",
        "mmalign/evaluation/probes.py",
        "mmalign/evaluation/report.py",
        "mmalign/evaluation/datacomp.py",
    },
}


@dataclass(frozen=True)
class Import:
    name: str  # absolute dotted name: `from torch import distributed` -> torch.distributed
    line: int
    at_import: bool  # runs when the module is imported (not inside a function)


def module_name(path: str) -> str:
    parts = list(Path(path).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(source: str, path: str) -> list[Import]:
    """Every import in ``source`` (the file ``path``, relative to the repository root)."""
    package = module_name(path).split(".")
    if not path.endswith("__init__.py"):
        package = package[:-1]
    found: list[Import] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            found.extend(Import(a.name, node.lineno, not in_function) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: `from ..x import y` in package a.b -> a.x.y
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.extend(Import(f"{base}.{a.name}", node.lineno, not in_function) for a in node.names)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            if called in ("import_module", "__import__"):
                found.append(Import(node.args[0].value, node.lineno, not in_function))
        inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source, filename=path), False)
    return found


def _is(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def heavy_dependency(name: str) -> str | None:
    if _is(name, "torch.utils.tensorboard"):
        return "tensorboard"
    top = name.split(".")[0]
    return top if top in HEAVY else None


def layer_violations(source: str, path: str) -> list[str]:
    """The layer rules broken by the module ``path`` (relative to the repository root)."""
    problems = []
    for imp in imports_of(source, path):
        where = f"{path}:{imp.line}: {imp.name}"
        for guarded, owners in ONLY_IN.items():
            if _is(imp.name, guarded) and path not in owners:
                problems.append(f"{where}: {guarded} is imported only in {' and '.join(owners)}")
        if _is(imp.name, "data_pipelines"):
            problems.append(
                f"{where}: mmalign does not import data_pipelines (data_pipelines imports mmalign)"
            )
        if path.startswith("mmalign/models/") and _is(imp.name, "mmalign.export"):
            problems.append(f"{where}: models do not import export (export imports models)")
        dep = heavy_dependency(imp.name)
        if dep and imp.at_import:
            problems.append(f"{where}: {dep} is heavy; import it inside the function that needs it")
    return problems


def package_modules(root: Path) -> dict[str, str]:
    """``mmalign/...py`` -> source, for every module of the package under ``root``."""
    return {p.relative_to(root).as_posix(): p.read_text() for p in sorted((root / "mmalign").rglob("*.py"))}


def package_violations(root: Path) -> list[str]:
    return [v for path, source in package_modules(root).items() for v in layer_violations(source, path)]


def heavy_owners(root: Path) -> dict[str, set[str]]:
    owners: dict[str, set[str]] = {dep: set() for dep in HEAVY}
    for path, source in package_modules(root).items():
        for imp in imports_of(source, path):
            dep = heavy_dependency(imp.name)
            if dep:
                owners[dep].add(path)
    return owners


# ------------------------------------------------------------------ the rules hold


def test_every_module_keeps_the_layer_rules():
    assert len(package_modules(ROOT)) > 50  # the walk found the package
    assert package_violations(ROOT) == []


def test_each_heavy_dependency_has_its_owning_module():
    owners = heavy_owners(ROOT)
    assert owners["matplotlib"] == {"mmalign/evaluation/report.py"} and owners["onnx"] == {
        "mmalign/export/to_onnx.py"
    }
    for dep, modules in owners.items():
        if dep in SHARED_OWNERS:
            assert modules <= SHARED_OWNERS[dep], (dep, modules - SHARED_OWNERS[dep])
        else:
            assert len(modules) <= 1, (dep, modules)


@pytest.mark.integration
def test_importing_the_cli_and_the_training_loop_pulls_in_no_heavy_dependency():
    """What a command pays before it runs: nothing heavy for the CLI (not even torch), and for
    the training loop only what open_clip itself imports (it imports transformers when present)."""
    code = (
        "import json, sys\n"
        "import mmalign.cli\n"
        "cli = sorted(m for m in sys.modules if m.split('.')[0] in {heavy})\n"
        "import mmalign.run.train\n"
        "train = sorted({{m.split('.')[0] for m in sys.modules}} & {heavy})\n"
        "print(json.dumps([cli, train]))\n"
    ).format(heavy=set(HEAVY) | {"torch", "deepspeed", "data_pipelines"})
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert res.returncode == 0, res.stderr[-2000:]
    cli, train = json.loads(res.stdout.strip().splitlines()[-1])
    assert cli == []
    assert set(train) <= {"torch", "transformers"}, train  # transformers: open_clip's own import


# ------------------------------------------------------------------ the checker can fail

BAD = [
    (
        "import torch.distributed as dist\n",
        "torch.distributed is imported only in mmalign/dist/distributed.py",
    ),
    ("from torch import distributed\n", "torch.distributed is imported only"),
    ("from torch.distributed import all_reduce\n", "torch.distributed is imported only"),
    ("import torch.distributed.distributed_c10d as c10d\n", "torch.distributed is imported only"),
    ("def f():\n    import deepspeed\n", "deepspeed is imported only in mmalign/run/engine.py"),
    (
        "class A:\n    def f(self):\n        from deepspeed.utils import logger\n",
        "deepspeed is imported only",
    ),
    ("import importlib\nmod = importlib.import_module('deepspeed.comm')\n", "deepspeed is imported only"),
    ("def f():\n    __import__('torch.distributed')\n", "torch.distributed is imported only"),
    ("from data_pipelines import shapes\n", "does not import data_pipelines"),
    ("def f():\n    from data_pipelines.sources import image_folder\n", "does not import data_pipelines"),
    ("import faiss\n", "faiss is heavy"),
    (
        "try:\n    import matplotlib.pyplot as plt\nexcept ImportError:\n    plt = None\n",
        "matplotlib is heavy",
    ),
    ("from torch.utils.tensorboard import SummaryWriter\n", "tensorboard is heavy"),
    ("from sklearn.manifold import TSNE\n", "sklearn is heavy"),
    (
        "class Probe:\n    from transformers import CLIPModel\n",
        "transformers is heavy",
    ),  # a class body runs at import
]


@pytest.mark.parametrize("source,problem", BAD, ids=[b[0].strip().splitlines()[-1].strip() for b in BAD])
def test_the_checker_flags_each_forbidden_import(source, problem):
    found = layer_violations(source, "mmalign/evaluation/newthing.py")
    assert len(found) == 1 and problem in found[0], found


def test_models_do_not_import_export():
    bad = "def f():\n    from mmalign.export.to_hf import TOP_KEYS\n"
    found = layer_violations(bad, "mmalign/models/newthing.py")
    assert len(found) == 1 and "models do not import export" in found[0], found
    assert layer_violations(bad, "mmalign/evaluation/newthing.py") == []  # export may be used elsewhere


def test_the_checker_allows_the_owners_and_lazy_imports():
    assert (
        layer_violations(
            "import torch.distributed as dist\nfrom torch import distributed\n", "mmalign/dist/distributed.py"
        )
        == []
    )
    assert (
        layer_violations("import deepspeed\nfrom deepspeed.utils import logger\n", "mmalign/run/engine.py")
        == []
    )
    fine = (
        "import torch\nimport torch.nn as nn\nfrom mmalign.evaluation import datasets\nfrom . import datasets\n"
        "def f():\n    import faiss\n    from sklearn.manifold import TSNE\n    return torch.distributed.is_initialized()\n"
    )
    assert layer_violations(fine, "mmalign/evaluation/newthing.py") == []


def test_relative_imports_resolve_to_their_package():
    names = [
        i.name
        for i in imports_of(
            "from . import a\nfrom ..data import b\nfrom .c import d\n", "mmalign/evaluation/x.py"
        )
    ]
    assert names == ["mmalign.evaluation.a", "mmalign.data.b", "mmalign.evaluation.c.d"]
    assert [i.name for i in imports_of("from . import a\n", "mmalign/evaluation/__init__.py")] == [
        "mmalign.evaluation.a"
    ]


def test_a_bad_module_in_the_package_is_found(tmp_path):
    (tmp_path / "mmalign" / "data").mkdir(parents=True)
    (tmp_path / "mmalign" / "__init__.py").write_text("")
    (tmp_path / "mmalign" / "data" / "ok.py").write_text("import torch\n")
    (tmp_path / "mmalign" / "data" / "bad.py").write_text(
        "def f():\n    from torch import distributed as d\n"
    )
    assert package_violations(tmp_path) == [
        "mmalign/data/bad.py:2: torch.distributed: torch.distributed is imported only in mmalign/dist/distributed.py"
    ]
