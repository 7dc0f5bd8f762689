"""The package as a user installs it: ``pip install .`` (not editable) ships the recipes,
suites and caption templates, the commands find them from any directory (``pip install
-e .`` reads them from the checkout), and every third-party module the library imports is
a declared dependency.

The fresh venv reuses the already installed dependencies through a ``.pth`` line (no
network, no torch download); only mmalign itself is built and installed into it, and
the test checks that it is that copy, not the checkout, which runs.
"""

from __future__ import annotations

import ast
import importlib.metadata
import io
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
from pathlib import Path

import pytest

from tests.harness import ROOT

SOURCES = ("mmalign", "data_pipelines")  # the installed packages (tests/ and bench/ are not shipped)
FIRST_PARTY = {"mmalign", "data_pipelines", "tests", "bench"}  # the repository's own folders


def _declared(group: str | None = None) -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] if group is None else project["optional-dependencies"][group]
    names = set()
    for r in reqs:
        name = _normal(re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0])
        if name == "mmalign":  # an extra naming others (`mmalign[search,...]`) declares their packages
            for other in re.search(r"\[(.*)\]", r).group(1).split(","):
                names |= _declared(other.strip())
        else:
            names.add(name)
    return names


def _normal(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def _imported(folder: Path) -> dict[str, str]:
    """Top-level module name -> one file importing it, for every absolute import in ``folder``."""
    return {module: sorted(files)[0] for module, files in _importers(folder).items()}


def _type_checking_only(tree: ast.AST) -> set[int]:
    """The ids of the nodes under ``if TYPE_CHECKING:``: imports for the type checker, never run
    (``_typeshed`` exists only there)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _importers(folder: Path) -> dict[str, set[str]]:
    """Top-level module name -> every file importing it, for every absolute import in ``folder``
    that runs (not the type checker's)."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_only(tree)
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                found.setdefault(name.split(".")[0], set()).add(str(path.relative_to(ROOT)))
    return found


def _undeclared(imported: dict[str, str], declared: set[str]) -> list[str]:
    dists = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(imported.items()):
        if module in sys.stdlib_module_names or module in FIRST_PARTY:
            continue
        owners = {_normal(d) for d in dists.get(module, [])}
        if not owners & declared:
            problems.append(f"{module} (imported by {where}; distribution {sorted(owners) or 'unknown'})")
    return problems


# What the library offers but the core install does not need: module -> (the extra declaring
# it, the files that import it, lazily; mmalign/extras.py turns its absence into one line)
INTEGRATIONS = {
    "clip_benchmark": ("clip_benchmark", {"mmalign/pretrained.py"}),
    "faiss": (
        "search",
        {
            "mmalign/search/index.py",
            "mmalign/search/searcher_shards.py",
            "data_pipelines/curate/dedupe.py",
            "data_pipelines/mine.py",
        },
    ),
    "onnx": ("export", {"mmalign/export/to_onnx.py"}),
    "matplotlib": ("report", {"mmalign/evaluation/report.py"}),
    "sklearn": (
        "report",
        {
            "mmalign/evaluation/datasets.py",
            "mmalign/evaluation/probes.py",
            "mmalign/evaluation/report.py",
            "mmalign/evaluation/datacomp.py",
        },
    ),
}


@pytest.mark.integration
def test_every_imported_distribution_is_declared():
    imported: dict[str, set[str]] = {}
    for folder in SOURCES:
        for module, files in _importers(ROOT / folder).items():
            imported.setdefault(module, set()).update(files)
    assert {"torch", "yaml", "braceexpand"} <= set(imported)  # the scan sees lazy imports too
    for module, (extra, owners) in INTEGRATIONS.items():
        if module in imported:
            assert imported.pop(module) <= owners, module
            assert _undeclared({module: extra}, _declared(extra)) == []
            assert _undeclared({module: extra}, _declared()) != [], f"{module} is in the core install too"
    assert _undeclared({m: sorted(f)[0] for m, f in imported.items()}, _declared()) == []
    # the tests may also use the test extra (clip_benchmark for the parity tests)
    tests = {m: w for m, w in _imported(ROOT / "tests").items() if m not in imported}
    assert _undeclared(tests, _declared() | _declared("test")) == []


def test_the_dependency_check_can_fail():
    assert _undeclared({"braceexpand": "x.py"}, _declared() - {"braceexpand"})
    assert _undeclared({"no_such_module_here": "x.py"}, _declared())
    assert "faiss-cpu" in _declared("test") and "faiss-cpu" not in _declared()  # an extra naming extras
    tree = ast.parse("import a\nif TYPE_CHECKING:\n    import b\nif typing.TYPE_CHECKING:\n    import c\n")
    assert [
        n.names[0].name
        for n in ast.walk(tree)
        if isinstance(n, ast.Import) and id(n) not in _type_checking_only(tree)
    ] == ["a"]


# ----------------------------------------------------------- pip install .


def _shards(folder: Path, n: int, per_shard: int) -> None:
    """``n`` shards of tiny CIFAR-like samples (``classname`` in .json, a caption in .txt)."""
    from PIL import Image

    names = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
    folder.mkdir(parents=True)
    for s in range(n):
        with tarfile.open(folder / f"{s:05d}.tar", "w") as tar:
            for i in range(per_shard):
                k = s * per_shard + i
                png = io.BytesIO()
                Image.new("RGB", (32, 32), (25 * (k % 10), 7 * k % 256, 90)).save(png, "PNG")
                label = k % 10
                for ext, data in (
                    ("png", png.getvalue()),
                    ("txt", f"a photo of a {names[label]}.".encode()),
                    ("json", json.dumps({"label": label, "classname": names[label]}).encode()),
                ):
                    info = tarfile.TarInfo(f"{k:06d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))


def _install(tmp: Path, *how: str) -> tuple[Path, Path]:
    """A fresh venv with mmalign from a copy of the checkout, ``pip install [how] SRC``: (venv, SRC)."""
    src = tmp / "src"  # a copy: the build writes build/ and *.egg-info next to its sources
    for name in (*SOURCES, "configs", "eval"):
        shutil.copytree(
            ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc")
        )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    where = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = Path(
        subprocess.run(
            [venv / "bin" / "python", "-c", where], capture_output=True, text=True, check=True, timeout=60
        ).stdout.strip()
    )
    # the shared dependencies (torch, ...), after the venv's own site-packages; a .pth line
    # adds the folder to sys.path without running its .pth files (no editable-install finder)
    (site / "shared_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    # --ignore-installed: never touch the mmalign the shared folder may hold
    res = subprocess.run(
        [
            venv / "bin" / "python",
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--no-index",
            "--no-build-isolation",
            "--ignore-installed",
            *how,
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=_env(),
        cwd=tmp,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return venv, src


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A fresh venv with mmalign built and installed as a wheel (``pip install .``)."""
    venv, src = _install(tmp_path_factory.mktemp("install"))
    shutil.rmtree(src)  # nothing can come from the copy any more
    return venv


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSAFEPATH")}
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(venv / "bin" / args[0]), *args[1:]],
        capture_output=True,
        text=True,
        timeout=600,
        env=_env(),
        cwd=cwd,
    )


@pytest.mark.integration
def test_installed_package_is_the_wheel_with_its_data(installed, tmp_path):
    res = _run(
        installed,
        "python",
        "-c",
        "import json, mmalign, data_pipelines, mmalign.resources as r, data_pipelines.sources as s; "
        "print(json.dumps([mmalign.__file__, data_pipelines.__file__, r.names(r.RECIPES), "
        "r.names(r.SUITES), str(s.TEMPLATE_DIR), sorted(p.name for p in s.TEMPLATE_DIR.glob('*.yaml')), "
        "sorted(__import__('mmalign.models.presets').models.presets.PRESETS), "
        "__import__('mmalign.models.preset_table').models.preset_table.stale()]))",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    mm, dp, recipes, suites, templates, template_files, presets, stale = json.loads(res.stdout)
    site = str(installed.resolve())
    for path in (mm, dp, templates):  # the installed copy, not the checkout
        assert Path(path).resolve().is_relative_to(site) and "site-packages" in path, path
    assert not Path(mm).resolve().is_relative_to(ROOT.resolve())
    assert not (Path(mm).parent / "recipes").is_symlink()  # the wheel holds copies, not links
    assert recipes == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert suites == sorted(p.stem for p in (ROOT / "eval").glob("*.yaml"))
    assert template_files == sorted(p.name for p in (ROOT / "data_pipelines" / "templates").glob("*.yaml"))
    # the presets are package data too (one YAML file each): the wheel must carry every one
    assert presets == sorted(p.stem for p in (ROOT / "mmalign" / "models" / "preset_data").glob("*.yaml"))
    assert presets
    assert (
        stale == []
    )  # `mmalign models`' table of parameter counts ships with them (preset_data/params.json)


@pytest.mark.integration
def test_installed_train_finds_a_shipped_recipe_by_name(installed, tmp_path):
    # 300 warm-up steps exceed cifar10_cpu's train.steps (200; the default is 400): the
    # recipe was found, read and validated, and nothing trained
    for config in ("cifar10_cpu", "configs/cifar10_cpu.yaml"):
        res = _run(
            installed, "mmalign", "train", "--config", config, "--set", "train.warmup_steps=300", cwd=tmp_path
        )
        assert res.returncode == 2, res.stderr[-3000:]
        assert (
            res.stderr.strip()
            .splitlines()[-1]
            .endswith("config key 'train.warmup_steps' must be in [0, train.steps=200], got 300")
        ), res.stderr
    res = _run(installed, "mmalign", "train", "--config", "cifar10_gpu", cwd=tmp_path)
    assert (
        res.returncode == 2
        and "config file not found: cifar10_gpu (shipped recipes: cifar10_cpu," in res.stderr
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.integration
def test_installed_eval_finds_a_shipped_suite_and_its_data(installed, tmp_path):
    """``--suite cifar10`` from a project folder: the suite comes from the package, its
    ``../data/cifar10/test/{00000..00009}.tar`` (relative to the repository's eval/)
    resolves to ./data/cifar10/test."""
    import torch

    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.arch import resolve_arch
    from mmalign.models.io import save_pretrained
    from mmalign.models.two_tower import TwoTower

    torch.manual_seed(0)
    model = TwoTower(resolve_arch(ModelConfig(preset="micro")))
    save_pretrained(model, tmp_path / "model", preprocess=preprocess_cfg(model.image_size))
    _shards(tmp_path / "data" / "cifar10" / "test", n=10, per_shard=2)
    res = _run(
        installed,
        "mmalign",
        "eval",
        "--model",
        "model",
        "--suite",
        "cifar10",
        "--output",
        "out.json",
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    (record,) = json.loads((tmp_path / "out.json").read_text())
    assert record["dataset"] == "cifar10/zeroshot" and record["n_images"] == 20
    assert record["metrics"]["chance_acc1"] == pytest.approx(0.1)


@pytest.mark.integration
def test_editable_install_reads_the_checkouts_folders(tmp_path):
    venv, src = _install(tmp_path, "--editable")
    (tmp_path / "elsewhere").mkdir()
    res = _run(
        venv,
        "python",
        "-c",
        "import mmalign.resources as r, data_pipelines.sources as s; "
        "print(r.shipped(r.RECIPES, 'cifar10_cpu').resolve(), r.shipped(r.SUITES, 'cifar10').resolve(), "
        "s.TEMPLATE_DIR.resolve())",
        cwd=tmp_path / "elsewhere",
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split() == [
        str(src.resolve() / "configs" / "cifar10_cpu.yaml"),
        str(src.resolve() / "eval" / "cifar10.yaml"),
        str(src.resolve() / "data_pipelines" / "templates"),
    ]
