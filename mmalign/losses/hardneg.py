"""Hard-negative weighting and debiasing for the cross-modal InfoNCE.

Two estimators of the negatives' term of InfoNCE, as options of the loss:

* **Debiased contrastive loss** (Chuang et al. 2020, "Debiased Contrastive
  Learning", arXiv 2007.00224): in-batch "negatives" are drawn from the data
  distribution, so a fraction tau+ (the class prior) of them are in fact
  positives. The negatives' sum is corrected by subtracting tau+ times the
  positives' expected contribution and renormalised by 1 / (1 - tau+).
* **Hard-negative weighting** (Robinson et al. 2021, "Contrastive Learning
  with Hard Negative Samples", arXiv 2010.04592): negatives are importance-
  weighted by ``exp(beta * l_ij)``, so the harder (more similar) ones count
  more; beta = 0 is uniform.

What we implement, for one direction (image rows i -> text candidates j; the
text -> image direction is the same with the roles swapped, and the loss is
the mean of both directions, each a mean over its rows). Logits are
``l_ij = s x_i . y_j`` with ``s = 1/tau`` the logit scale; P(i) is the set of
positives of row i (its pair, or every candidate with the same id), N(i) the
rest, ``M_i = |N(i)|``:

    w_ij   = exp(beta l_ij) / ((1/M_i) sum_{k in N(i)} exp(beta l_ik))   (mean weight 1)
    R_i    = sum_{j in N(i)} w_ij exp(l_ij)
           = M_i exp(LSE_{N(i)}((1+beta) l) - LSE_{N(i)}(beta l))
    e+_i   = (1/|P(i)|) sum_{p in P(i)} exp(l_ip)                       (mean positive term)
    Ng_i   = max( (R_i - tau+ M_i e+_i) / (1 - tau+),  M_i exp(-s) )
    loss_i = log( sum_{p in P(i)} exp(l_ip) + Ng_i ) - (1/|P(i)|) sum_{p in P(i)} l_ip

The clamp ``M_i exp(-s)`` is the paper's ``N e^{-1/t}``: exp(-s) is the
smallest value exp(l) can take for unit vectors (cosine >= -1), so Ng never
goes below what M maximally dissimilar negatives would give, and never goes
negative. Without debiasing (tau+ = 0) the clamp never binds (the weights
average 1 and every exp(l) >= exp(-s)), so it is applied only when tau+ > 0.
With beta = 0 and tau+ = 0 the loss is the multi-positive InfoNCE of
:mod:`.infonce` exactly (Ng = the negatives' sum). Gradients flow through
the weights w (as in Robinson et al.'s reference code, which does not
detach them). In paired mode (|P(i)| = 1) this is exactly the papers'
``-log(e^{pos} / (e^{pos} + Ng))``.

Every term is an LSE over a masked set of logits, so the tiled path
(:func:`.tiled.tiled_lse` with ``select``) streams it without the M x N
matrix and the sharded path reuses the local-rows-vs-all-candidates layout.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .positives import Positives, positive_logit
from .tiled import tiled_lse

__all__ = ["masked_lse", "positive_counts", "estimator_loss", "hardneg_local"]

_NEG_INF = float("-inf")


def masked_lse(
    rows: Tensor,
    cols: Tensor,
    scale: Tensor,
    pos: Positives,
    select: str,
    tile_size: int | None,
    want_cols: bool,
) -> tuple[Tensor, Tensor]:
    """Row (M,) and optional column (N,) LSEs of ``scale * rows @ cols.T`` over
    the negatives (``select="neg"``) or positives (``"pos"``) only; -inf for
    an empty set (with zero gradient)."""
    if tile_size:
        lse_r, lse_c, _, _ = tiled_lse(
            rows, cols, scale, tile_size, want_cols=want_cols, positives=pos, track=False, select=select
        )
        return lse_r, lse_c
    logits = scale.reshape(()) * rows @ cols.T  # (M, N), untiled
    mask = pos.full_mask(logits.shape[0], logits.shape[1], logits.device)  # (M, N) positives
    excl = mask if select == "neg" else ~mask

    def one(lg: Tensor, ex: Tensor) -> Tensor:  # LSE along dim 1
        has = (~ex).any(dim=1)  # (rows,)
        # Fully excluded rows: fill 0 instead of -inf so logsumexp's backward is not nan.
        filled = lg.masked_fill(ex, _NEG_INF).masked_fill(~has[:, None], 0.0)
        return torch.where(
            has, torch.logsumexp(filled, dim=1), torch.full_like(has, _NEG_INF, dtype=lg.dtype)
        )

    lse_r = one(logits, excl)
    lse_c = one(logits.T, excl.T) if want_cols else logits.new_empty(0)
    return lse_r, lse_c


def positive_counts(pos: Positives, m: int, n: int, device: torch.device) -> Tensor:
    """(M,) float |P(i)| of each row, without an M x N matrix."""
    if pos.paired:
        return torch.ones(m, dtype=torch.float64, device=device)
    if pos.pair_mask is not None:
        return pos.pair_mask.sum(dim=1).to(device=device, dtype=torch.float64)
    assert pos.row_ids is not None and pos.col_ids is not None  # not paired, no mask
    uniq, inv = torch.unique(pos.col_ids, return_inverse=True)
    counts = torch.bincount(inv, minlength=uniq.shape[0])  # (G,)
    group = torch.searchsorted(uniq, pos.row_ids).clamp(max=uniq.shape[0] - 1)  # (M,)
    found = uniq[group] == pos.row_ids
    return torch.where(found, counts[group], 0).to(torch.float64)


def estimator_loss(
    lse_pos: Tensor,
    mean_pos: Tensor,
    lse_a: Tensor,
    lse_b: Tensor | None,
    n_pos: Tensor,
    n_neg: Tensor,
    scale: Tensor,
    beta: float,
    prior: float,
) -> Tensor:
    """(M,) per-row loss of the module docstring from its LSE ingredients.

    lse_pos: LSE_{P(i)} l; mean_pos: mean_{P(i)} l; lse_a: LSE_{N(i)} (1+beta) l;
    lse_b: LSE_{N(i)} beta l (None when beta = 0: it is then log M_i);
    n_pos, n_neg: (M,) float64 counts.
    """
    dt = lse_a.dtype
    has = n_neg > 0  # rows whose candidates are all positives have no negative term
    log_m = torch.log(n_neg).to(dt)  # -inf where M_i = 0
    a = torch.where(has, lse_a, torch.zeros_like(lse_a))  # safe: no -inf arithmetic in the graph
    if lse_b is None:
        log_r = a  # LSE_N(0 * l) = log M_i
    else:
        log_r = (
            log_m.where(has, torch.zeros_like(log_m)) + a - torch.where(has, lse_b, torch.zeros_like(lse_b))
        )
    log_r = torch.where(has, log_r, torch.full_like(log_r, _NEG_INF))
    if prior > 0:
        log_epos = lse_pos - torch.log(n_pos).to(dt)  # log e+_i
        log_c = math.log(prior) + log_m + log_epos  # log(tau+ M_i e+_i)
        ok = has & (log_c < log_r)  # the corrected sum is positive
        diff = torch.where(ok, log_c - log_r, torch.full_like(log_r, -1.0))
        corrected = torch.where(ok, log_r, torch.zeros_like(log_r)) + torch.log1p(-torch.exp(diff))
        corrected = torch.where(ok, corrected, torch.full_like(log_r, _NEG_INF)) - math.log1p(-prior)
        floor = log_m - scale.reshape(()).to(dt)  # log(M_i e^{-s}); -inf where M_i = 0
        log_ng = torch.maximum(corrected, floor)
    else:
        log_ng = log_r
    return torch.logaddexp(lse_pos, log_ng) - mean_pos


def _direction(
    rows: Tensor,
    cols: Tensor,
    scale: Tensor,
    pos: Positives,
    tile_size: int | None,
    beta: float,
    prior: float,
) -> Tensor:
    """(M,) per-row loss of ``rows`` against candidates ``cols`` (one direction)."""
    m, n = rows.shape[0], cols.shape[0]
    n_pos = positive_counts(pos, m, n, rows.device)
    n_neg = n - n_pos
    mean_pos = positive_logit(rows, cols, scale, pos)  # (M,)
    if pos.paired:
        lse_pos = mean_pos  # one positive: its LSE is its logit
    else:
        lse_pos, _ = masked_lse(rows, cols, scale, pos, "pos", tile_size, want_cols=False)
    lse_a, _ = masked_lse(rows, cols, scale * (1.0 + beta), pos, "neg", tile_size, want_cols=False)
    lse_b = masked_lse(rows, cols, scale * beta, pos, "neg", tile_size, want_cols=False)[0] if beta else None
    return estimator_loss(lse_pos, mean_pos, lse_a, lse_b, n_pos, n_neg, scale, beta, prior)


def hardneg_local(
    image: Tensor,
    text: Tensor,
    image_all: Tensor,
    text_all: Tensor,
    logit_scale: Tensor,
    pos: Positives,
    *,
    tile_size: int | None,
    beta: float,
    prior: float,
) -> Tensor:
    """Symmetric hard-negative / debiased InfoNCE of local rows (B, D) against
    all candidates (N, D); ``pos`` locates row i's positives among them. The
    mean over ranks of the returned loss is the global loss (as in
    :func:`.infonce.infonce_local`).

    The two directions are scored separately (each (B, N) block is walked
    per direction and per LSE): simplicity over the shared-tile trick of the
    plain path, which matters less here since these options cost 1-3 LSE
    passes anyway.
    """
    if beta < 0:
        raise ValueError(f"hard_negative_beta must be >= 0, got {beta}")
    if not 0 <= prior < 1:
        raise ValueError(f"debias_prior must be in [0, 1), got {prior}")
    square = image_all is image and text_all is text
    pos_t = pos.transposed() if square else pos  # square: text rows vs image columns, offset 0
    loss_i2t = _direction(image, text_all, logit_scale, pos, tile_size, beta, prior)  # (B,)
    loss_t2i = _direction(text, image_all, logit_scale, pos_t, tile_size, beta, prior)  # (B,)
    return 0.5 * (loss_i2t.mean() + loss_t2i.mean())
