"""The SigLIP family's modules (the tower kinds are models/towers/siglip.py): transformers'
own vision and text models built from a config dict, behind mmalign's tower interface
((B, 3, S, S) OpenAI-normalised images or (B, L) ids -> (B, D) features)."""

from __future__ import annotations

from typing import Any, cast

import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from torch import nn

from mmalign.errors import ConfigError
from mmalign.models.pos_embed import GRIDS, Grid

FAMILIES = ("siglip", "siglip2")


def _family(family: str) -> str:
    if family not in FAMILIES:
        raise ConfigError(f"SigLIP tower family {family!r} is unknown (choose from {', '.join(FAMILIES)})")
    return family


def _hf_module(family: str, side: str, hf_config: dict[str, Any]) -> nn.Module:
    """transformers' tower of ``family`` built from its config dict (random init; weights are
    loaded by the caller)."""
    if _family(family) == "siglip":
        from transformers import SiglipTextConfig, SiglipTextModel, SiglipVisionConfig, SiglipVisionModel

        if side == "vision":
            return SiglipVisionModel(SiglipVisionConfig(**hf_config))
        return SiglipTextModel(SiglipTextConfig(**hf_config))
    from transformers import Siglip2TextConfig, Siglip2TextModel, Siglip2VisionConfig, Siglip2VisionModel

    if side == "vision":
        return Siglip2VisionModel(Siglip2VisionConfig(**hf_config))
    return Siglip2TextModel(Siglip2TextConfig(**hf_config))


def _layers(hf: nn.Module) -> list[nn.Module]:
    return list(hf.get_submodule("encoder.layers").children())


def _lock(hf: nn.Module, unlocked: int, tail: tuple[str, ...]) -> None:
    """LiT: every weight frozen but the last ``unlocked`` encoder layers and, with any unlocked,
    the modules after the encoder (``tail``: final norm and head)."""
    hf.requires_grad_(False)
    if unlocked <= 0:
        return
    for layer in _layers(hf)[-unlocked:]:
        layer.requires_grad_(True)
    for name in tail:
        if hasattr(hf, name) and getattr(hf, name) is not None:
            getattr(hf, name).requires_grad_(True)


class _Checkpointing:
    """``set_grad_checkpointing`` through transformers' own switch (non-reentrant)."""

    hf: Any

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        if enable:
            self.hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            self.hf.gradient_checkpointing_disable()


class SiglipImageTower(_Checkpointing, nn.Module):
    """(B, 3, S, S) OpenAI-normalised images -> (B, D) pooled features (the attention-pool head)."""

    def __init__(self, family: str, hf_config: dict[str, Any], mean: tuple, std: tuple):
        super().__init__()
        self.family = family
        self.hf = _hf_module(family, "vision", hf_config)
        self.patch_size = int(hf_config.get("patch_size", 16))
        self.base_size = int(hf_config.get("image_size", 224))
        # x_model = (x_raw - mean) / std with x_raw = x * std_o + mean_o: one affine map per channel
        scale = torch.tensor(OPENAI_DATASET_STD) / torch.tensor(std)  # (3,)
        shift = (torch.tensor(OPENAI_DATASET_MEAN) - torch.tensor(mean)) / torch.tensor(std)  # (3,)
        self.register_buffer("renorm_scale", scale.view(1, 3, 1, 1), persistent=False)
        self.register_buffer("renorm_shift", shift.view(1, 3, 1, 1), persistent=False)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        scale, shift = cast(torch.Tensor, self.renorm_scale), cast(torch.Tensor, self.renorm_shift)
        x = images * scale.to(images.dtype) + shift.to(images.dtype)  # (B, 3, H, W)
        if self.family == "siglip":
            other = tuple(x.shape[-2:]) != (self.base_size, self.base_size)  # transformers' own resampling
            return self.hf(pixel_values=x, interpolate_pos_encoding=other).pooler_output  # (B, D)
        patches, mask, shapes = patchify(x, self.patch_size)
        return self.hf(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes).pooler_output

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        _lock(self.hf, unlocked_groups, ("post_layernorm", "head"))


def patchify(images: torch.Tensor, patch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, C, H, W) -> NaFlex input: patches (B, N, p*p*C) in Siglip2ImageProcessor's order
    (row-major grid, each patch as (p, p, C)), a full mask (B, N) and the grid (B, 2)."""
    import torch

    b, c, h, w = images.shape
    if h % patch or w % patch:
        raise ValueError(f"image size {h}x{w} is not a multiple of the patch size {patch}")
    gh, gw = h // patch, w // patch
    x = images.reshape(b, c, gh, patch, gw, patch).permute(0, 2, 4, 3, 5, 1)  # (B, gh, gw, p, p, C)
    patches = x.reshape(b, gh * gw, patch * patch * c)  # (B, N, p*p*C)
    mask = torch.ones(b, gh * gw, dtype=torch.long, device=images.device)  # (B, N)
    shapes = torch.tensor([[gh, gw]] * b, dtype=torch.long, device=images.device)  # (B, 2)
    return patches, mask, shapes


class SiglipTextTower(_Checkpointing, nn.Module):
    """(B, L) token ids -> (B, D) features (last position's state through the head)."""

    def __init__(self, family: str, hf_config: dict[str, Any], pad_id: int | None):
        super().__init__()
        self.hf = _hf_module(family, "text", hf_config)
        self.pad_id = pad_id  # None: no attention mask (SigLIP), else ids != pad_id (SigLIP2's tokenizer)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = None if self.pad_id is None else (tokens != self.pad_id).long()  # (B, L)
        return self.hf(input_ids=tokens, attention_mask=mask).pooler_output  # (B, D)

    def lock(self, unlocked_layers: int = 0) -> None:
        _lock(self.hf, unlocked_layers, ("final_layer_norm", "head"))


def _grid(tower: SiglipImageTower) -> tuple[int, int]:
    side = tower.base_size // tower.patch_size
    return side, side


# SigLIP's grid weights, for a checkpoint loaded at another image size (models/pos_embed.py): its
# position table (N, D) has no class token; SigLIP2's is resized per image and never resampled
GRIDS.append(
    Grid(
        "visual.hf.embeddings.position_embedding.weight",
        "visual.hf.embeddings.patch_embedding.weight",
        "visual",
        _grid,
        lambda tower: 0,
    )
)

__all__ = ["FAMILIES", "SiglipImageTower", "SiglipTextTower", "patchify"]
