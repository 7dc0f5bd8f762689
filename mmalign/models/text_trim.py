"""Trailing-padding trim for causal text towers: exact, and most of the text tower's cost.

A CLIP tokenizer pads every caption to the context length (open_clip: 77 ids, our tiny
preset: 32), yet CIFAR-style prompts are 8-15 tokens and web captions have a median near
15.  In open_clip's causal ``TextTransformer`` position ``i`` attends to positions ``<= i``
only, and the pooled feature is read at the EOT token (``pool_type`` argmax / eos) or the
first token; so the columns after the longest caption of a batch never reach the output.
Cutting them gives the same features and the same gradients (up to float rounding: the
matmuls change shape) while the text tower's forward and backward shrink with the
sequence (here 32 -> 11 tokens: 392 -> 148 ms fwd+bwd at batch 256 on 2 CPU cores).

The cut is made on the host (``trim_tokens``), before the batch is copied to the device, so
no device value is read; on CUDA the length is rounded up to a multiple of 8 (tensor-core
friendly shapes, and at most ``context/8`` distinct shapes for ``torch.compile`` to see).
Towers where the padding does matter are left alone (``trimmable`` is False): a
bidirectional text tower (``no_causal_mask``, pad masks), ``pool_type: last`` (the last
position is a pad), CoCa's appended class token, HF text towers (their own attention mask).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["trimmable", "trimmed_length", "trim_tokens", "trim_batch", "short_context", "multiple_for"]

_EXACT_POOLS = ("argmax", "eos", "first")
# short_context swaps a module attribute for the length of a forward: threads that encode
# text with one model at once (a library user's thread pool) take turns
_SWAP = threading.RLock()


def trimmable(text: nn.Module) -> bool:
    """Whether cutting trailing pad columns leaves ``text``'s pooled output unchanged: an
    open_clip ``TextTransformer`` with its causal mask, no pad mask, no appended class token,
    pooled at the EOT token or the first token."""
    from open_clip.transformer import TextTransformer

    return (
        isinstance(text, TextTransformer)
        and getattr(text, "attn_mask", None) is not None
        and getattr(text, "cls_emb", None) is None
        and not getattr(text, "use_pad_mask", False)
        and getattr(text, "pool_type", None) in _EXACT_POOLS
    )


def multiple_for(device: torch.device | str) -> int:
    """Round trimmed lengths up to this multiple: 8 on CUDA (tensor cores; few compiled
    shapes), 1 elsewhere (a CPU gains from every column cut)."""
    return 8 if torch.device(device).type == "cuda" else 1


def trimmed_length(tokens: torch.Tensor, pad_id: int = 0, multiple: int = 1) -> int:
    """The shortest length ``<= tokens.shape[-1]`` that keeps every non-pad id of ``tokens``
    (..., L), rounded up to ``multiple`` (at least 1 column). One host read: call it on a
    CPU tensor."""
    length = tokens.shape[-1]
    if tokens.numel() == 0 or length == 0:
        return length
    used = (tokens.reshape(-1, length) != pad_id).any(dim=0)  # (L,) bool: a column holding any real id
    nonzero = used.nonzero()
    last = int(nonzero[-1]) + 1 if len(nonzero) else 1
    return min(length, max(1, multiple * math.ceil(last / multiple)))


def trim_tokens(tokens: torch.Tensor, pad_id: int = 0, multiple: int = 1) -> torch.Tensor:
    """``tokens`` (..., L) without its trailing all-pad columns (a view)."""
    return tokens[..., : trimmed_length(tokens, pad_id, multiple)]


@contextlib.contextmanager
def short_context(text: nn.Module, length: int) -> Iterator[None]:
    """Run ``text`` (a :func:`trimmable` tower) on ``length`` columns: its causal mask is
    sliced to (length, length) for the duration (open_clip slices the positional embedding
    itself but passes its whole (context, context) mask to every block). Held under one lock:
    a concurrent forward of the same tower never sees another call's mask."""
    with _SWAP:
        full: torch.Tensor = text.get_buffer("attn_mask")  # (C, C) additive causal mask, non-persistent
        if length >= full.shape[0]:
            yield
            return
        text.attn_mask = full[:length, :length]
        try:
            yield
        finally:
            text.attn_mask = full


def trim_batch(batch, pad_id: int = 0, multiple: int = 1):
    """A :class:`~mmalign.data.batch.Batch` whose ``tokens`` (B, L) and ``neg_tokens``
    (B, k, L) share the shortest length keeping every real id of either (the model encodes
    them as one concatenation). Host tensors: no device read."""
    fields = {
        name: getattr(batch, name) for name in ("tokens", "neg_tokens") if getattr(batch, name) is not None
    }
    length = max(trimmed_length(t, pad_id, multiple) for t in fields.values())
    if length == batch.tokens.shape[-1]:
        return batch
    return dataclasses.replace(batch, **{name: t[..., :length] for name, t in fields.items()})
