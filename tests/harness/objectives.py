"""Objectives built from terms with positives / queue entries handed in by a test (a helper
module, not a test file): the loss tests feed the objective tensors directly, as the trainer
feeds it a batch's Embeddings."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from mmalign.data.batch import Batch
from mmalign.models.embeddings import Embeddings
from mmalign.objective import (
    Contrastive,
    ImageImage,
    LossOutput,
    MinedNegatives,
    Objective,
    PositiveSource,
    QueueNegatives,
)


class GivenPositives(PositiveSource):
    """Positive ids / mask given as tensors (the trainer derives them from the batch)."""

    def __init__(self, ids=None, mask=None):
        super().__init__()
        self._ids, self._mask = ids, mask

    def ids(self, batch):
        return self._ids

    def mask(self, batch):
        return self._mask


def objective(
    name: str = "infonce",
    tile: int = 0,
    *,
    ids=None,
    mask=None,
    beta: float = 0.0,
    prior: float = 0.0,
    queue=None,
    mined: bool = False,
    views: tuple[float, float] | None = None,
    stats: bool = True,
    reduce: bool = True,
) -> Objective:
    """``queue``: QueueEntries (a stand-in for the MoCo state); ``views``: (weight, temperature)."""
    terms = []
    if queue is not None:
        terms.append(QueueNegatives(SimpleNamespace(entries=lambda: queue)))
    terms.append(Contrastive(name, tile, beta, prior))
    if mined:
        terms.append(MinedNegatives())
    if views is not None:
        terms.append(ImageImage(views[0], views[1], tile))
    return Objective(terms, GivenPositives(ids, mask), compute_stats=stats, reduce_stats=reduce)


def loss(x, y, s, bias=None, *, x2=None, neg=None, neg_mask=None, **options) -> LossOutput:
    """The objective of ``options`` on features x, y (B, D), scale s (and bias, the second
    view x2, mined negatives neg (B, k, D) with neg_mask (B, k))."""
    emb = Embeddings(image=x, text=y, image2=x2, neg_text=neg, logit_scale=s, logit_bias=bias)
    b = x.shape[0]
    batch = Batch(images=torch.empty(b, 0), tokens=torch.empty(b, 0, dtype=torch.long), neg_mask=neg_mask)
    return objective(mined=neg is not None, **options)(emb, batch)
