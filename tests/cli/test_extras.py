"""A command whose extra is not installed says in one line which one to install (exit 2, no
traceback). Each extra's absence is simulated in this process: ``sys.modules[name] = None``
makes ``import name`` fail as if the package were not installed."""

from __future__ import annotations

import ast
import logging
import re
import sys
import tarfile
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

import numpy as np
import pytest
import torch

from mmalign.errors import UsageError
from mmalign.extras import EXTRAS, extra, missing_extra, require
from tests.harness import ROOT, cli_main
from tests.harness.searchdata import save_random_model


def _without(monkeypatch, module: str) -> None:
    """``module`` (and every loaded submodule) is "not installed" until the test ends."""
    for name in [m for m in sys.modules if m.startswith(module + ".")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, module, None)


def _one_line(res, module: str, name: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in res.stderr, res.stderr
    assert lines[0].startswith("mmalign: error: ") and f"needs {module}, from the [{name}] extra" in lines[0]
    assert f"pip install 'mmalign[{name}]'" in lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_random_model(tmp_path_factory.mktemp("extras") / "model", seed=0)


# ------------------------------------------------------------------ [search]


def test_index_without_faiss(monkeypatch, tmp_path):
    (tmp_path / "emb").mkdir()
    (tmp_path / "emb" / "embed.json").write_text("{}")
    _without(monkeypatch, "faiss")
    res = cli_main("index", "--emb", tmp_path / "emb", "--out", tmp_path / "index")
    _one_line(res, "faiss-cpu", "search")
    assert "mmalign index needs" in res.stderr


def test_search_without_faiss(monkeypatch, tmp_path, model):
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "index.json").write_text("{}")
    _without(monkeypatch, "faiss")
    res = cli_main("search", "--index", tmp_path / "index", "--model", model, "--text", "a cat")
    _one_line(res, "faiss-cpu", "search")


def test_mine_without_faiss_says_so_before_embedding(monkeypatch, tmp_path, model):
    (tmp_path / "data").mkdir()
    with tarfile.open(tmp_path / "data" / "00000.tar", "w") as tar:
        tar.add(__file__, arcname="000000.txt")
    _without(monkeypatch, "faiss")
    import data_pipelines.mine

    def no_embedding(*args, **kwargs):
        raise AssertionError("the embedding pass ran before the check")

    monkeypatch.setattr(data_pipelines.mine, "_embed", no_embedding)
    res = cli_main(
        "mine", "--data", tmp_path / "data", "--model", model, "--out", tmp_path / "out", "-k", "1"
    )
    _one_line(res, "faiss-cpu", "search")


def test_curate_kmeans_without_faiss(monkeypatch):
    from data_pipelines.curate.dedupe import cluster_labels

    _without(monkeypatch, "faiss")
    emb = np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32)  # (N, D)
    with pytest.raises(UsageError, match=re.escape("curate's k-means needs faiss-cpu, from the [search]")):
        cluster_labels(emb, n_clusters=2)


# ------------------------------------------------------------------ [export]


def test_onnx_export_without_onnx(monkeypatch, tmp_path, model):
    _without(monkeypatch, "onnx")
    res = cli_main("export", "--model", model, "--format", "onnx", "--out", tmp_path / "onnx")
    _one_line(res, "onnx", "export")
    assert not list(tmp_path.glob("onnx*/*.onnx"))  # nothing half-written where the user looks


# ------------------------------------------------------------------ [report]


def test_report_without_matplotlib(monkeypatch, tmp_path):
    (tmp_path / "run").mkdir()
    _without(monkeypatch, "matplotlib")
    res = cli_main("report", "--run", tmp_path / "run")
    _one_line(res, "matplotlib", "report")
    assert "mmalign report needs" in res.stderr


def test_report_without_sklearn_says_so_before_embedding(monkeypatch, tmp_path):
    (tmp_path / "run").mkdir()
    _without(monkeypatch, "sklearn")
    res = cli_main("report", "--run", tmp_path / "run")
    _one_line(res, "scikit-learn", "report")
    assert not (tmp_path / "run" / "report").exists()


def test_digits_suite_without_sklearn(monkeypatch, tmp_path, model):
    _without(monkeypatch, "sklearn")
    res = cli_main(
        "eval", "--model", model, "--suite", "digits", "--limit", "20", "--output", tmp_path / "e.json"
    )
    _one_line(res, "scikit-learn", "report")
    assert "the digits suite needs" in res.stderr


def test_probe_and_f1_without_sklearn(monkeypatch):
    from mmalign.evaluation.datacomp import f1_macro
    from mmalign.evaluation.probes import linear_probe

    _without(monkeypatch, "sklearn")
    x, y = torch.randn(6, 3), torch.tensor([0, 1, 0, 1, 0, 1])
    with pytest.raises(UsageError, match=re.escape("a linear probe needs scikit-learn, from the [report]")):
        linear_probe(x, y, x, y, x, y, n_classes=2, cs=(1.0,))
    with pytest.raises(UsageError, match=re.escape("DataComp's macro F1 needs scikit-learn")):
        f1_macro(y, y)


