"""Training monitors computed alongside the loss, under no_grad.

Per row we keep three numbers, updated tile by tile in the tiled path so no
B x B matrix is ever held:

* ``neg_max``: the hardest (highest-scoring) negative's logit,
* ``pos_max``: the best positive's logit,
* ``n_above``: how many negatives score above the best positive.

From those (and the row log-sum-exp for InfoNCE) we report

* ``pos_rank``  = mean of ``1 + n_above`` (1-based rank of the best positive),
* ``top1``      = fraction of rows whose best positive beats every negative,
* ``hardest_neg_prob`` = mean softmax probability of the hardest negative,
  ``exp(neg_max - LSE)`` (InfoNCE; its share of the push-away gradient, since
  the gradient on a negative logit is its probability) or ``sigmoid(neg_max)``
  (SigLIP, where each pair is an independent binary problem).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["RankTracker", "full_matrix_tracks", "infonce_stats", "siglip_stats"]

NEG_INF = float("-inf")


class RankTracker:
    """Running per-row (neg_max, pos_max, n_above) over column tiles.

    If ``pos_max`` is known before the pass (paired mode: the diagonal logit,
    O(B D) to compute) ``n_above`` is counted in the same pass. Otherwise the
    first pass finds ``pos_max`` and :meth:`count` needs a second pass.
    """

    def __init__(self, n: int, device: torch.device, known_pos: Tensor | None = None):
        self.neg_max = torch.full((n,), NEG_INF, device=device)
        self.pos_max = known_pos.detach().float().clone() if known_pos is not None else torch.full((n,), NEG_INF, device=device)
        self.n_above = torch.zeros(n, device=device)
        self.counting = known_pos is not None

    @torch.no_grad()
    def update(self, logits: Tensor, mask: Tensor | None, lo: int, hi: int, tile_max: Tensor | None = None) -> None:
        """Fold in a tile; ``logits`` (hi-lo, t) has this tracker's rows on dim 0.

        ``tile_max`` (the tile's row max, already computed for the LSE) is the
        hardest negative when the tile holds no positive; reuse it.
        """
        if mask is None:
            neg = logits
            neg_tile = tile_max if tile_max is not None else logits.amax(dim=1)
        else:
            neg = logits.masked_fill(mask, NEG_INF)
            neg_tile = neg.amax(dim=1)
            if not self.counting:
                pos_tile = logits.masked_fill(~mask, NEG_INF).amax(dim=1)
                torch.maximum(self.pos_max[lo:hi], pos_tile.float(), out=self.pos_max[lo:hi])
        torch.maximum(self.neg_max[lo:hi], neg_tile.float(), out=self.neg_max[lo:hi])
        if self.counting:
            self.count(neg, lo, hi)

    @torch.no_grad()
    def count(self, neg: Tensor, lo: int, hi: int) -> None:
        """Add the number of negatives in ``neg`` (positives at -inf) above pos_max."""
        self.n_above[lo:hi] += (neg > self.pos_max[lo:hi, None].to(neg.dtype)).sum(dim=1)

    def stacked(self) -> Tensor:
        return torch.stack([self.neg_max, self.pos_max, self.n_above])  # (3, n)


@torch.no_grad()
def full_matrix_tracks(logits: Tensor, mask: Tensor) -> Tensor:
    """(3, M) tracks straight from a full (M, N) logit matrix (untiled path)."""
    logits = logits.detach().float()
    neg = logits.masked_fill(mask, NEG_INF)
    pos_max = logits.masked_fill(~mask, NEG_INF).amax(dim=1)
    n_above = (neg > pos_max[:, None]).sum(dim=1).float()
    return torch.stack([neg.amax(dim=1), pos_max, n_above])


def _rank_stats(tracks: Tensor) -> dict[str, Tensor]:
    neg_max, pos_max, n_above = tracks
    return {
        "pos_rank": (1.0 + n_above).mean(),
        "top1": (pos_max > neg_max).float().mean(),
    }


@torch.no_grad()
def infonce_stats(tracks: list[Tensor], lses: list[Tensor], n_candidates: int, scale: Tensor) -> dict[str, Tensor]:
    """Stats over all rows of all directions (i2t and t2i rows pooled)."""
    tr = torch.cat(tracks, dim=1)  # (3, rows)
    lse = torch.cat([l.detach().float() for l in lses])  # (rows,)
    out = _rank_stats(tr)
    out["hardest_neg_prob"] = torch.exp(tr[0] - lse).mean()
    out["loss_floor"] = torch.tensor(math.log(n_candidates))
    out["n_candidates"] = torch.tensor(float(n_candidates))
    out["logit_scale"] = scale.detach().float().reshape(())
    return out


@torch.no_grad()
def siglip_stats(tracks: Tensor, n_candidates: int, scale: Tensor, bias: Tensor) -> dict[str, Tensor]:
    """Stats over image rows. ``loss_floor`` is the best loss of a model that
    cannot tell candidates apart (all logits equal to one constant c):
    ``min_c -[log s(c) + (N-1) log s(-c)]`` at ``s(c) = 1/N``, i.e.
    ``log N + (N-1) log(N/(N-1))`` (about ``log N + 1`` for large N)."""
    out = _rank_stats(tracks)
    out["hardest_neg_prob"] = torch.sigmoid(tracks[0]).mean()
    n = n_candidates
    floor = math.log(n) + ((n - 1) * math.log(n / (n - 1)) if n > 1 else 0.0)
    out["loss_floor"] = torch.tensor(floor)
    out["n_candidates"] = torch.tensor(float(n))
    out["logit_scale"] = scale.detach().float().reshape(())
    out["logit_bias"] = bias.detach().float().reshape(())
    return out
