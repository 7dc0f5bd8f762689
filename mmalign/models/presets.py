"""Architecture presets: mmalign's own small ones plus every open_clip architecture.

An architecture is an open_clip-style dict ``{"embed_dim", "vision_cfg", "text_cfg",
"quick_gelu"}`` (typed: models/towers/); mmalign's own presets are data, one YAML file each in
``preset_data/``; nothing here downloads weights.  A model config's architecture (a preset
or ``model.pretrained``'s, plus overrides, timm and Hugging Face towers from local files) is
resolved by models/arch.py.
"""

from __future__ import annotations

import copy
from importlib import resources
from pathlib import Path

from mmalign.config import ConfigError

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
    import open_clip  # its registry: the import takes seconds (torchvision, transformers), so only here

    return sorted(PRESETS) + open_clip.list_models()


def preset_arch(name: str) -> dict:
    """The architecture dict of a preset (a copy)."""
    if name in PRESETS:
        arch = copy.deepcopy(PRESETS[name])
    else:
        import open_clip

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
