"""open_clip's TextTransformer (the default ``text_cfg``), with CLIP BPE or a sentencepiece
tokenizer (``tokenizer_kwargs: {sentencepiece: PATH}``, data/tokenizer.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from torch import nn

from mmalign.models.towers.base import TowerSpec, register_tower
from mmalign.models.towers.vit import transformer_flops

SPM_KEY = "sentencepiece"


@register_tower("open_clip_text")
@dataclass
class TextSpec(TowerSpec):
    side = "text"
    hf_clip = True

    context_length: int = 77
    vocab_size: int = 49408
    width: int = 512
    heads: int = 8
    layers: int = 12
    mlp_ratio: float = 4.0
    tokenizer_kwargs: dict = field(default_factory=dict)

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        from open_clip.model import _build_text_tower

        return _build_text_tower(embed_dim, self.to_cfg(), quick_gelu)

    @property
    def tokenizer_file(self) -> str | None:
        """The sentencepiece model this tower's ids come from, or None (CLIP BPE)."""
        return (self.tokenizer_kwargs or {}).get(SPM_KEY)

    def tokenizer(self, base_dir: str | Path | None = None):
        """``list[str] -> (N, context_length)`` ids; a relative file resolves against ``base_dir``."""
        from open_clip.tokenizer import SimpleTokenizer

        from mmalign.data.tokenizer import SentencePieceTokenizer

        if self.tokenizer_file is None:
            return SimpleTokenizer(context_length=self.context_length)
        path = Path(self.tokenizer_file)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        return SentencePieceTokenizer(path, self.context_length)

    def lock_groups(self, module: nn.Module) -> int:
        return self.layers

    def open_clip_cfg(self) -> dict:
        # open_clip passes tokenizer_kwargs to its SimpleTokenizer; a sentencepiece path there
        # would be an unknown keyword, so the exporter records it outside model_cfg instead.
        cfg = self.to_cfg()
        cfg.pop("tokenizer_kwargs", None)
        return cfg

    def onnx_tokenizer(self, tokenizer_file: str | None) -> dict:
        """The ``tokenizer`` entry of ``onnx_config.json`` (the file is copied beside the graphs)."""
        kind = (
            {"type": "sentencepiece", "file": "tokenizer.model"} if tokenizer_file else {"type": "clip_bpe"}
        )
        return kind | {"context_length": self.context_length}

    def onnx_input(self, batch: int, tokenizer=None):
        return tokenizer(["an example caption", "another one", "a third"][:batch]).long()  # (B, L)

    def flops(self, embed_dim: int) -> int:
        tokens = self.context_length
        return (
            transformer_flops(tokens, self.width, self.layers, int(self.width * self.mlp_ratio))
            + 2 * self.width * embed_dim
        )  # the pooled token's projection
