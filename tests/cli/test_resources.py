"""mmalign.resources: the shipped recipes and suites are the repository's configs/ and eval/,
found by name; a path is always that file (tests/cli/test_install.py checks an installed wheel)."""

from __future__ import annotations

import pytest

from mmalign import resources
from mmalign.config import load_config
from mmalign.errors import UsageError
from tests.harness import ROOT


def test_shipped_folders_are_the_repositorys():
    assert resources.folder(resources.RECIPES).resolve() == (ROOT / "configs").resolve()
    assert resources.folder(resources.SUITES).resolve() == (ROOT / "eval").resolve()
    assert resources.names(resources.RECIPES) == sorted(p.stem for p in (ROOT / "configs").glob("*.yaml"))
    assert resources.shipped(resources.SUITES, "shapes.yaml") == resources.shipped(resources.SUITES, "shapes")
    for name in ("nope", "", "../configs/quickstart", ".hidden", "eval/shapes"):
        assert resources.shipped(resources.SUITES, name) is None, name


def test_config_is_a_file_or_a_shipped_recipe(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert load_config("cifar10_cpu").output == "runs/cifar10_cpu"
    assert load_config("configs/cifar10_cpu.yaml").output == "runs/cifar10_cpu"  # the README's commands
    # a file of that path wins over the shipped recipe
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "cifar10_cpu.yaml").write_text("output: runs/mine\n")
    assert load_config("configs/cifar10_cpu.yaml").output == "runs/mine"
    for missing in ("cifar10_gpu", "elsewhere/cifar10_cpu.yaml", str(tmp_path / "cifar10_cpu.yaml")):
        with pytest.raises(UsageError, match=r"^config file not found: .* \(shipped recipes: cifar10_cpu, "):
            load_config(missing)