def test_a_run_without_tensorboard_warns_once_and_trains_on(monkeypatch, tmp_path, caplog):
    from mmalign.run.runlog import _tensorboard

    for name in [
        m for m in sys.modules if m == "torch.utils.tensorboard" or m.startswith("torch.utils.tensorboard.")
    ]:
        monkeypatch.delitem(sys.modules, name)
    _without(monkeypatch, "tensorboard")
    with caplog.at_level(logging.WARNING, logger="mmalign.run.train"):
        assert _tensorboard(tmp_path) is None
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "monitor.tensorboard needs tensorboard, from the [report] extra: "
        "pip install 'mmalign[report]'; no event files"
    ]


# ------------------------------------------------------------------ the helper and the declarations


def test_extra_turns_only_its_own_modules_into_the_line():
    with pytest.raises(UsageError) as e, extra("search", "x"):
        raise ModuleNotFoundError("No module named 'faiss'", name="faiss")
    assert str(e.value) == "x needs faiss-cpu, from the [search] extra: pip install 'mmalign[search]'"
    # a module of the core (or of another extra) is not this extra's to explain
    with pytest.raises(ModuleNotFoundError), extra("search", "x"):
        raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
    with pytest.raises(ModuleNotFoundError), extra("export", "x"):
        raise ModuleNotFoundError("No module named 'faiss'", name="faiss")
    with pytest.raises(KeyError):
        with extra("serach", "x"):
            pass


def test_require_finds_without_importing(monkeypatch):
    require("search", "faiss", "x")  # installed here: no error
    _without(monkeypatch, "faiss")
    with pytest.raises(UsageError, match=re.escape(missing_extra("faiss", "search", "x"))):
        require("search", "faiss", "x")


def _requirement_names(reqs: list[str]) -> set[str]:
    return {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0]).lower() for r in reqs}


def test_each_extra_declares_the_distributions_of_its_modules():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras, core = project["optional-dependencies"], _requirement_names(project["dependencies"])
    dists = packages_distributions()
    for name, modules in EXTRAS.items():
        declared = _requirement_names(extras[name])
        provided = {re.sub(r"[-_.]+", "-", d).lower() for m in modules for d in dists.get(m, [m])}
        assert provided == declared, (name, provided, declared)
        assert not declared & core, f"[{name}]'s packages are in the core too: {declared & core}"
        assert f"mmalign[{','.join(EXTRAS)},clip_benchmark]" in extras["test"]  # the tests drive them all
    assert "pytest" not in core


def _guarded_imports(path: Path) -> list[tuple[int, str, str | None]]:
    """Every import of an extra's module in ``path``: (line, module, the extra named by the
    enclosing ``with extra(NAME, ...)`` block, or None)."""
    optional = {m: n for n, ms in EXTRAS.items() for m in ms}
    found = []

    def visit(node: ast.AST, guard: str | None) -> None:
        if isinstance(node, ast.With):
            for item in node.items:
                call = item.context_expr
                if isinstance(call, ast.Call) and getattr(call.func, "id", None) == "extra":
                    guard = call.args[0].value  # type: ignore[attr-defined]  # a literal, by convention
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        for name in names:
            top = "tensorboard" if name.startswith("torch.utils.tensorboard") else name.split(".")[0]
            if top in optional:
                found.append((node.lineno, top, guard))
        for child in ast.iter_child_nodes(node):
            visit(child, guard)

    visit(ast.parse(path.read_text(), str(path)), None)
    return found


def test_every_import_of_an_extra_is_guarded_by_its_extra():
    optional = {m: n for n, ms in EXTRAS.items() for m in ms}
    seen = set()
    for folder in ("mmalign", "data_pipelines"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for line, module, guard in _guarded_imports(path):
                seen.add(module)
                where = f"{path.relative_to(ROOT)}:{line}"
                assert guard == optional[module], (
                    f"{where}: import {module} inside with extra({optional[module]!r}, ...)"
                )
    assert {"faiss", "onnx", "matplotlib", "sklearn", "tensorboard"} <= seen  # the walk saw them


def test_the_guard_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n    import faiss\n\ndef g():\n    with extra('report', 'x'):\n        import faiss\n"
        "\ndef h():\n    with extra('report', 'x'):\n        from torch.utils.tensorboard import SummaryWriter\n"
    )
    assert _guarded_imports(bad) == [
        (2, "faiss", None),
        (6, "faiss", "report"),
        (10, "tensorboard", "report"),
    ]
