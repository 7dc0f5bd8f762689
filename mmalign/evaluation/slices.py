"""Slice reports: a metric broken down by a metadata field of the evaluation samples.

Any key of the shards' ``.json`` can be a slice (on the shapes: ``background``,
``size``, ``position``, ...).  A model can be right on average and wrong on a slice
(small shapes, a dark background); the headline accuracy hides that, the slice
table shows it.  Values that are lists (``grid``) are sliced by their string form.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from mmalign.evaluation.zeroshot import classification_metrics


def _value(meta: dict, field: str) -> str:
    value = meta.get(field, "<missing>")
    return value if isinstance(value, str) else str(value)


def slice_metrics(logits: torch.Tensor, labels: torch.Tensor, metas: list[dict], field: str) -> dict:
    """``logits`` (N, C), ``labels`` (N,) -> {value: {"n", "acc1", "mean_per_class_recall"}}, sorted by value."""
    groups: dict[str, list[int]] = defaultdict(list)
    for i, meta in enumerate(metas):
        groups[_value(meta, field)].append(i)
    out = {}
    for value in sorted(groups):
        idx = torch.tensor(groups[value])
        m = classification_metrics(logits[idx], labels[idx])
        out[value] = {"n": len(idx), "acc1": m["acc1"], "mean_per_class_recall": m["mean_per_class_recall"]}
    return out
