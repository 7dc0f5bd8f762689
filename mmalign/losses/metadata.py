"""Metadata positives: a (B, B) boolean positive mask from sample attributes.

Supervised contrastive learning (SupCon, Khosla et al. 2020, arXiv
2004.11362) makes every pair that shares a class a positive; class ids go
through ``positive_ids`` (:mod:`.positives`). Some positive relations are not
an equivalence, so no id can express them. The one built here: a caption
that **mentions only a subset of attributes** ("a red shape") truly describes
every image that has all the mentioned attributes, so image i is a positive
of caption j iff ``attrs(i)[k] == attrs(j)[k]`` for every attribute k that
caption j mentions. The relation is not symmetric, hence a mask, not ids.

The loader yields one int64 per sample from ``data.id_field`` (``ids``), so
a sample's attributes and its caption's mention set travel packed into one
integer, the **attribute-subset code**:

    bits [0, K)                  mention mask: bit k set = caption mentions attribute k
    bits [K + b k, K + b (k+1))  value index of attribute k (b bits each)
    bits [56, 62)                K itself, so a code decodes without a schema

with K attributes of at most 2^b values each (K + b K <= 56).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["encode_subset_code", "subset_mask", "SUBSET_BITS"]

SUBSET_BITS = 4  # value bits per attribute: up to 16 values


def encode_subset_code(values: list[int], mentioned: list[bool], bits: int = SUBSET_BITS) -> int:
    """Pack K attribute value indices and the caption's mention flags into one int."""
    k = len(values)
    if len(mentioned) != k or not 0 < k * (bits + 1) <= 56:
        raise ValueError("need one mention flag per attribute and 0 < K (bits + 1) <= 56")
    code = sum(1 << i for i, m in enumerate(mentioned) if m) | (k << 56)
    for i, v in enumerate(values):
        if not 0 <= v < (1 << bits):
            raise ValueError(f"attribute value index {v} does not fit in {bits} bits")
        code |= v << (k + bits * i)
    return code


def subset_mask(codes: Tensor, bits: int = SUBSET_BITS) -> Tensor:
    """(B, B) bool: ``mask[i, j]`` = image i has every attribute caption j mentions.

    codes: (B,) int64 attribute-subset codes. Row = image, column = caption,
    as the image->text logits. The diagonal is always True (a caption
    describes its own image).
    """
    codes = codes.to(torch.int64)
    ks = codes >> 56
    n_attrs = int(ks[0]) if ks.numel() else 0
    if n_attrs <= 0 or not bool((ks == n_attrs).all()):
        raise ValueError("not attribute-subset codes (or codes of different schemas in one batch)")
    ok = torch.ones(codes.shape[0], codes.shape[0], dtype=torch.bool, device=codes.device)  # (B, B)
    for k in range(n_attrs):
        mentioned = ((codes >> k) & 1).bool()  # (B,) caption j mentions attribute k
        value = (codes >> (n_attrs + bits * k)) & ((1 << bits) - 1)  # (B,)
        agree = value[:, None] == value[None, :]  # (B, B)
        ok &= agree | ~mentioned[None, :]
    return ok
