"""The architecture of a model config: a preset (models/presets.py) or the architecture that
``model.pretrained`` carries, plus the config's overrides (:func:`resolve_arch`).

A ``model.pretrained`` folder carries its architecture, which the run then uses
(:func:`pretrained_arch`); ``model.preset`` must agree with it or be unset. Where the folder
is a step checkpoint, its own config is resolved in turn (one level of recursion per
``model.pretrained`` in the chain). The weights are read by models/init_from.py.
"""

from __future__ import annotations

import copy
import json
from dataclasses import MISSING, fields, replace
from pathlib import Path

from mmalign.config import ConfigError, ModelConfig
from mmalign.models.hf_text import LOCAL_DIR, apply_local_dir, check_tokenizer, is_hf_text
from mmalign.models.presets import preset_arch
from mmalign.models.timm_tower import check_timm_cfg

# the sources model.pretrained* may name (models/init_from.py reads their weights)
FILE, OPEN_CLIP_DIR, HF_DIR, MMALIGN = (
    "open_clip file",
    "open_clip local-dir folder",
    "HF CLIPModel folder",
    "mmalign model",
)
OPEN_CLIP_CONFIG = "open_clip_config.json"  # an open_clip local-dir folder's architecture
HF_CONFIG = "config.json"  # a transformers CLIPModel folder's


def resolve_arch(cfg: ModelConfig) -> dict:
    """Model config -> a complete architecture dict (preset, or the architecture that
    ``model.pretrained`` carries, + overrides)."""
    arch = pretrained_arch(cfg)
    if arch is None:
        arch = preset_arch(cfg.preset or "tiny")
    arch.setdefault("quick_gelu", False)
    arch["quick_gelu"] = bool(arch["quick_gelu"] or cfg.quick_gelu)
    if cfg.embed_dim is not None:
        arch["embed_dim"] = cfg.embed_dim
    arch["vision_cfg"] = _merged("vision", arch["vision_cfg"], cfg.vision)
    arch["text_cfg"] = _merged("text", arch["text_cfg"], cfg.text)
    if cfg.image_size is not None:
        arch["vision_cfg"]["image_size"] = cfg.image_size
    # timm image towers: random init or model.timm_weights, never timm's download
    arch["vision_cfg"] = check_timm_cfg(arch["vision_cfg"], cfg.timm_weights)
    if LOCAL_DIR in cfg.text:  # a Hugging Face text tower from a local folder replaces the preset's
        arch["text_cfg"] = apply_local_dir(cfg.text, cfg.preset)  # only model.text's own keys carry over
        check_tokenizer(arch["text_cfg"])
    elif is_hf_text(arch["text_cfg"]):  # by hub name: refused (or a saved arch's folder, made absolute)
        arch["text_cfg"] = apply_local_dir(arch["text_cfg"], cfg.preset)
    return _with_kinds(arch)


def _merged(side: str, base: dict, own: dict) -> dict:
    """A tower dict with the config's keys (``model.vision`` / ``model.text``) over ``base``'s;
    a ``kind:`` naming another kind than ``base``'s starts from the config's keys alone (the
    base's keys belong to its own kind)."""
    from mmalign.models.towers import KIND_KEY, tower_kind

    if KIND_KEY in own and own[KIND_KEY] != tower_kind(side, base):
        return dict(own)
    return {**base, **own}


def _with_kinds(arch: dict) -> dict:
    """``arch`` with each tower's ``kind:`` written (models/towers/), as a model saves it; a kind
    that is not registered, or a tower dict no kind claims, is one ConfigError line."""
    from mmalign.models.towers import KIND_KEY, spec_from_cfg, with_kinds

    for side, part in (("vision", "vision_cfg"), ("text", "text_cfg")):
        try:
            spec_from_cfg(side, arch[part])
        except ConfigError as e:
            raise ConfigError(f"config key 'model.{side}.{KIND_KEY}': {e}") from None
    return with_kinds(arch)


