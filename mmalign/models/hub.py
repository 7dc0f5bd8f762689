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
(``arch.kind_of``, ``load.export_kind``, ``foreign_weights``): the repository's snapshot in
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

import json
import logging
from pathlib import Path

from mmalign.config.checks import HF_HUB_PREFIX, model_name_form
from mmalign.models.hub_fetch import (
    OPEN_CLIP_HUB,
    TAG,
    TEXT_TOWER,
    TRANSFORMERS,
    Name,
    arch_hint,
    check_reachable,
    download,
    fail,
    first_file,
    maybe_download,
    not_cached,
    offline,
)
from mmalign.models.hub_views import flat, view, views_dir
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
    weights = first_file(name, key, repo, names)
    if weights is None:
        if offline():
            raise not_cached(name, key, f"open_clip's tag points at {repo}, file {' or '.join(names)}")
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
    return view(f"open_clip/{name.arch}--{name.tag}", {OC_CONFIG: config}, {_oc_link_name(weights): weights})


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
        raise not_cached(name, key, f"the Hugging Face text model's {HF_CONFIG}")
    if config is None:
        check_reachable(name, key, f"the Hugging Face text model's {HF_CONFIG}")
        config = download(name, key, repo, HF_CONFIG)
        for filename in (*HF_SIDE_FILES, *TEXT_TOKENIZER_FILES):
            maybe_download(name, key, repo, filename)
    if weights and not any((config.parent / w).is_file() for w in HF_WEIGHTS) and not offline():
        check_reachable(name, key, f"the weights of {repo}")
        first_file(name, key, repo, HF_WEIGHTS)
    return (cached_file(cache, repo, HF_CONFIG) or config).parent


def _oc_link_name(weights: Path) -> str:
    """The name a tag's weights take in a view: one open_clip's folder reader looks for."""
    return OC_SAFE if weights.name.endswith(".safetensors") else OC_BIN


def _source(name: Name, weights: Path) -> dict:
    return {"name": name.text, "repo": name.repo, "file": weights.name}


def _resolve_open_clip_hub(name: Name, key: str) -> Path:
    config = cached_file(hub_cache(), name.repo, OC_CONFIG)
    if config is None and not offline():
        check_reachable(name, key, f"no {OC_CONFIG} of {name.repo}")
        config = download(name, key, name.repo, OC_CONFIG)
    if config is None:
        raise not_cached(name, key, f"no {OC_CONFIG} of {name.repo}")
    _check_json(config, key, name)
    weights = first_file(name, key, name.repo, OC_HUB_WEIGHTS)
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
    return view(f"hf-hub/{flat(name.repo)}", jsons, links)


def _side_file(filename: str) -> bool:
    """A tokenizer / processor file (not weights, not another format's config)."""
    if filename in (HF_CONFIG, OC_CONFIG) or filename.startswith(("model", "pytorch_model", "open_clip_")):
        return False
    return filename.endswith((".json", ".txt", ".model", ".tiktoken"))


def _resolve_transformers(name: Name, key: str) -> Path:
    cache = hub_cache()
    config = cached_file(cache, name.repo, HF_CONFIG)
    if config is None and offline():
        raise not_cached(name, key, f"no {HF_CONFIG} of {name.repo}{arch_hint(name)}")
    if config is None:
        check_reachable(name, key, f"no {HF_CONFIG} of {name.repo}{arch_hint(name)}")
        config = download(name, key, name.repo, HF_CONFIG)
    _check_class(config, key, name)
    snapshot = config.parent
    weights = next((snapshot / w for w in HF_WEIGHTS if (snapshot / w).is_file()), None)
    if weights is None and not offline():
        check_reachable(name, key, f"no weights of {name.repo}")
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
    return view(f"transformers/{flat(name.repo)}", {}, links)


def _snapshot_download(name: Name, key: str) -> None:
    """The transformers files of ``name``, one by one as open_clip fetches its own: one weights
    format (safetensors when the repository has it), then the tokenizer and processor files it
    has (a missing one is skipped). No listing of the repository is needed."""

    if first_file(name, key, name.repo, HF_WEIGHTS) is None:
        return  # the caller says "no weights" in one line
    for filename in HF_SIDE_FILES:
        maybe_download(name, key, name.repo, filename)


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


__all__ = ["Name", "fail", "is_name", "offline", "parse", "resolve", "resolve_text_model", "views_dir"]
