"""The YAML files that ship inside the package: recipes and evaluation suites.

The repository keeps them where the developers' guide puts them, ``configs/`` (recipes)
and ``eval/`` (suites); ``mmalign/recipes`` and ``mmalign/suites`` are links to those
folders, so the files are package data.  They are found through
:mod:`importlib.resources` in a source checkout, an editable install and an installed
wheel alike (the wheel holds copies; ``pyproject.toml`` lists them as package data).
The caption template sets of ``data_pipelines/templates`` are that package's own data.

A recipe or suite is named by its file stem (``cifar10_cpu``, ``shapes``); a path to a
YAML file is always taken as that file.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from mmalign.errors import UsageError

RECIPES = "recipes"  # configs/ in the repository
SUITES = "suites"  # eval/ in the repository


def folder(kind: str) -> Path:
    """The shipped folder of ``kind`` (:data:`RECIPES` or :data:`SUITES`) as a file-system path."""
    # mmalign is a regular package installed as files (never zipped): files() is a Path
    return Path(str(resources.files("mmalign") / kind))


def names(kind: str) -> list[str]:
    """The shipped names of ``kind``, sorted (file stems)."""
    return sorted(p.stem for p in folder(kind).glob("*.yaml"))


def shipped(kind: str, name: str) -> Path | None:
    """The shipped file called ``name`` (a stem, or a file name ending ``.yaml``), or None."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if not stem or "/" in stem or "\\" in stem or stem.startswith("."):
        return None
    path = folder(kind) / f"{stem}.yaml"
    return path if path.is_file() else None


def recipe_path(path: str | Path) -> Path:
    """The config file ``path`` names: the file itself when it exists, else the shipped
    recipe of that name, given bare (``cifar10_cpu``) or as the repository path the
    docs use (``configs/cifar10_cpu.yaml``, which then works from any directory)."""
    path = Path(path)
    if path.is_file():
        return path
    if path.parent in (Path("."), Path("configs")):
        found = shipped(RECIPES, path.name)
        if found is not None:
            return found
    raise UsageError(f"config file not found: {path} (shipped recipes: {', '.join(names(RECIPES))})")
