"""Models by name: wherever a model is read (``model.pretrained*``, ``--model``), a published
model may be named instead of a path.

* ``ARCH/TAG``: open_clip's registry (``ViT-B-32/laion2b_s34b_b79k``): open_clip's own
  architecture ``model_configs/ARCH.json`` and the weights file the tag points at, fetched as
  open_clip fetches it (its safetensors twin first);
* ``hf-hub:ORG/NAME``: a repository in open_clip's hub layout (``open_clip_config.json`` +
  ``open_clip_model.safetensors`` / ``open_clip_pytorch_model.bin``);
* ``ORG/NAME``: a transformers repository whose ``config.json`` is a ``CLIPModel``,
  ``SiglipModel`` or ``Siglip2Model``.

:func:`resolve` turns a name into a local folder that the readers of local paths then read
(``arch.kind_of``, ``load._export_kind``, ``foreign_weights``): the repository's snapshot in
huggingface_hub's cache, or, where a snapshot alone would be read the wrong way, a *view*: a
folder of links to exactly the files the name means, with the ``open_clip_config.json`` open_clip
would build from (an ``ARCH/TAG``: its built-in config; a transformers id whose repository also
ships open_clip files: the transformers files only). Views live in ``MMALIGN_CACHE`` (default
``HF_HOME/mmalign``), are rewritten on every resolution and hold no weights of their own.

An existing local path always wins. The environment is read at call time (``HF_HOME``,
``HF_HUB_CACHE``, ``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``, ``HF_ENDPOINT``): a name the
cache holds is used with no network access at all; otherwise, unless offline, it is downloaded
once with huggingface_hub's progress bars and its bounded timeouts. Every failure is one line
(:class:`~mmalign.errors.UsageError` for a flag, :class:`~mmalign.errors.ConfigError` for a config
key) naming the name, the cache looked in and the command that fetches it.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import logging
import os
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from mmalign.config.checks import HF_HUB_PREFIX, model_name_form
from mmalign.errors import ConfigError, UsageError
from mmalign.models.pretrained_list import (
    OC_BIN,
    OC_CONFIG,
    OC_SAFE,
    architectures,
    cached_file,
    clean_tag,
    hub_cache,
    model_config,
    registry,
    weight_files,
)

log = logging.getLogger(__name__)

TAG, OPEN_CLIP_HUB, TRANSFORMERS = "ARCH/TAG", "hf-hub", "transformers"  # Name.form
TEXT_TOWER = "text tower"  # Name.form of a Hugging Face text model an open_clip architecture names
SUPPORTED = {"clip": "CLIPModel", "siglip": "SiglipModel", "siglip2": "Siglip2Model"}  # model_type -> class
HF_CONFIG = "config.json"
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # models/foreign_weights.py reads these
OC_HUB_WEIGHTS = (OC_SAFE, OC_BIN)  # open_clip's hf-hub: loader, in its order
# what a transformers model needs besides config.json and its weights: tokenizers (BPE, sentencepiece,
# fast), processors; fetched when the repository has them
HF_SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "tokenizer.model",
    "preprocessor_config.json",
    "processor_config.json",
)
TEXT_TOKENIZER_FILES = (
    "vocab.txt",
    "sentencepiece.bpe.model",
)  # BERT's, XLM-R's / NLLB's (besides the above)
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class Name:
    """A parsed model name."""

    text: str  # as written
    form: str  # TAG, OPEN_CLIP_HUB or TRANSFORMERS
    repo: str  # ORG/NAME on the hub
    arch: str | None = None  # TAG: open_clip's architecture
    tag: str | None = None  # TAG: the tag, open_clip's spelling


def offline() -> bool:
    """Downloads are off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), read now."""
    return any(
        os.environ.get(v, "").strip().upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def views_dir() -> Path:
    """Where views are written: ``MMALIGN_CACHE``, else ``HF_HOME/mmalign``."""
    own = os.environ.get("MMALIGN_CACHE")
    if own:
        return Path(own).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface"
    )
    return Path(home).expanduser() / "mmalign"


def parse(value: str) -> Name | None:
    """The name ``value`` spells, None for anything that is (or reads as) a path. Whether it
    exists on the hub is :func:`resolve`'s business."""
    if not model_name_form(value):
        return None
    if value.startswith(HF_HUB_PREFIX):
        return Name(value, OPEN_CLIP_HUB, value[len(HF_HUB_PREFIX) :])
    first, second = value.split("/")
    table = registry()
    if first in table or first in architectures():
        return Name(value, TAG, "", arch=first, tag=second)
    return Name(value, TRANSFORMERS, value)