def kind_of(path: Path, key: str) -> str:
    """Which of the four sources ``path`` is; a one-line ConfigError naming ``key`` otherwise."""
    from mmalign.errors import UsageError
    from mmalign.models.locate import locate

    if path.is_file():
        return FILE
    if not path.is_dir():
        raise ConfigError(f"config key '{key}': {path} does not exist")
    if (path / OPEN_CLIP_CONFIG).is_file():
        return OPEN_CLIP_DIR
    try:
        locate(path)
        return MMALIGN
    except UsageError as e:
        if (path / HF_CONFIG).is_file():
            return HF_DIR
        raise ConfigError(
            f"config key '{key}': {path} is no open_clip checkpoint file, open_clip local-dir folder "
            f"({OPEN_CLIP_CONFIG}), HF CLIPModel folder ({HF_CONFIG}) or mmalign model ({e})"
        ) from None


# ---------------------------------------------------------------- what a source carries


def _read_json(file: Path, key: str) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"config key '{key}': {file} is not readable JSON ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config key '{key}': {file} must hold a JSON object")
    return data


def _with_tokenizer(arch: dict, spm: Path | None) -> dict:
    """A sentencepiece tokenizer shipped in the source folder, as an absolute path (the run
    builds its tokenizer with no base folder)."""
    from mmalign.data.tokenizer import SPM_KEY

    arch["text_cfg"].pop("tokenizer_kwargs", None)
    if spm is not None and spm.is_file():
        arch["text_cfg"]["tokenizer_kwargs"] = {SPM_KEY: str(spm.resolve())}
    return arch


def _hf_arch(config: dict, folder: Path, key: str) -> dict:
    """A CLIPModel config.json -> our architecture (the inverse of export/to_hf.hf_config); a
    SiglipModel / Siglip2Model one through models/siglip_hf.py."""
    from mmalign.models.siglip_hf import MODEL_TYPES, is_siglip, siglip_arch

    if is_siglip(config):
        return siglip_arch(config, folder, key)
    if config.get("model_type") != "clip":
        supported = ", ".join(["CLIPModel ('clip')"] + [f"{c} ({t!r})" for t, c in MODEL_TYPES.items()])
        raise ConfigError(
            f"config key '{key}': {folder / HF_CONFIG} is model_type {config.get('model_type')!r}, "
            f"not one mmalign reads ({supported})"
        )
    v, t = config.get("vision_config") or {}, config.get("text_config") or {}
    try:
        v_width, t_width = int(v["hidden_size"]), int(t["hidden_size"])
        arch = {
            "embed_dim": int(config.get("projection_dim", v.get("projection_dim", 512))),
            "quick_gelu": v.get("hidden_act", "quick_gelu") == "quick_gelu",
            "vision_cfg": {
                "image_size": int(v["image_size"]),
                "patch_size": int(v["patch_size"]),
                "width": v_width,
                "layers": int(v["num_hidden_layers"]),
                "head_width": v_width // int(v["num_attention_heads"]),
                "mlp_ratio": int(v["intermediate_size"]) / v_width,
            },
            "text_cfg": {
                "context_length": int(t["max_position_embeddings"]),
                "vocab_size": int(t["vocab_size"]),
                "width": t_width,
                "heads": int(t["num_attention_heads"]),
                "layers": int(t["num_hidden_layers"]),
                "mlp_ratio": int(t["intermediate_size"]) / t_width,
            },
        }
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as e:
        raise ConfigError(
            f"config key '{key}': {folder / HF_CONFIG} lacks a usable CLIP setting ({type(e).__name__}: {e})"
        ) from None
    return _with_tokenizer(arch, folder / "tokenizer.model")  # our export copies a sentencepiece model there


