"""Text tokenizers: open_clip's bundled CLIP BPE (default), a trained sentencepiece model, or
the tokenizer saved in a Hugging Face text tower's folder (``model.text.hf_local_dir``).

Both map ``list[str]`` to a ``(N, context_length)`` LongTensor of ``[sot, pieces...,
eot, 0, 0, ...]``; a caption too long is cut and still ends with eot.  The text
tower pools at the position of the *largest* token id (open_clip's default
``pool_type="argmax"``), so eot must be the largest id: for sentencepiece the ids are

    0 = padding, 1..P = the P sentencepiece pieces (spm id + 1), P+1 = sot, P+2 = eot

and the tower's ``vocab_size`` is P + 3.  Captions are lower-cased and whitespace
is collapsed before encoding, as the CLIP tokenizer does.

Which tokenizer a model uses is its text tower kind's business (models/towers/, and
``mmalign.models.tokenizers.build_tokenizer``): for
open_clip's text transformer the arch's ``text_cfg.tokenizer_kwargs = {"sentencepiece": PATH}``
(a field open_clip's text config carries and ignores), set by ``resolve()`` from
``model.tokenizer``; for a Hugging Face text tower open_clip's ``text_cfg.hf_tokenizer_name``
(a local folder, see mmalign/models/hf_text.py), whose ids go to the tower unchanged (it pools
by attention mask or CLS, not at the largest id).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from mmalign.sentencepiece_file import SPM_KEY, open_sentencepiece, sentencepiece_vocab_size  # noqa: F401 (re-exported)


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
            self._sp = open_sentencepiece(self.model_file)
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


class HFTextTokenizer:
    """A transformers tokenizer saved in a local folder, as ``list[str] -> (N, L)`` ids:
    the tokenizer's own special tokens (e.g. BERT's ``[CLS] ... [SEP]``), truncated to
    ``context_length`` and padded with its pad id (the HF tower's attention mask is
    ``ids != pad_token_id``).  Loaded from local files only."""

    def __init__(self, folder: str | Path, context_length: int):
        from transformers import AutoTokenizer

        from mmalign.errors import UsageError, first_line

        self.folder = str(folder)
        self.context_length = int(context_length)
        if not Path(self.folder).is_dir():
            raise UsageError(
                f"tokenizer {self.folder}: not a folder (expected a Hugging Face tokenizer folder, "
                f"as AutoTokenizer.save_pretrained writes)"
            )
        try:
            self._tok = AutoTokenizer.from_pretrained(self.folder, local_files_only=True)
        except Exception as e:  # transformers raises OSError / ValueError / its own types for a broken folder
            raise UsageError(
                f"tokenizer {self.folder}: no Hugging Face tokenizer loads from it (expected the files "
                f"AutoTokenizer.save_pretrained writes; {type(e).__name__}: {first_line(e)[:160]})"
            ) from None
        self.vocab_size = len(self._tok)
        self.pad_token_id = self._tok.pad_token_id

    def encode(self, text: str) -> list[int]:
        return self._tok(clean_whitespace(text), add_special_tokens=False)["input_ids"]

    def decode(self, ids) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=True))  # one sequence: a str

    def __call__(self, texts: str | list[str], context_length: int | None = None) -> torch.Tensor:
        if isinstance(texts, str):
            texts = [texts]
        length = context_length or self.context_length
        out = self._tok(
            [clean_whitespace(t) for t in texts],
            padding="max_length",
            truncation=True,
            max_length=length,
            return_tensors="pt",
        )
        return out["input_ids"].long()  # (N, L)


def clean_whitespace(text: str) -> str:
    """open_clip's HFTokenizer default cleaning (case is the tokenizer's own business)."""
    return re.sub(r"\s+", " ", text).strip()