def is_name(value: str | Path) -> bool:
    """``value`` is no existing path and reads as a model name."""
    return not Path(value).exists() and parse(str(value)) is not None


def resolve(value: str | Path, key: str) -> Path:
    """A local path for ``value``: the path itself when it exists (paths always win), else the
    folder the name resolves to (downloaded first when the cache lacks it and the network is
    allowed). A value that is neither a name nor an existing path comes back unchanged, for the
    readers of paths to say that it does not exist. ``key`` names the flag (``--model``) or the
    config key (``model.pretrained``) in errors."""
    path = Path(value)
    if path.exists():
        return path
    name = parse(str(value))
    if name is None:
        return path
    if name.form == TAG:
        return _resolve_tag(name, key)
    if name.form == OPEN_CLIP_HUB:
        return _resolve_open_clip_hub(name, key)
    return _resolve_transformers(name, key)


# ---------------------------------------------------------------- errors


def fail(key: str, message: str) -> Exception:
    """The one-line error of ``key``: a UsageError for a flag, a ConfigError for a config key."""
    if key.startswith("-"):
        return UsageError(f"{key}: {message}")
    return ConfigError(f"config key '{key}': {message}")


def _path_too(name: Name) -> str:
    """An ``ORG/NAME`` may have been meant as a relative path: say that there is none."""
    return "no such local path, and " if name.form == TRANSFORMERS else ""


def _fetch_hint(name: Name) -> str:
    """The command that fetches ``name`` on a connected machine."""
    if name.form == TEXT_TOWER:  # not a model mmalign loads by itself: huggingface_hub's own command
        return f"`hf download {name.repo}`"
    return f"`mmalign models --fetch {name.text}` (or `hf download {name.repo}`)"


def _not_cached(
    name: Name, key: str, what: str, why: str = "downloads are off (HF_HUB_OFFLINE)"
) -> Exception:
    return fail(
        key,
        f"{name.text}: {_path_too(name)}not in the Hugging Face cache {hub_cache()} ({what}); {why}; on a "
        f"connected machine with the same HF_HOME run {_fetch_hint(name)}",
    )


def _check_reachable(name: Name, key: str, what: str) -> None:
    """One bounded connection to the hub before a download: huggingface_hub retries a dead
    network for ~25 s; this says it in one line at once (a dead route: after TIMEOUT_S)."""
    import socket
    from urllib.parse import urlsplit

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    if (url.hostname, port) in _REACHED:
        return
    try:
        socket.create_connection((url.hostname or "", port), timeout=TIMEOUT_S).close()
    except OSError as e:
        raise _not_cached(
            name, key, what, f"the hub ({endpoint}) cannot be reached ({e.strerror or e})"
        ) from None
    _REACHED.add((url.hostname, port))
    print(f"mmalign: downloading {name.text} into {hub_cache()} ...", file=sys.stderr, flush=True)


TIMEOUT_S = 5.0  # the reachability probe's connect timeout
_REACHED: set = set()  # (host, port) reached once by this process


