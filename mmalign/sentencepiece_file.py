"""A sentencepiece model file: opened with a one-line error, and the text tower's vocab size.

Below the config (which derives ``model.text.vocab_size`` from ``model.tokenizer``) and the
tokenizers of mmalign/data/tokenizer.py, which both read the file through it.
"""

from __future__ import annotations

from pathlib import Path

SPM_KEY = "sentencepiece"  # text_cfg.tokenizer_kwargs' key for the file (mmalign/data/tokenizer.py)
SPM_EXPECTED = "expected a sentencepiece .model file, as `mmalign tokenizer train` writes"


def open_sentencepiece(model_file: str | Path):
    """A loaded ``SentencePieceProcessor``; any file that is not a sentencepiece model (a text
    file, a BPE vocab, random bytes, a folder) is one :class:`UsageError` line naming the path
    and what was expected, never sentencepiece's RuntimeError."""
    import sentencepiece as spm

    from mmalign.errors import UsageError, first_line

    path = Path(model_file)
    if not path.exists():
        raise UsageError(f"tokenizer {path}: file not found ({SPM_EXPECTED})")
    if not path.is_file():
        raise UsageError(f"tokenizer {path}: not a file ({SPM_EXPECTED})")
    try:
        processor = spm.SentencePieceProcessor(model_file=str(path))
    except (RuntimeError, OSError, ValueError) as e:  # sentencepiece's parse errors are RuntimeErrors
        reason = first_line(e).replace(f" from {path}", "") or type(e).__name__  # the path is named once
        raise UsageError(
            f"tokenizer {path}: not a sentencepiece model ({SPM_EXPECTED}; sentencepiece says {reason[:160]})"
        ) from None
    if processor.get_piece_size() < 1:  # parses, but would encode every caption as nothing
        raise UsageError(f"tokenizer {path}: a sentencepiece model without pieces ({SPM_EXPECTED})")
    return processor


def sentencepiece_vocab_size(model_file: str | Path) -> int:
    """The text tower's vocab_size for a sentencepiece model (pieces + pad/sot/eot)."""
    return open_sentencepiece(model_file).get_piece_size() + 3
