"""open_clip's TextTransformer (the default ``text_cfg``), with CLIP BPE or a sentencepiece
tokenizer (``tokenizer_kwargs: {sentencepiece: PATH}``, data/tokenizer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmalign.models.towers.base import Tokenizer, TowerSpec, register_tower
from mmalign.models.towers.vit import transformer_flops

if TYPE_CHECKING:
    import torch
    from torch import nn

SPM_KEY = "sentencepiece"


def example_tokens(batch: int, tokenizer: Tokenizer) -> torch.Tensor:
    """``batch`` example captions as ids (B, L), B <= 3: a text tower's example input."""
    return tokenizer(["an example caption", "another one", "a third"][:batch]).long()  # (B, L)


@register_tower("open_clip_text")
@dataclass
class TextSpec(TowerSpec):
    side = "text"
    fallback = True  # open_clip's default text tower: a dict no other kind claims
    hf_clip = True

    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0
    tokenizer_kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def claims(cls, cfg: dict[str, Any]) -> bool:
        return True

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        from open_clip.model import _build_text_tower

        module: nn.Module = _build_text_tower(embed_dim, self.to_cfg(), quick_gelu)
        return module

    @property
    def tokenizer_file(self) -> str | None:
        """The sentencepiece model this tower's ids come from, or None (CLIP BPE)."""
        file = (self.tokenizer_kwargs or {}).get(SPM_KEY)
        return None if file is None else str(file)

    def tokenizer(self, base_dir: str | Path | None = None) -> Tokenizer:
        """``list[str] -> (N, context_length)`` ids; a relative file resolves against ``base_dir``."""
        from open_clip.tokenizer import SimpleTokenizer

        from mmalign.data.tokenizer import SentencePieceTokenizer

        if self.tokenizer_file is None:
            bpe: Tokenizer = SimpleTokenizer(context_length=self.context_length)
            return bpe
        path = Path(self.tokenizer_file)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        return SentencePieceTokenizer(path, self.context_length)

    def lock_groups(self, module: nn.Module) -> int:
        return self.layers

    def open_clip_cfg(self) -> dict[str, Any]:
        # open_clip passes tokenizer_kwargs to its SimpleTokenizer; a sentencepiece path there
        # would be an unknown keyword, so the exporter records it outside model_cfg instead.
        cfg = self.to_cfg()
        cfg.pop("tokenizer_kwargs", None)
        return cfg

    def onnx_tokenizer(self, tokenizer_file: str | None) -> dict[str, Any]:
        """The ``tokenizer`` entry of ``onnx_config.json`` (the file is copied beside the graphs)."""
        kind: dict[str, Any] = (
            {"type": "sentencepiece", "file": "tokenizer.model"} if tokenizer_file else {"type": "clip_bpe"}
        )
        return kind | {"context_length": self.context_length}

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        return example_tokens(batch, tokenizer or self.tokenizer())  # (B, L)

    def flops(self, embed_dim: int) -> int:
        tokens = self.context_length
        return (
            transformer_flops(tokens, self.width, self.layers, int(self.width * self.mlp_ratio))
            + 2 * self.width * embed_dim
        )  # the pooled token's projection