def _fetch_failed(name: Name, key: str, e: Exception) -> Exception:
    """A download that did not happen, as one line by its cause."""
    from huggingface_hub import errors as hf_errors

    cause = (str(e).strip().splitlines() or [""])[0][:200]
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if isinstance(e, hf_errors.GatedRepoError):
        why = f"{name.repo} is gated: accept its terms on the hub and log in (`hf auth login`)"
    elif isinstance(e, hf_errors.RepositoryNotFoundError):
        why = f"the hub has no repository {name.repo} (or it is private: `hf auth login`){_arch_hint(name)}"
    elif isinstance(e, hf_errors.RemoteEntryNotFoundError):
        why = f"{name.repo} has no such file ({cause})"
    elif isinstance(e, hf_errors.HfHubHTTPError):
        why = f"the hub ({endpoint}) answered {type(e).__name__}: {cause}"
    elif isinstance(e, OSError):  # a connection lost midway, a timeout, offline mode set at its import
        why = (
            f"the hub ({endpoint}) could not be reached ({type(e).__name__}: {cause[:80]}); set "
            f"HF_HUB_OFFLINE=1 to use the cache {hub_cache()} alone, or fetch it on a connected machine "
            f"with {_fetch_hint(name)}"
        )
    else:
        why = f"{type(e).__name__}: {cause}"
    return fail(key, f"{name.text} could not be downloaded: {why}")


def _arch_hint(name: Name) -> str:
    """For an ``ORG/NAME`` that may be a mistyped open_clip ``ARCH/TAG``: the close architectures."""
    org = name.repo.split("/")[0]
    by_lower = {a.lower(): a for a in registry()}  # open_clip's names are case-sensitive; a hint need not be
    close = [by_lower[c] for c in difflib.get_close_matches(org.lower(), list(by_lower), n=3, cutoff=0.75)]
    return f"; no open_clip architecture is named {org} (close: {', '.join(close)})" if close else ""


# ---------------------------------------------------------------- downloads


