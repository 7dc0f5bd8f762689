"""The tokenizer of a model's text tower, made by the tower's kind (models/towers/).

The tokenizers themselves live below the models (mmalign/data/tokenizer.py); choosing one for
an architecture is the towers' business, so it sits here: the data layer never imports the
models.
"""

from __future__ import annotations

from pathlib import Path


def text_spec(arch):
    """The typed text tower of an architecture dict (or a spec / a model's ``towers`` as is)."""
    from mmalign.models.towers import Towers, TowerSpec, spec_from_cfg

    if isinstance(arch, Towers):
        return arch.text
    if isinstance(arch, TowerSpec):
        return arch
    return spec_from_cfg("text", dict(arch.get("text_cfg", {})))


def tokenizer_file(arch) -> str | None:
    """The sentencepiece model file a text tower names, or None."""
    return getattr(text_spec(arch), "tokenizer_file", None)


def build_tokenizer(arch, base_dir: str | Path | None = None):
    """Tokenizer for a text tower: ``tokenizer(list[str]) -> LongTensor (N, context_length)``.

    ``arch``: an architecture dict, a model's ``towers`` or a text tower spec; the tower's kind
    makes it (models/towers/), and a kind without a tokenizer is an error, never CLIP BPE by
    default.  A relative sentencepiece path or Hugging Face folder resolves against
    ``base_dir`` (a saved model's folder).
    """
    from mmalign.errors import UsageError

    spec = text_spec(arch)
    make = getattr(spec, "tokenizer", None)
    if not callable(make):
        raise UsageError(f"the {spec.kind} text tower kind has no tokenizer() hook")
    return make(base_dir)
