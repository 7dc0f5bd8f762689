"""Text tokenizers: open_clip's bundled CLIP BPE (no download)."""

from __future__ import annotations

from open_clip.tokenizer import SimpleTokenizer


def build_tokenizer(arch: dict) -> SimpleTokenizer:
    """Tokenizer for a text tower: ``tokenizer(list[str]) -> LongTensor (N, context_length)``."""
    return SimpleTokenizer(context_length=int(arch["text_cfg"].get("context_length", 77)))