def source_arch(path: Path, key: str) -> dict | None:
    """The architecture a source carries (a folder), None for a weights file."""
    kind = kind_of(path, key)
    if kind == FILE:
        return None
    if kind == OPEN_CLIP_DIR:
        data = _read_json(path / OPEN_CLIP_CONFIG, key)
        cfg = data.get("model_cfg", data)
        if not all(k in cfg for k in ("embed_dim", "vision_cfg", "text_cfg")):
            raise ConfigError(
                f"config key '{key}': {path / OPEN_CLIP_CONFIG} has no model_cfg with embed_dim, "
                f"vision_cfg, text_cfg"
            )
        arch = copy.deepcopy(
            {k: cfg[k] for k in ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu") if k in cfg}
        )
        spm = (data.get("mmalign_tokenizer") or {}).get("file")  # export/to_open_clip.py records it there
        return _with_tokenizer(arch, path / spm if spm else None)
    if kind == HF_DIR:
        return _hf_arch(_read_json(path / HF_CONFIG, key), path, key)
    return _mmalign_arch(path, key)


def _mmalign_arch(path: Path, key: str) -> dict:
    from mmalign.config import load_config
    from mmalign.models.hf_text import absolutize
    from mmalign.models.io import CONFIG
    from mmalign.models.locate import MODEL, checkpoint_config, locate
    from mmalign.models.tokenizers import tokenizer_file

    kind, folder = locate(path)
    if kind == MODEL:
        arch = _read_json(folder / CONFIG, key).get("arch")
        if not isinstance(arch, dict) or not all(k in arch for k in ("embed_dim", "vision_cfg", "text_cfg")):
            raise ConfigError(f"config key '{key}': {folder / CONFIG} has no usable 'arch'")
        spm = tokenizer_file(arch)  # relative to the model folder when saved by save_pretrained
        arch = absolutize(copy.deepcopy(arch), folder)  # an HF text tower's hf_text/ folder, likewise
        return _with_tokenizer(arch, None if spm is None else folder / spm)
    return resolve_arch(load_config(checkpoint_config(folder)).model)  # a step checkpoint: its own config


def _default(f):
    return (
        f.default
        if f.default is not MISSING
        else (f.default_factory() if f.default_factory is not MISSING else None)
    )


def differences(a: dict, b: dict, parts: tuple[str, ...] = ("vision_cfg", "text_cfg")) -> list[str]:
    """Settings in which two architectures differ (an unset tower key counts as open_clip's default)."""
    from open_clip.model import CLIPTextCfg, CLIPVisionCfg

    def norm(value):
        return tuple(norm(x) for x in value) if isinstance(value, (list, tuple)) else value

    out = [
        f"{k}: {a.get(k)!r} vs {b.get(k)!r}"
        for k in ("embed_dim", "quick_gelu")
        if norm(bool(a.get(k)) if k == "quick_gelu" else a.get(k))
        != norm(bool(b.get(k)) if k == "quick_gelu" else b.get(k))
    ]
    for part in parts:
        defaults = {
            f.name: _default(f) for f in fields(CLIPVisionCfg if part == "vision_cfg" else CLIPTextCfg)
        }
        for k in sorted(
            (set(a[part]) | set(b[part])) - {"tokenizer_kwargs", "kind"}
        ):  # kind: one is inferred
            va, vb = a[part].get(k, defaults.get(k)), b[part].get(k, defaults.get(k))
            if norm(va) != norm(vb):
                out.append(f"{part}.{k}: {va!r} vs {vb!r}")
    return out


def pretrained_arch(cfg: ModelConfig) -> dict | None:
    """The architecture ``model.pretrained`` carries (None: a weights file, or no key), after
    checking that ``model.preset``, when set, agrees with it once the config's own overrides
    (``model.vision`` / ``model.text`` / ``model.embed_dim`` / ...) are applied to it."""
    if cfg.pretrained is None:
        return None
    from mmalign.models.hub import resolve

    arch = source_arch(resolve(cfg.pretrained, "model.pretrained"), "model.pretrained")  # a name: its folder
    if arch is None or cfg.preset is None:
        return arch
    # What the config alone describes: the preset plus the config's own tower overrides
    # (model.text.context_length: 16 and the like), i.e. the architecture that trained the
    # export when the same config made it, not the bare preset.
    described = resolve_arch(replace(cfg, pretrained=None))
    differ = differences(described, arch)
    grid = ("image_size", "patch_size")  # a new size over the source's: resampled (models/pos_embed.py)
    if differ and (cfg.image_size is not None or any(k in cfg.vision for k in grid)):
        own = {k: v for k, v in cfg.vision.items() if k not in grid}  # the preset at the source's grid
        differ = differences(resolve_arch(replace(cfg, pretrained=None, image_size=None, vision=own)), arch)
    if differ:
        raise ConfigError(
            f"config key 'model.preset': {cfg.preset!r} differs from the architecture of "
            f"model.pretrained {cfg.pretrained} ({'; '.join(differ[:3])}"
            f"{f'; +{len(differ) - 3} more' if len(differ) > 3 else ''}): omit model.preset or make "
            f"it (with its model.* overrides) agree"
        )
    return arch


__all__ = ["differences", "pretrained_arch", "resolve_arch", "source_arch"]
