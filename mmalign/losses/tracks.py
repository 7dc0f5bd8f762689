"""Per-row rank tracks computed alongside the loss kernels, under no_grad.

Per row we keep three numbers, updated tile by tile in the tiled path so no
B x B matrix is ever held:

* ``neg_max``: the hardest (highest-scoring) negative's logit,
* ``pos_max``: the best positive's logit,
* ``n_above``: how many negatives score above the best positive.

From those (and the row log-sum-exp for InfoNCE) the contrastive term of the
objective (:mod:`mmalign.objective.contrastive`) reports

* ``pos_rank``  = mean of ``1 + n_above`` (1-based rank of the best positive),
* ``top1``      = fraction of rows whose best positive beats every negative,
* ``hardest_neg_prob`` = mean softmax probability of the hardest negative,
  ``exp(neg_max - LSE)`` (InfoNCE; its share of the push-away gradient, since
  the gradient on a negative logit is its probability) or ``sigmoid(neg_max)``
  (SigLIP, where each pair is an independent binary problem).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RankTracker", "track_tile", "full_matrix_tracks"]

NEG_INF = float("-inf")


class RankTracker:
    """Running per-row (neg_max, pos_max, n_above) over column tiles.

    If ``pos_max`` is known before the pass (paired mode: the diagonal logit,
    O(B D) to compute) ``n_above`` is counted in the same pass. Otherwise the
    first pass finds ``pos_max`` and :meth:`count` needs a second pass.
    """

    def __init__(self, n: int, device: torch.device, known_pos: Tensor | None = None):
        self.neg_max = torch.full((n,), NEG_INF, device=device)
        self.pos_max = (
            known_pos.detach().float().clone()
            if known_pos is not None
            else torch.full((n,), NEG_INF, device=device)
        )
        self.n_above = torch.zeros(n, device=device)
        self.counting = known_pos is not None

    @torch.no_grad()
    def fold(self, lo: int, hi: int, neg_max: Tensor, pos_max: Tensor | None = None) -> None:
        """Merge a tile's per-row hardest negative (and best positive)."""
        torch.maximum(self.neg_max[lo:hi], neg_max.float(), out=self.neg_max[lo:hi])
        if pos_max is not None and not self.counting:
            torch.maximum(self.pos_max[lo:hi], pos_max.float(), out=self.pos_max[lo:hi])

    @torch.no_grad()
    def count(self, neg: Tensor, lo: int, hi: int) -> None:
        """Add the number of negatives in ``neg`` (positives at -inf) above pos_max."""
        # sub -> gt_ -> sum stays in floating point: summing a bool tensor
        # takes a slow int64 path on CPU (~6x slower at t = 2048).
        above = torch.sub(neg, self.pos_max[lo:hi, None].to(neg.dtype)).gt_(0)
        self.n_above[lo:hi] += above.sum(dim=1, dtype=self.n_above.dtype)

    def stacked(self) -> Tensor:
        return torch.stack([self.neg_max, self.pos_max, self.n_above])  # (3, n)


@torch.no_grad()
def track_tile(
    tile: Tensor,
    mask: Tensor | None,
    rows: RankTracker,
    i0: int,
    i1: int,
    row_max: Tensor,
    cols: RankTracker | None = None,
    j0: int = 0,
    j1: int = 0,
    col_max: Tensor | None = None,
) -> None:
    """Fold one (ti, tj) logit tile into the row (and column) trackers.

    ``row_max`` / ``col_max`` are the tile maxima already computed for the
    LSE: with no positive in the tile they are the hardest negatives. With
    positives, one masked copy serves both directions.
    """
    if mask is None:
        neg, row_pos, col_pos = tile, None, None
        row_neg, col_neg = row_max, col_max
    else:
        neg = tile.masked_fill(mask, NEG_INF)
        row_neg, col_neg = neg.amax(dim=1), (neg.amax(dim=0) if cols is not None else None)
        row_pos = col_pos = None
        if not rows.counting or (cols is not None and not cols.counting):
            pos = tile.masked_fill(~mask, NEG_INF)
            row_pos, col_pos = pos.amax(dim=1), (pos.amax(dim=0) if cols is not None else None)
    rows.fold(i0, i1, row_neg, row_pos)
    if rows.counting:
        rows.count(neg, i0, i1)
    if cols is not None:
        cols.fold(j0, j1, col_neg if col_neg is not None else neg.amax(dim=0), col_pos)
        if cols.counting:
            cols.count(neg.T, j0, j1)


@torch.no_grad()
def full_matrix_tracks(logits: Tensor, mask: Tensor) -> Tensor:
    """(3, M) tracks straight from a full (M, N) logit matrix (untiled path)."""
    logits = logits.detach().float()
    neg = logits.masked_fill(mask, NEG_INF)
    pos_max = logits.masked_fill(~mask, NEG_INF).amax(dim=1)
    n_above = (neg > pos_max[:, None]).sum(dim=1).float()
    return torch.stack([neg.amax(dim=1), pos_max, n_above])
