"""An architecture dict ``{"embed_dim", "vision_cfg", "text_cfg", "quick_gelu"}`` in typed form.

``Towers.from_arch(arch).to_arch()`` is ``arch`` with each tower's ``kind:`` written (first in
its dict; a dict that had one comes back equal): model folders, checkpoints and open_clip
exports keep the dict; code outside mmalign/models reads the typed towers instead
(``model.towers.text.context_length``, ``model.towers.text.tokenizer()``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmalign.models.towers.base import TowerSpec, spec_from_cfg

TOWER_KEYS = {"vision": "vision_cfg", "text": "text_cfg"}


@dataclass
class Towers:
    embed_dim: int
    vision: TowerSpec
    text: TowerSpec
    quick_gelu: bool | None = None  # None: the dict had no such key
    rest: dict[str, Any] = field(default_factory=dict)  # other top-level keys, passed through

    @classmethod
    def from_arch(cls, arch: dict[str, Any]) -> Towers:
        rest = {
            k: v for k, v in arch.items() if k not in ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu")
        }
        return cls(
            embed_dim=int(arch["embed_dim"]),
            vision=spec_from_cfg("vision", dict(arch.get("vision_cfg", {}))),
            text=spec_from_cfg("text", dict(arch.get("text_cfg", {}))),
            quick_gelu=arch.get("quick_gelu"),
            rest=rest,
        )

    def to_arch(self) -> dict[str, Any]:
        """The dict as it is saved: each tower's ``kind`` explicit (:meth:`TowerSpec.saved_cfg`)."""
        arch: dict[str, Any] = {
            "embed_dim": self.embed_dim,
            "vision_cfg": self.vision.saved_cfg(),
            "text_cfg": self.text.saved_cfg(),
        }
        if self.quick_gelu is not None:
            arch["quick_gelu"] = self.quick_gelu
        return arch | self.rest

    @property
    def image_size(self) -> int:
        from mmalign.models.towers.vit import square

        return square(self.vision.image_size)[0]

    @property
    def context_length(self) -> int:
        return int(self.text.context_length)

    def flops(self) -> int:
        """Forward FLOPs of one image and one caption (full context length)."""
        return self.vision.flops(self.embed_dim) + self.text.flops(self.embed_dim)


def with_kinds(arch: dict[str, Any]) -> dict[str, Any]:
    """``arch`` with each tower's ``kind:`` written (the form architectures are saved in)."""
    return Towers.from_arch(arch).to_arch()