def _hub_download(repo: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    log.info("downloading %s of %s into %s", filename, repo, hub_cache())
    endpoint = (
        os.environ.get("HF_ENDPOINT") or None
    )  # now, as the cache: huggingface_hub read it at its import
    return Path(hf_hub_download(repo, filename, cache_dir=str(hub_cache()), endpoint=endpoint))


def _download(name: Name, key: str, repo: str, filename: str) -> Path:
    try:
        return _hub_download(repo, filename)
    except Exception as e:
        raise _fetch_failed(name, key, e) from None


def _first_file(name: Name, key: str, repo: str, names: list[str] | tuple[str, ...]) -> Path | None:
    """The first of ``names`` that the cache holds, else (online) the first the hub has, as
    open_clip tries them; None when offline and none is cached, or the hub has none of them."""
    from huggingface_hub import errors as hf_errors

    cache = hub_cache()
    for n in names:
        found = cached_file(cache, repo, n)
        if found is not None:
            return found
    if offline():
        return None
    _check_reachable(name, key, f"{repo}, file {' or '.join(names)}")
    for n in names:
        try:
            return _hub_download(repo, n)
        except hf_errors.RemoteEntryNotFoundError:
            continue  # open_clip's order: the next name
        except Exception as e:
            raise _fetch_failed(name, key, e) from None
    return None


# ---------------------------------------------------------------- the three forms


def _resolve_tag(name: Name, key: str) -> Path:
    assert name.arch is not None and name.tag is not None
    tags = registry().get(name.arch, {})
    cfg = tags.get(clean_tag(name.tag))
    if cfg is None:
        known = ", ".join(list(tags)[:8]) + (f" (+{len(tags) - 8} more)" if len(tags) > 8 else "")
        raise fail(
            key,
            f"open_clip has no pretrained tag {name.tag!r} for {name.arch}"
            + (f"; its tags: {known}" if tags else " (it has no published weights)")
            + " (`mmalign models --pretrained` lists them all)",
        )
    model_cfg = model_config(name.arch)
    if model_cfg is None:
        raise fail(
            key, f"open_clip has tags for {name.arch} but no model_configs/{name.arch}.json to build it"
        )
    repo, names = weight_files(cfg.get("hf_hub", ""))
    if not repo:
        raise fail(
            key, f"{name.text} has no Hugging Face repository in open_clip's registry (only {cfg.get('url')})"
        )
    name = Name(name.text, TAG, repo, name.arch, clean_tag(name.tag))
    weights = _first_file(name, key, repo, names)
    if weights is None:
        if offline():
            raise _not_cached(name, key, f"open_clip's tag points at {repo}, file {' or '.join(names)}")
        raise fail(key, f"{name.text}: the hub repository {repo} has none of {', '.join(names)}")
    if cfg.get("quick_gelu", False) != bool(model_cfg.get("quick_gelu", False)):
        log.warning(  # as open_clip warns: its ARCH-quickgelu twin is the architecture these weights had
            "%s: %s was trained with quick_gelu=%s, architecture %s has quick_gelu=%s (as open_clip builds "
            "it; %s-quickgelu is the other)",
            key,
            name.text,
            cfg.get("quick_gelu", False),
            name.arch,
            bool(model_cfg.get("quick_gelu", False)),
            name.arch,
        )
    model_cfg = _checkpoint_has_text_weights(model_cfg)
    text_model = model_cfg["text_cfg"].get("hf_model_name")
    if text_model and not Path(text_model).is_dir():  # fetched with the weights, so that offline works later
        resolve_text_model(text_model, key, weights=False)
    preprocess = {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items() if k in _PREPROCESS_KEYS}
    size = model_cfg["vision_cfg"].get("image_size", 224)
    preprocess["size"] = list(size) if isinstance(size, (list, tuple)) else [size, size]
    config = {"model_cfg": model_cfg, "preprocess_cfg": preprocess, "mmalign_source": _source(name, weights)}
    return _view(f"open_clip/{name.arch}--{name.tag}", {OC_CONFIG: config}, {_oc_link_name(weights): weights})


_PREPROCESS_KEYS = ("mean", "std", "interpolation", "resize_mode")


def _checkpoint_has_text_weights(model_cfg: dict) -> dict:
    """A Hugging Face text tower inside a full checkpoint starts from the checkpoint, not from its
    own hub weights (open_clip: ``hf_model_pretrained`` off when a checkpoint is loaded)."""
    if not model_cfg.get("text_cfg", {}).get("hf_model_name"):
        return model_cfg
    return {**model_cfg, "text_cfg": {**model_cfg["text_cfg"], "hf_model_pretrained": False}}


def resolve_text_model(repo: str, key: str, weights: bool) -> Path:
    """The folder of the Hugging Face text model an open_clip architecture names by hub id
    (``hf_model_name``: ``xlm-roberta-base``, ``facebook/nllb-200-distilled-600M``, ...): its
    ``config.json`` and tokenizer files, and its weights when ``weights`` (a tower that starts
    from them). From the cache; downloaded when missing and online."""
    name = Name(repo, TEXT_TOWER, repo)
    cache = hub_cache()
    config = cached_file(cache, repo, HF_CONFIG)
    if config is None and offline():
        raise _not_cached(name, key, f"the Hugging Face text model's {HF_CONFIG}")
    if config is None:
        _check_reachable(name, key, f"the Hugging Face text model's {HF_CONFIG}")
        config = _download(name, key, repo, HF_CONFIG)
        for filename in (*HF_SIDE_FILES, *TEXT_TOKENIZER_FILES):
            _maybe_download(name, key, repo, filename)
    if weights and not any((config.parent / w).is_file() for w in HF_WEIGHTS) and not offline():
        _check_reachable(name, key, f"the weights of {repo}")
        _first_file(name, key, repo, HF_WEIGHTS)
    return (cached_file(cache, repo, HF_CONFIG) or config).parent


def _maybe_download(name: Name, key: str, repo: str, filename: str) -> None:
    """``filename`` of ``repo`` into the cache when the repository has it."""
    from huggingface_hub import errors as hf_errors

    try:
        _hub_download(repo, filename)
    except hf_errors.RemoteEntryNotFoundError:
        pass
    except Exception as e:
        raise _fetch_failed(name, key, e) from None


def _oc_link_name(weights: Path) -> str:
    """The name a tag's weights take in a view: one open_clip's folder reader looks for."""
    return OC_SAFE if weights.name.endswith(".safetensors") else OC_BIN


def _source(name: Name, weights: Path) -> dict:
    return {"name": name.text, "repo": name.repo, "file": weights.name}


def _resolve_open_clip_hub(name: Name, key: str) -> Path:
    config = cached_file(hub_cache(), name.repo, OC_CONFIG)
    if config is None and not offline():
        _check_reachable(name, key, f"no {OC_CONFIG} of {name.repo}")
        config = _download(name, key, name.repo, OC_CONFIG)
    if config is None:
        raise _not_cached(name, key, f"no {OC_CONFIG} of {name.repo}")
    _check_json(config, key, name)
    weights = _first_file(name, key, name.repo, OC_HUB_WEIGHTS)
    if weights is None:
        if offline():
            raise fail(
                key,
                f"the cache entry of {name.text} ({config.parent}) holds no weights ({' or '.join(OC_HUB_WEIGHTS)}) "
                f"and downloads are off; on a connected machine run `mmalign models --fetch {name.text}`",
            )
        raise fail(
            key, f"{name.text}: the hub repository {name.repo} has none of {', '.join(OC_HUB_WEIGHTS)}"
        )
    snapshot = config.parent
    data = _read(config, key, name)
    text_model = data["model_cfg"].get("text_cfg", {}).get("hf_model_name")
    if text_model and not Path(text_model).is_dir():
        resolve_text_model(text_model, key, weights=False)
    elif weights.parent == snapshot and (snapshot / OC_SAFE).is_file() == (weights.name == OC_SAFE):
        return snapshot  # the folder reader picks these weights too (its order starts with these two)
    links = {weights.name: weights}
    links.update({p.name: p for p in snapshot.iterdir() if p.is_file() and _side_file(p.name)})
    jsons = {OC_CONFIG: {**data, "model_cfg": _checkpoint_has_text_weights(data["model_cfg"])}}
    return _view(f"hf-hub/{_flat(name.repo)}", jsons, links)


def _side_file(filename: str) -> bool:
    """A tokenizer / processor file (not weights, not another format's config)."""
    if filename in (HF_CONFIG, OC_CONFIG) or filename.startswith(("model", "pytorch_model", "open_clip_")):
        return False
    return filename.endswith((".json", ".txt", ".model", ".tiktoken"))


def _resolve_transformers(name: Name, key: str) -> Path:
    cache = hub_cache()
    config = cached_file(cache, name.repo, HF_CONFIG)
    if config is None and offline():
        raise _not_cached(name, key, f"no {HF_CONFIG} of {name.repo}{_arch_hint(name)}")
    if config is None:
        _check_reachable(name, key, f"no {HF_CONFIG} of {name.repo}{_arch_hint(name)}")
        config = _download(name, key, name.repo, HF_CONFIG)
    _check_class(config, key, name)
    snapshot = config.parent
    weights = next((snapshot / w for w in HF_WEIGHTS if (snapshot / w).is_file()), None)
    if weights is None and not offline():
        _check_reachable(name, key, f"no weights of {name.repo}")
        _snapshot_download(name, key)
        snapshot = (cached_file(cache, name.repo, HF_CONFIG) or config).parent  # refs/main may have moved
        weights = next((snapshot / w for w in HF_WEIGHTS if (snapshot / w).is_file()), None)
    if weights is None:
        sharded = any((snapshot / f"{w}.index.json").is_file() for w in HF_WEIGHTS)
        raise fail(
            key,
            f"the cache entry of {name.text} ({snapshot}) holds no weights ({' or '.join(HF_WEIGHTS)})"
            + (
                "; sharded weights are not read yet"
                if sharded
                else "; on a connected machine run `mmalign models --fetch " + name.text + "`"
            ),
        )
    if not (snapshot / OC_CONFIG).is_file():
        return snapshot
    # the repository ships open_clip's files as well, which the folder readers would prefer
    links = {p.name: p for p in snapshot.iterdir() if p.is_file() and not p.name.startswith("open_clip_")}
    return _view(f"transformers/{_flat(name.repo)}", {}, links)


def _snapshot_download(name: Name, key: str) -> None:
    """The transformers files of ``name``, one by one as open_clip fetches its own: one weights
    format (safetensors when the repository has it), then the tokenizer and processor files it
    has (a missing one is skipped). No listing of the repository is needed."""

    if _first_file(name, key, name.repo, HF_WEIGHTS) is None:
        return  # the caller says "no weights" in one line
    for filename in HF_SIDE_FILES:
        _maybe_download(name, key, name.repo, filename)


def _read(config: Path, key: str, name: Name) -> dict:
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(key, f"{name.text}: {config} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise fail(key, f"{name.text}: {config} must hold a JSON object")
    return data


def _check_json(config: Path, key: str, name: Name) -> None:
    if "model_cfg" not in _read(config, key, name):
        raise fail(key, f"{name.text}: its {OC_CONFIG} has no model_cfg (not an open_clip hub repository)")


def _check_class(config: Path, key: str, name: Name) -> None:
    """A transformers config of a supported class, else one line naming the class it is."""
    data = _read(config, key, name)
    model_type = data.get("model_type")
    if model_type in SUPPORTED:
        return
    kind = (data.get("architectures") or [None])[0] or f"model_type {model_type!r}"
    hint = (
        f"; as an open_clip repository: hf-hub:{name.repo}"
        if cached_file(hub_cache(), name.repo, OC_CONFIG) is not None
        else ""
    )
    raise fail(
        key,
        f"{name.text} is a {kind}; mmalign reads {', '.join(SUPPORTED.values())} repositories by name{hint}",
    )


# ---------------------------------------------------------------- views


def _flat(repo: str) -> str:
    return repo.replace("/", "--")


def _view(rel: str, jsons: dict[str, dict], links: dict[str, Path]) -> Path:
    """``views_dir()/rel`` holding exactly ``jsons`` (written) and ``links`` (symlinks, or copies
    where the file system has none); stale entries removed."""
    folder = views_dir() / rel
    try:
        folder.mkdir(parents=True, exist_ok=True)
        wanted = set(jsons) | set(links)
        for old in folder.iterdir():  # another process's temporary (a dot name) is left alone
            if (
                old.name not in wanted
                and not old.name.startswith(".")
                and (old.is_symlink() or old.is_file())
            ):
                with contextlib.suppress(FileNotFoundError):  # removed by a process resolving it too
                    old.unlink()
        for fname, data in jsons.items():
            text = json.dumps(data, indent=2, sort_keys=True) + "\n"
            target = folder / fname
            if not target.is_file() or target.read_text(encoding="utf-8") != text:
                # ranks (processes) and threads may resolve one name at once: a temporary each
                tmp = folder / f".{fname}.{os.getpid()}.{threading.get_ident()}.tmp"
                tmp.write_text(text, encoding="utf-8")
                os.replace(tmp, target)
        for fname, src in links.items():
            _link(folder / fname, Path(src).resolve())
    except OSError as e:
        raise UsageError(
            f"cannot write the model view {folder} ({e.strerror or e}); set MMALIGN_CACHE to a writable folder"
        ) from None
    return folder


def _link(at: Path, src: Path) -> None:
    if at.is_symlink() and Path(os.readlink(at)) == src:
        return
    tmp = at.with_name(f".{at.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    try:
        tmp.symlink_to(src)
    except OSError:  # no symlinks here: a hard link, else a copy
        try:
            os.link(src, tmp)
        except OSError:
            import shutil

            shutil.copyfile(src, tmp)
    os.replace(tmp, at)


__all__ = ["Name", "fail", "is_name", "offline", "parse", "resolve", "resolve_text_model", "views_dir"]
