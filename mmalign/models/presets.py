"""Architecture presets: mmalign's own small ones plus every open_clip architecture.

An architecture is an open_clip-style dict ``{"embed_dim", "vision_cfg", "text_cfg",
"quick_gelu"}``; nothing here downloads weights.  A timm image tower
(``model.vision.timm_model_name``, models/timm_tower.py) and a Hugging Face text tower
(``model.text.hf_local_dir``, models/hf_text.py) are resolved here from local files.
"""

from __future__ import annotations

import copy

import open_clip

from mmalign.config import ConfigError, ModelConfig
from mmalign.models.hf_text import LOCAL_DIR, apply_local_dir, check_tokenizer, is_hf_text
from mmalign.models.timm_tower import check_timm_cfg

# Sized for CPU training on 32-64 px images in minutes (the calibration tower of the
# CIFAR-10 recipe): ViT 4x128 on 32 px with patch 4, text transformer 4x128.
PRESETS: dict[str, dict] = {
    "tiny": {
        "embed_dim": 128,
        "vision_cfg": {"image_size": 32, "layers": 4, "width": 128, "head_width": 32, "patch_size": 4},
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 4},
    },
    # The quickstart's tower: a small modified ResNet (open_clip's RN layout: 3-conv stem,
    # 4 bottleneck stages of one block, attention pooling) on 64 px. From scratch on the shapes
    # data, its convolutions learn shape far sooner than the tiny ViT's patches (shape zero-shot
    # 32% vs 21-26% after 300 steps at batch 128), and it steps faster on CPU.
    "tiny-rn": {
        "embed_dim": 128,
        "vision_cfg": {"image_size": 64, "layers": [1, 1, 1, 1], "width": 16},
        "text_cfg": {"context_length": 32, "vocab_size": 49408, "width": 128, "heads": 4, "layers": 4},
    },
    # For unit tests and multi-process integration tests: seconds per step on one core.
    "micro": {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 16, "layers": 1, "width": 32, "head_width": 16, "patch_size": 4},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    },
    # The same for a BatchNorm (ResNet) tower: open_clip's modified ResNet at its smallest
    # (32 px: the attention pool needs image_size >= 32), 19 BatchNorm2d layers.
    "micro-rn": {
        "embed_dim": 32,
        "vision_cfg": {"image_size": 32, "layers": [1, 1, 1, 1], "width": 8},
        "text_cfg": {"context_length": 16, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    },
}


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
