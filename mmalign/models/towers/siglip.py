"""The SigLIP family's tower kinds (their modules: models/siglip_modules.py): transformers'
own ``SiglipVisionModel`` / ``SiglipTextModel`` and SigLIP2's ``Siglip2VisionModel`` / ``Siglip2TextModel``, built from the config dict the
architecture carries (``hf_config``; no download, no file read), so the embeddings are
transformers' to the last bit and the parameters are plain ``nn.Parameter``s (ZeRO, gradient
caching and LiT see an ordinary module).  An HF folder becomes this architecture in
models/siglip_hf.py.

Images arrive as every mmalign image does: (B, 3, S, S), normalised with OpenAI's mean and
std by the data side.  The image tower maps them to its own normalisation (SigLIP: mean =
std = 0.5) with one exact per-channel affine step, so the loader, the eval suites and the
device-side normalisation need no SigLIP branch.  SigLIP2 (NaFlex) takes patches: a square
image is cut into (B, N, p*p*3) rows in Siglip2ImageProcessor's order, with a full
``pixel_attention_mask`` and ``spatial_shapes`` (S/p, S/p).

Captions are the folder's transformers tokenizer (SigLIP's sentencepiece ``spiece.model``,
SigLIP2's Gemma ``tokenizer.json``), padded to ``context_length`` (64) as transformers'
zero-shot pipeline does, with no attention mask: both were trained so (the pad positions
are attended to, and the last position is pooled).  ``attention_mask: true`` in ``text_cfg``
masks ``ids != pad_token_id`` instead (for a model trained that way)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmalign.errors import ConfigError
from mmalign.models.towers.base import Tokenizer, TowerSpec, register_tower
from mmalign.models.towers.text import example_tokens

if TYPE_CHECKING:
    import torch
    from torch import nn

SIGLIP_MEAN = (0.5, 0.5, 0.5)  # SiglipImageProcessor's image_mean / image_std
SIGLIP_STD = (0.5, 0.5, 0.5)


@register_tower("siglip_vision")
@dataclass
class SiglipVisionSpec(TowerSpec):
    side = "vision"
    marker = "hf_config"

    family: str = "siglip"
    hf_config: dict[str, Any] = field(default_factory=dict)  # transformers' vision_config (structural keys)
    image_size: int | tuple[int, ...] = 224
    image_mean: tuple[float, ...] = SIGLIP_MEAN
    image_std: tuple[float, ...] = SIGLIP_STD

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        width = int(self.hf_config.get("hidden_size", 0))
        if width != embed_dim:
            raise ConfigError(
                f"SigLIP image tower: its pooled width {width} differs from embed_dim {embed_dim} "
                f"(SigLIP has no separate image projection)"
            )
        from mmalign.models.siglip_modules import SiglipImageTower

        return SiglipImageTower(self.family, self.built_config, tuple(self.image_mean), tuple(self.image_std))

    @property
    def built_config(self) -> dict[str, Any]:
        """The vision config the tower is built with: SigLIP's position table sized for
        ``image_size`` (a checkpoint's table is resampled to it on loading, models/pos_embed.py);
        SigLIP2 keeps its table and resizes it per image (NaFlex)."""
        if self.family != "siglip":
            return dict(self.hf_config)
        from mmalign.models.towers.vit import square

        return {**self.hf_config, "image_size": square(self.image_size)[0]}

    def lock_groups(self, module: nn.Module) -> int:
        return int(self.hf_config.get("num_hidden_layers", 0))

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        from mmalign.errors import UsageError

        if self.family == "siglip2":
            raise UsageError(
                "--format onnx: a SigLIP2 (NaFlex) image tower resizes its position table per image, "
                "which a graph traced at one batch size cannot replay; use --format hf"
            )
        return self._example(batch)

    def _example(self, batch: int) -> torch.Tensor:
        import torch

        from mmalign.models.towers.vit import square

        return torch.randn(batch, 3, *square(self.image_size))  # (B, 3, H, W)

    def flops(self, embed_dim: int) -> int:
        """torch's FLOP counter on a forward at batch 1: on the meta device, else a real copy
        (the base's count, without the ONNX example that SigLIP2 refuses)."""
        import torch

        from mmalign.models.towers.base import _counted

        try:
            with torch.device("meta"):
                return _counted(self.build(embed_dim, False).eval(), self._example(1).to("meta"))
        except (NotImplementedError, RuntimeError):
            return _counted(self.build(embed_dim, False).eval(), self._example(1))


@register_tower("siglip_text")
@dataclass
class SiglipTextSpec(TowerSpec):
    side = "text"
    marker = "hf_config"
    ships_files = True  # its tokenizer folder (copied by models/hf_text.record_for_save into hf_text/)

    family: str = "siglip"
    hf_config: dict[str, Any] = field(default_factory=dict)  # transformers' text_config (structural keys)
    context_length: int = 64
    vocab_size: int = 32000
    hf_model_name: str = ""  # the folder holding the tokenizer (and config.json); the names of hf_text's
    hf_tokenizer_name: str = ""
    attention_mask: bool = False  # the tokenizer returns an attention mask: the tower builds it from pad ids
    pad_token_id: int = 0

    @property
    def folder(self) -> str | None:
        return self.hf_tokenizer_name or self.hf_model_name or None

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        width = int(self.hf_config.get("projection_size") or self.hf_config.get("hidden_size", 0))
        if width != embed_dim:
            raise ConfigError(
                f"SigLIP text tower: its head's width {width} differs from embed_dim {embed_dim}"
            )
        from mmalign.models.siglip_modules import SiglipTextTower

        return SiglipTextTower(
            self.family, self.hf_config, self.pad_token_id if self.attention_mask else None
        )

    def tokenizer(self, base_dir: str | Path | None = None) -> Tokenizer:
        from mmalign.data.tokenizer import HFTextTokenizer
        from mmalign.errors import UsageError

        if not self.folder:
            raise UsageError("the SigLIP text tower names no tokenizer folder (hf_tokenizer_name)")
        path = Path(self.folder)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        return HFTextTokenizer(path, self.context_length)

    def lock_groups(self, module: nn.Module) -> int:
        return int(self.hf_config.get("num_hidden_layers", 0))

    def export_files(self, out: Path) -> None:
        from mmalign.models.hf_text import copy_config_and_tokenizer

        if self.folder:
            copy_config_and_tokenizer(self.folder, out)

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        return example_tokens(batch, tokenizer or self.tokenizer())  # (B, L)

    def onnx_tokenizer(self, tokenizer_file: str | None) -> dict[str, Any]:
        from mmalign.models.hf_text import SAVED_DIR

        return {"type": "hf", "folder": SAVED_DIR, "context_length": self.context_length}


__all__ = ["SIGLIP_MEAN", "SIGLIP_STD", "SiglipTextSpec", "SiglipVisionSpec"]
