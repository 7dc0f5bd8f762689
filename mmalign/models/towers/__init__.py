"""Typed towers behind a registry (towers/base.py): one module per kind, and :class:`Towers`,
the typed form of an architecture dict (towers/arch.py)."""

# isort: off
from mmalign.models.towers import vit, resnet, timm, text, hf_text  # noqa: F401 (registrations; order matters)

# isort: on
from mmalign.models.towers.arch import Towers
from mmalign.models.towers.base import (
    Tower,
    TowerSpec,
    build_tower,
    register_tower,
    registered,
    spec_class,
    spec_from_cfg,
    tower_kind,
    unregister_tower,
)

__all__ = [
    "Tower",
    "TowerSpec",
    "Towers",
    "build_tower",
    "register_tower",
    "registered",
    "spec_class",
    "spec_from_cfg",
    "tower_kind",
    "unregister_tower",
]
