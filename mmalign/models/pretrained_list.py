"""open_clip's registry of published weights (``ARCH/TAG`` -> a Hugging Face repository and
file), read without importing open_clip, and what ``mmalign models --pretrained`` lists.

open_clip keeps its tags in ``open_clip/pretrained.py`` (a dict of plain data) and its
architectures in ``open_clip/model_configs/*.json``. Importing the package costs seconds (it
pulls in torch, torchvision and transformers), so the listing and the name check of every
command run that one module alone, against its two plain sibling modules (``constants``,
``version``), with its optional torch import kept out; should that ever fail, open_clip itself
is imported. ``tests/models/test_pretrained_list.py`` holds the table equal to
``open_clip.list_pretrained()`` / ``get_pretrained_cfg``.

Whether the local cache holds a tag is read from huggingface_hub's cache layout alone
(``models--ORG--NAME/snapshots/*/FILE``): no network, no import of huggingface_hub.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
import types
from collections.abc import Iterator
from functools import lru_cache
from pathlib import Path

from mmalign.errors import UsageError

OC_CONFIG = "open_clip_config.json"  # an open_clip hub repository's architecture
OC_BIN, OC_SAFE = "open_clip_pytorch_model.bin", "open_clip_model.safetensors"  # open_clip's default names
_SHADOW = "_mmalign_open_clip_registry"  # the private package name the module is run under


def _open_clip_dir() -> Path | None:
    spec = importlib.util.find_spec("open_clip")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@contextlib.contextmanager
def _kept_out(*names: str):
    """``import NAME`` fails inside (modules not yet imported only): open_clip's pretrained.py
    imports safetensors.torch (torch) and huggingface_hub inside try/except ImportError."""
    added = [n for n in names if n not in sys.modules]
    for n in added:
        sys.modules[n] = None  # type: ignore[assignment]  # an ImportError for `import n`
    try:
        yield
    finally:
        for n in added:
            if sys.modules.get(n, 0) is None:
                del sys.modules[n]


def _read_registry_alone(folder: Path) -> dict:
    shadow = types.ModuleType(_SHADOW)
    shadow.__path__ = [str(folder)]  # its relative imports (.constants, .version) resolve here
    sys.modules[_SHADOW] = shadow
    try:
        spec = importlib.util.spec_from_file_location(f"{_SHADOW}.pretrained", folder / "pretrained.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        with _kept_out("safetensors.torch", "huggingface_hub"):
            spec.loader.exec_module(module)
        return module._PRETRAINED
    finally:
        for name in [n for n in sys.modules if n == _SHADOW or n.startswith(_SHADOW + ".")]:
            del sys.modules[name]


@lru_cache(maxsize=1)
def registry() -> dict[str, dict[str, dict]]:
    """``{arch: {tag: cfg}}`` as open_clip's ``get_pretrained_cfg(arch, tag)`` gives each cfg
    (``hf_hub`` ``ORG/NAME/[FILE]``, ``url``, ``mean``, ``std``, ``quick_gelu``, ...); empty
    without open_clip."""
    folder = _open_clip_dir()
    if folder is None:
        return {}
    if "open_clip.pretrained" not in sys.modules:  # imported already: that is the same table
        try:
            return _read_registry_alone(folder)
        except Exception:  # a reorganised open_clip: import it (seconds), never a wrong table
            pass
    from open_clip import pretrained

    return pretrained._PRETRAINED


def clean_tag(tag: str) -> str:
    """open_clip's spelling rule for tags (``_clean_tag``): case and ``-``/``_`` do not matter."""
    return tag.lower().replace("-", "_")


def model_config(arch: str) -> dict | None:
    """open_clip's built-in ``model_configs/ARCH.json`` (what ``create_model(ARCH, pretrained=TAG)``
    builds), None when open_clip has no such architecture."""
    folder = _open_clip_dir()
    file = None if folder is None else folder / "model_configs" / f"{arch}.json"
    if file is None or not file.is_file():
        return None
    cfg = json.loads(file.read_text(encoding="utf-8"))
    return cfg if all(k in cfg for k in ("embed_dim", "vision_cfg", "text_cfg")) else None


def architectures() -> list[str]:
    """open_clip's architecture names (its model_configs)."""
    folder = _open_clip_dir()
    return [] if folder is None else sorted(p.stem for p in (folder / "model_configs").glob("*.json"))


