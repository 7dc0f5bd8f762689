"""The tokenizer of a model's text tower, made by the tower's kind (models/towers/).

The tokenizers themselves live below the models (mmalign/data/tokenizer.py); choosing one for
an architecture is the towers' business, so it sits here: the data layer never imports the
models.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mmalign.models.towers import Tokenizer, Towers, TowerSpec


def text_spec(arch: dict[str, Any] | Towers | TowerSpec) -> TowerSpec:
    """The typed text tower of an architecture dict (or a spec / a model's ``towers`` as is)."""
    from mmalign.models.towers import Towers, TowerSpec, spec_from_cfg

    if isinstance(arch, Towers):
        return arch.text
    if isinstance(arch, TowerSpec):
        return arch
    return spec_from_cfg("text", dict(arch.get("text_cfg", {})))


def tokenizer_file(arch: dict[str, Any] | Towers | TowerSpec) -> str | None:
    """The sentencepiece model file a text tower names, or None."""
    return text_spec(arch).tokenizer_file


def build_tokenizer(
    arch: dict[str, Any] | Towers | TowerSpec, base_dir: str | Path | None = None
) -> Tokenizer:
    """Tokenizer for a text tower: ``tokenizer(list[str]) -> LongTensor (N, context_length)``.

    ``arch``: an architecture dict, a model's ``towers`` or a text tower spec; the tower's kind
    makes it (models/towers/), and a kind without a tokenizer is an error, never CLIP BPE by
    default.  A relative sentencepiece path or Hugging Face folder resolves against
    ``base_dir`` (a saved model's folder).
    """
    return text_spec(arch).tokenizer(base_dir)  # a kind without the hook: TowerSpec's one-line refusal
