"""Text tokenizers: open_clip's bundled CLIP BPE (default) or a trained sentencepiece model.

Both map ``list[str]`` to a ``(N, context_length)`` LongTensor of ``[sot, pieces...,
eot, 0, 0, ...]``; a caption too long is cut and still ends with eot.  The text
tower pools at the position of the *largest* token id (open_clip's default
``pool_type="argmax"``), so eot must be the largest id: for sentencepiece the ids are

    0 = padding, 1..P = the P sentencepiece pieces (spm id + 1), P+1 = sot, P+2 = eot

and the tower's ``vocab_size`` is P + 3.  Captions are lower-cased and whitespace
is collapsed before encoding, as the CLIP tokenizer does.

Which tokenizer a model uses lives in its architecture dict:
``text_cfg["tokenizer_kwargs"] = {"sentencepiece": PATH}`` (a field open_clip's text
config carries and ignores), set by ``validate()`` from ``model.tokenizer``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from open_clip.tokenizer import SimpleTokenizer

SPM_KEY = "sentencepiece"


def clean_caption(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip().lower()


class SentencePieceTokenizer:
    def __init__(self, model_file: str | Path, context_length: int = 77):
        self.model_file = str(model_file)
        self.context_length = int(context_length)
        self._sp = None
        self.pieces = self._processor().get_piece_size()
        self.sot_token_id = self.pieces + 1
        self.eot_token_id = self.pieces + 2
        self.vocab_size = self.pieces + 3

    def _processor(self):
        if self._sp is None:
            import sentencepiece as spm

            self._sp = spm.SentencePieceProcessor(model_file=self.model_file)
        return self._sp

    def __getstate__(self):  # DataLoader workers re-open the model file
        return {**self.__dict__, "_sp": None}

    def encode(self, text: str) -> list[int]:
        return [i + 1 for i in self._processor().encode(clean_caption(text))]

    def decode(self, ids) -> str:
        pieces = [int(i) - 1 for i in ids if 0 < int(i) <= self.pieces]
        return self._processor().decode(pieces)

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        length = context_length or self.context_length
        out = torch.zeros(len(texts), length, dtype=torch.long)  # (N, L), 0 = padding
        for row, ids in enumerate(self._processor().encode([clean_caption(t) for t in texts])):
            tokens = [self.sot_token_id] + [i + 1 for i in ids][: length - 2] + [self.eot_token_id]
            out[row, : len(tokens)] = torch.tensor(tokens)
        return out


def sentencepiece_vocab_size(model_file: str | Path) -> int:
    """The text tower's vocab_size for a sentencepiece model (pieces + pad/sot/eot)."""
    import sentencepiece as spm

    return spm.SentencePieceProcessor(model_file=str(model_file)).get_piece_size() + 3


def tokenizer_file(arch: dict) -> str | None:
    kwargs = arch.get("text_cfg", {}).get("tokenizer_kwargs") or {}
    return kwargs.get(SPM_KEY)


def build_tokenizer(arch: dict, base_dir: str | Path | None = None):
    """Tokenizer for a text tower: ``tokenizer(list[str]) -> LongTensor (N, context_length)``.

    A relative sentencepiece path resolves against ``base_dir`` (a saved model's folder).
    """
    context_length = int(arch["text_cfg"].get("context_length", 77))
    spm_file = tokenizer_file(arch)
    if spm_file is None:
        return SimpleTokenizer(context_length=context_length)
    path = Path(spm_file)
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return SentencePieceTokenizer(path, context_length)
