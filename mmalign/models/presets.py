"""Architecture presets: mmalign's own small ones plus every open_clip architecture.

An architecture is an open_clip-style dict ``{"embed_dim", "vision_cfg", "text_cfg",
"quick_gelu"}`` (typed: models/towers/); mmalign's own presets are data, one YAML file each in
``preset_data/``; nothing here downloads weights.  A timm image tower
(``model.vision.timm_model_name``, models/timm_tower.py) and a Hugging Face text tower
(``model.text.hf_local_dir``, models/hf_text.py) are resolved here from local files.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

import open_clip

from mmalign.config import ConfigError, ModelConfig
from mmalign.models.hf_text import LOCAL_DIR, apply_local_dir, check_tokenizer, is_hf_text
from mmalign.models.timm_tower import check_timm_cfg

PRESET_DIR = "preset_data"  # package data: one YAML file per preset (pyproject.toml ships them)


def _load_presets() -> dict[str, dict]:
    """mmalign's own presets, read from the shipped YAML files (name = file stem); each is an
    architecture dict whose towers parse as typed specs (models/towers/), checked here."""
    import yaml

    from mmalign.models.towers import Towers

    presets = {}
    for path in sorted(Path(str(resources.files("mmalign.models") / PRESET_DIR)).glob("*.yaml")):
        arch = yaml.safe_load(path.read_text(encoding="utf-8"))
        Towers.from_arch(arch)  # a preset file that names no known tower kind fails at import, loudly
        presets[path.stem] = arch
    return presets


PRESETS: dict[str, dict] = _load_presets()


def available() -> list[str]:
    return sorted(PRESETS) + open_clip.list_models()


def describe_presets(include_unavailable: bool = False, names: list[str] | None = None):
    """Yield ``{"name", "offline", "params", "image_size", "why"}`` per preset (``mmalign models``).

    A preset is offline when its towers build without a download (a Hugging Face text tower
    named by hub id needs one; ``model.text.hf_local_dir`` replaces it); its parameters are counted on the meta device (no memory, no maths).  The
    others are yielded, with ``why``, only under ``include_unavailable``.
    """
    from mmalign.models import check_buildable  # imports this module

    for name in available() if names is None else names:
        try:
            model = check_buildable(ModelConfig(preset=name))
        except ConfigError as e:
            if include_unavailable:
                why = "needs a Hugging Face text tower" if "Hugging Face" in str(e) else str(e).split(": ", 1)[-1]
                yield {"name": name, "offline": False, "params": None, "image_size": None, "why": why[:100]}
            continue
        yield {"name": name, "offline": True, "params": sum(p.numel() for p in model.parameters()),
               "image_size": model.image_size, "why": None}


def preset_arch(name: str) -> dict:
    """The architecture dict of a preset (a copy)."""
    if name in PRESETS:
        arch = copy.deepcopy(PRESETS[name])
    else:
        found = open_clip.get_model_config(name)
        if found is None:
            raise ConfigError(
                f"config key 'model.preset': unknown architecture {name!r} "
                f"(try tiny, micro, ViT-B-32, ViT-B-16, ... ; `mmalign models` lists them)"
            )
        arch = copy.deepcopy(found)
        # open_clip configs may carry tokenizer/preprocess hints next to the towers.
        arch = {k: arch[k] for k in ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu") if k in arch}
    return arch


def resolve_arch(cfg: ModelConfig) -> dict:
    """Model config -> a complete architecture dict (preset, or the architecture that
    ``model.pretrained`` carries (models/init_from.py), + overrides)."""
    from mmalign.models.init_from import pretrained_arch  # imports this module

    arch = pretrained_arch(cfg)
    if arch is None:
        arch = preset_arch(cfg.preset or "tiny")
    arch.setdefault("quick_gelu", False)
    arch["quick_gelu"] = bool(arch["quick_gelu"] or cfg.quick_gelu)
    if cfg.embed_dim is not None:
        arch["embed_dim"] = cfg.embed_dim
    arch["vision_cfg"].update(cfg.vision)
    arch["text_cfg"].update(cfg.text)
    if cfg.image_size is not None:
        arch["vision_cfg"]["image_size"] = cfg.image_size
    # timm image towers: random init or model.timm_weights, never timm's download
    arch["vision_cfg"] = check_timm_cfg(arch["vision_cfg"], cfg.timm_weights)
    if LOCAL_DIR in cfg.text:  # a Hugging Face text tower from a local folder replaces the preset's
        arch["text_cfg"] = apply_local_dir(cfg.text, cfg.preset)  # only model.text's own keys carry over
        check_tokenizer(arch["text_cfg"])
    elif is_hf_text(arch["text_cfg"]):  # by hub name: refused (or a saved arch's folder, made absolute)
        arch["text_cfg"] = apply_local_dir(arch["text_cfg"], cfg.preset)
    return arch
