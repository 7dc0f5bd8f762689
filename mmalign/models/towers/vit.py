"""open_clip's VisionTransformer (the ``vision_cfg`` of ``ViT-*`` presets, ``layers`` an int)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmalign.models.towers.base import Tokenizer, TowerSpec, register_tower

if TYPE_CHECKING:
    import torch
    from torch import nn


def transformer_flops(tokens: int, width: int, layers: int, mlp_width: int) -> int:
    """Forward FLOPs of ``layers`` pre-norm blocks over ``tokens`` tokens: the qkv and output
    projections, Q K^T and P V (every score, masked or not), and the two MLP matmuls."""
    per_block = (
        tokens * width * 3 * width
        + 2 * tokens * tokens * width
        + tokens * width * width
        + 2 * tokens * width * mlp_width
    )
    return 2 * layers * per_block


def square(size: int | tuple[int, ...] | list[int] | None, default: int = 224) -> tuple[int, int]:
    if size is None:
        return default, default
    return (int(size[0]), int(size[1])) if isinstance(size, (list, tuple)) else (int(size), int(size))


@register_tower("open_clip_vit")
@dataclass
class ViTSpec(TowerSpec):
    side = "vision"
    fallback = True  # open_clip's default vision tower: a dict no other kind claims
    hf_clip = True

    image_size: int | tuple[int, ...] = 224
    layers: int = 12
    width: int = 768
    head_width: int = 64
    mlp_ratio: float = 4.0
    patch_size: int | tuple[int, ...] = 16

    @classmethod
    def claims(cls, cfg: dict[str, Any]) -> bool:
        return not isinstance(cfg.get("layers", 12), (list, tuple))

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        from open_clip.model import _build_vision_tower

        module: nn.Module = _build_vision_tower(embed_dim, self.to_cfg(), quick_gelu)
        return module

    def lock_groups(self, module: nn.Module) -> int:
        return self.layers + 2  # open_clip: the stem, each block, the head (ln_post + proj)

    def open_clip_cfg(self) -> dict[str, Any]:
        return self.to_cfg()

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        import torch

        return torch.randn(batch, 3, *square(self.image_size))  # (B, 3, H, W)

    def flops(self, embed_dim: int) -> int:
        (h, w), (ph, pw) = square(self.image_size), square(self.patch_size)
        patches = (h // ph) * (w // pw)
        tokens = patches + 1  # the class token
        stem = 2 * patches * 3 * ph * pw * self.width  # the patch-embedding convolution
        head = 2 * self.width * embed_dim  # the class token's projection
        return (
            stem + transformer_flops(tokens, self.width, self.layers, int(self.width * self.mlp_ratio)) + head
        )
