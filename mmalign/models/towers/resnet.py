"""open_clip's ModifiedResNet (``RN50``-style ``vision_cfg``: ``layers`` a list of 4 block counts):
a 3-convolution stem, 4 bottleneck stages and an attention-pooling head."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mmalign.models.towers.base import Tokenizer, TowerSpec, register_tower
from mmalign.models.towers.vit import square

if TYPE_CHECKING:
    import torch
    from torch import nn


@register_tower("open_clip_resnet")
@dataclass
class ResNetSpec(TowerSpec):
    side = "vision"
    marker = "layers"

    image_size: int | tuple[int, ...] = 224
    layers: tuple[int, ...] = (3, 4, 6, 3)
    width: int = 64
    head_width: int = 64

    @classmethod
    def claims(cls, cfg: dict[str, Any]) -> bool:
        return isinstance(cfg.get("layers"), (list, tuple)) and not cfg.get("timm_model_name")

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        from open_clip.model import _build_vision_tower

        module: nn.Module = _build_vision_tower(embed_dim, self.to_cfg(), quick_gelu)
        return module

    def lock_groups(self, module: nn.Module) -> int:
        return 0  # open_clip's ModifiedResNet locks whole or not at all

    def open_clip_cfg(self) -> dict[str, Any]:
        return self.to_cfg()

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        import torch

        return torch.randn(batch, 3, *square(self.image_size))  # (B, 3, H, W)

    def flops(self, embed_dim: int) -> int:
        """Convolutions at each resolution, then the attention pool (every token, the mean and
        the grid, goes through q/k/v, attention and c_proj; only the mean's row is kept)."""
        side, _ = square(self.image_size)
        w = self.width

        def conv(
            cin: int, cout: int, k: int, res: int
        ) -> int:  # multiply-adds of a same-padded conv at output res x res
            return cin * cout * k * k * res * res

        res = side // 2  # stem conv1 has stride 2
        macs = conv(3, w // 2, 3, res) + conv(w // 2, w // 2, 3, res) + conv(w // 2, w, 3, res)
        res //= 2  # the stem's average pool
        inplanes = w
        for stage, blocks in enumerate(self.layers):
            planes, stride = w * 2**stage, 1 if stage == 0 else 2
            for block in range(blocks):
                s = stride if block == 0 else 1
                out = res // s
                macs += (
                    conv(inplanes, planes, 1, res)
                    + conv(planes, planes, 3, res)
                    + conv(planes, 4 * planes, 1, out)
                )
                if s > 1 or inplanes != 4 * planes:
                    macs += conv(inplanes, 4 * planes, 1, out)  # the downsample branch
                inplanes, res = 4 * planes, out
        d, n = w * 32, res * res + 1  # the pool's width and tokens (grid + mean)
        macs += 3 * n * d * d + 2 * n * n * d + n * d * embed_dim  # q, k, v; QK^T and PV; c_proj
        return int(2 * macs)
