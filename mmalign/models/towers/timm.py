"""A timm trunk in open_clip's TimmModel (``vision_cfg.timm_model_name``; weights from a local
file only, models/timm_tower.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmalign.models.towers.base import Tokenizer, TowerSpec, register_tower
from mmalign.models.towers.vit import square

if TYPE_CHECKING:
    import torch
    from torch import nn


@register_tower("timm")
@dataclass
class TimmSpec(TowerSpec):
    side = "vision"
    marker = "timm_model_name"

    timm_model_name: str = ""
    image_size: int | tuple[int, ...] = 224
    timm_model_pretrained: bool = False
    timm_pool: str = "avg"
    timm_proj: str = "linear"

    @classmethod
    def claims(cls, cfg: dict[str, Any]) -> bool:
        return bool(cfg.get("timm_model_name"))

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        from open_clip.model import _build_vision_tower

        from mmalign.models.timm_tower import fit_input_size

        cfg = self.to_cfg()
        visual: nn.Module = _build_vision_tower(embed_dim, cfg, quick_gelu)
        fit_input_size(visual, cfg)  # a timm ViT at another image size
        return visual

    def lock_groups(self, module: nn.Module) -> int:
        from timm.models import group_parameters

        trunk = module.get_submodule("trunk")
        matcher = getattr(trunk, "group_matcher", None)  # timm's models that define layer groups
        return len(group_parameters(trunk, matcher(coarse=True))) if callable(matcher) else 0

    def open_clip_cfg(self) -> dict[str, Any]:
        return self.to_cfg()

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        import torch

        return torch.randn(batch, 3, *square(self.image_size))  # (B, 3, H, W)

    # flops(): the base's count (torch's FLOP counter on the meta device): timm's trunks are too
    # many for a formula each
