"""A timm trunk in open_clip's TimmModel (``vision_cfg.timm_model_name``; weights from a local
file only, models/timm_tower.py)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from mmalign.models.towers.base import TowerSpec, register_tower
from mmalign.models.towers.vit import square


@register_tower("timm")
@dataclass
class TimmSpec(TowerSpec):
    side = "vision"
    marker = "timm_model_name"

    timm_model_name: str = ""
    image_size: int | tuple = 224
    timm_model_pretrained: bool = False
    timm_pool: str = "avg"
    timm_proj: str = "linear"

    @classmethod
    def claims(cls, cfg: dict) -> bool:
        return bool(cfg.get("timm_model_name"))

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        from open_clip.model import _build_vision_tower

        from mmalign.models.timm_tower import fit_input_size

        cfg = self.to_cfg()
        visual = _build_vision_tower(embed_dim, cfg, quick_gelu)
        fit_input_size(visual, cfg)  # a timm ViT at another image size
        return visual

    def lock_groups(self, module: nn.Module) -> int:
        from timm.models import group_parameters

        trunk = module.trunk
        return (
            len(group_parameters(trunk, trunk.group_matcher(coarse=True)))
            if hasattr(trunk, "group_matcher")
            else 0
        )

    def open_clip_cfg(self) -> dict:
        return self.to_cfg()

    def onnx_input(self, batch: int, tokenizer=None):
        import torch

        return torch.randn(batch, 3, *square(self.image_size))  # (B, 3, H, W)

    def flops(self, embed_dim: int) -> int:
        """Counted on the meta device (no memory, no maths): timm's trunks are too many for a formula each."""
        import torch

        from mmalign.models.flops import flop_counter

        with torch.device("meta"):
            module = self.build(embed_dim, False).eval()
            counter = flop_counter()
            with counter, torch.no_grad():
                module(self.onnx_input(1))
        return int(counter.get_total_flops())
