"""Typed towers behind a registry (towers/base.py): one module per kind, and :class:`Towers`,
the typed form of an architecture dict (towers/arch.py)."""

from mmalign.models.towers.base import (Tower, TowerSpec, build_tower, register_tower, registered, spec_class,
                                        spec_from_cfg, tower_kind, unregister_tower)
from mmalign.models.towers import vit, resnet, timm, text, hf_text  # noqa: F401,E401 (registrations; order matters)
from mmalign.models.towers.arch import Towers

__all__ = ["Tower", "TowerSpec", "Towers", "build_tower", "register_tower", "registered", "spec_class",
           "spec_from_cfg", "tower_kind", "unregister_tower"]
