"""Typed towers behind a registry (towers/base.py): one module per kind, and :class:`Towers`,
the typed form of an architecture dict (towers/arch.py).  A tower dict names its kind with
``kind:`` (dicts without one are claimed by exactly one kind), so the order below is free."""

from mmalign.models.towers import hf_text, resnet, siglip, text, timm, vit  # noqa: F401 (registrations)
from mmalign.models.towers.arch import Towers, with_kinds
from mmalign.models.towers.base import (
    KIND_KEY,
    Tokenizer,
    TowerSpec,
    claimant,
    register_tower,
    registered,
    spec_class,
    spec_from_cfg,
    tower_kind,
    unregister_tower,
)

__all__ = [
    "KIND_KEY",
    "Tokenizer",
    "TowerSpec",
    "Towers",
    "claimant",
    "register_tower",
    "registered",
    "spec_class",
    "spec_from_cfg",
    "tower_kind",
    "unregister_tower",
    "with_kinds",
]