def weight_files(hf_hub: str) -> tuple[str, list[str]]:
    """A tag's ``hf_hub`` -> (repo id, the file names open_clip tries in order): the safetensors
    twin first, then the named file (``ORG/NAME/`` names open_clip's default)."""
    repo, filename = os.path.split(hf_hub)
    filename = filename or OC_BIN
    twins = [OC_SAFE] if filename == OC_BIN else []
    if filename != OC_BIN and filename.endswith((".bin", ".pth")):
        twins = [filename[:-4] + ".safetensors"]
    return repo, [*twins, filename]


def hub_cache() -> Path:
    """huggingface_hub's cache folder, from the environment now (HF_HUB_CACHE, HF_HOME,
    XDG_CACHE_HOME), as huggingface_hub reads it at its import."""
    env = os.environ
    explicit = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


def repo_dir(cache: Path, repo: str) -> Path:
    """A model repository's folder in huggingface_hub's cache."""
    return cache / ("models--" + repo.replace("/", "--"))


def cached_file(cache: Path, repo: str, filename: str) -> Path | None:
    """``filename`` of ``repo``'s current snapshot (``refs/main``) in the cache, else None."""
    folder = repo_dir(cache, repo)
    try:
        commit = (folder / "refs" / "main").read_text().strip()
    except OSError:
        return None
    file = folder / "snapshots" / commit / filename
    return file if file.is_file() else None


def rows(cache: Path | None = None) -> Iterator[dict]:
    """One row per open_clip tag: ``{"arch", "tag", "repo", "file", "cached"}``; ``file`` is the
    weights file the cache holds (else the one open_clip would fetch first)."""
    cache = hub_cache() if cache is None else cache
    for arch, tags in registry().items():
        for tag, cfg in tags.items():
            repo, names = weight_files(cfg.get("hf_hub", ""))
            held = next((n for n in names if repo and cached_file(cache, repo, n)), None)
            yield {
                "arch": arch,
                "tag": tag,
                "repo": repo,
                "file": held or names[-1],
                "cached": held is not None,
            }


def cached_ids(cache: Path | None = None) -> Iterator[tuple[str, str]]:
    """``(name, layout)`` of the repositories in the cache that mmalign reads by name:
    ``hf-hub:ORG/NAME`` (an open_clip config) and ``ORG/NAME`` (a transformers config)."""
    cache = hub_cache() if cache is None else cache
    if not cache.is_dir():
        return
    for folder in sorted(cache.glob("models--*--*")):
        repo = folder.name[len("models--") :].replace("--", "/", 1)
        if cached_file(cache, repo, OC_CONFIG):
            yield f"hf-hub:{repo}", "open_clip"
        config = cached_file(cache, repo, "config.json")
        if config is not None:
            with contextlib.suppress(OSError, ValueError):
                data = json.loads(config.read_text(encoding="utf-8"))
                kind = (data.get("architectures") or [data.get("model_type", "?")])[0]
                yield repo, str(kind)


def listing(arch: str | None = None, cache: Path | None = None) -> Iterator[str]:
    """The lines of ``mmalign models --pretrained [ARCH]``: open_clip's tags (of ``arch``, or all)
    as ``ARCH/TAG`` names with their repository, ``*`` where the cache holds the weights; then
    the other repositories in the cache that load by name."""
    cache = hub_cache() if cache is None else cache
    table = [r for r in rows(cache) if arch is None or r["arch"] == arch]
    if arch is not None and not table:
        close = [a for a in registry() if a.lower().startswith(arch.lower()[:5])][:5]
        raise UsageError(
            f"--pretrained: open_clip has no pretrained tags for {arch}"
            + (f" (close: {', '.join(close)})" if close else "")
        )
    width = max([len(f"{r['arch']}/{r['tag']}") for r in table] + [20])
    yield f"  {'name (ARCH/TAG)':<{width}} hugging face repository"
    for r in table:
        yield f"{'*' if r['cached'] else ' '} {r['arch'] + '/' + r['tag']:<{width}} {r['repo']}"
    held = sum(r["cached"] for r in table)
    yield f"({held} of {len(table)} in the cache {cache}, marked *; `mmalign models --fetch NAME` downloads one)"
    if arch is None:
        tag_repos = {r["repo"] for r in table}
        others = [(n, k) for n, k in cached_ids(cache) if n.removeprefix("hf-hub:") not in tag_repos]
        if others:
            yield "also in the cache, by name:"
            for n, k in others:
                yield f"* {n:<{width}} {k}"


__all__ = [
    "architectures",
    "cached_file",
    "cached_ids",
    "clean_tag",
    "hub_cache",
    "listing",
    "model_config",
    "registry",
    "rows",
    "weight_files",
]
