"""Tiled SigLIP pair loss with recomputation in backward.

SigLIP (Zhai et al., "Sigmoid Loss for Language Image Pre-Training", 2023,
arXiv 2303.15343) scores every (image, text) pair as an independent binary
problem: ``-log sigmoid(z_ij * l_ij)`` with ``l_ij = scale x_i . y_j + bias``
and ``z_ij = +1`` for positives, -1 otherwise. The loss is a plain sum over
pairs, so tiling needs no running normaliser, only per-row sums:

* forward: ``row_loss_i += sum_j softplus(l_ij) - sum_{j in P(i)} l_ij``
  (``-log sigmoid(-l) = softplus(l)``, ``-log sigmoid(l) = softplus(l) - l``);
* backward: recompute the tile; the gradient on a logit is
  ``g_i (sigmoid(l_ij) - 1[j in P(i)])``, then as for InfoNCE plus
  ``d bias = sum_ij G_ij``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .positives import Positives
from .tiled import (
    Workspace,
    add_mm,
    compute_dtype,
    count_pass,
    fold_scale,
    scale_of,
    scaled_tile,
    tile_ranges,
)
from .tracks import RankTracker, track_tile

__all__ = ["tiled_sigmoid_rows"]


class _TiledSigmoid(torch.autograd.Function):
    @staticmethod
    # custom_fwd: backward replays the forward's autocast state
    @torch.amp.custom_fwd(device_type="cuda")  # type: ignore[untyped-decorator]  # unannotated in torch
    def forward(
        ctx: Any,  # torch's FunctionCtx, carrying our own attributes
        rows: Tensor,
        cols: Tensor,
        scale: Tensor,
        bias: Tensor,
        t: int,
        pos: Positives,
        track: bool,
    ) -> tuple[Tensor, Tensor]:
        m, dev, dt = rows.shape[0], rows.device, rows.dtype
        cdt = compute_dtype(dt)
        s = scale_of(scale, dt)  # float32 for half features, like the bias
        b = bias.reshape(()).to(cdt)
        row_loss = torch.zeros(m, dtype=cdt, device=dev)  # (M,)
        known = None
        if track and pos.paired:
            known = torch.linalg.vecdot(rows, cols[pos.offset : pos.offset + m]).to(cdt) * s + b
        trk = RankTracker(m, dev, known) if track else None
        ws = Workspace(min(t, max(m, cols.shape[0])), cdt, dev, n=1)
        for i0, i1 in tile_ranges(m, t):
            rows_s = fold_scale(rows[i0:i1], s)  # (ti, D): scale folded into one row block at a time
            for j0, j1 in tile_ranges(cols.shape[0], t):
                tile = scaled_tile(rows_s, cols[j0:j1], s, ws.get(0, i1 - i0, j1 - j0)).add_(b)  # (ti, tj)
                mask = pos.mask(i0, i1, j0, j1, dev)
                row_loss[i0:i1] -= F.logsigmoid(-tile).sum(dim=1)  # softplus(l), exact for large l
                if mask is not None:
                    row_loss[i0:i1] -= (tile * mask).sum(dim=1)
                if trk is not None:  # track
                    track_tile(tile, mask, trk, i0, i1, tile.amax(dim=1))
        if trk is not None and not pos.paired:  # track
            count_pass(rows, s, cols, pos, t, trk, None, ws, bias=b)
        tracks = trk.stacked() if trk is not None else torch.empty(0, device=dev)
        ctx.save_for_backward(rows, cols, scale, bias)
        ctx.t, ctx.pos = t, pos
        ctx.mark_non_differentiable(tracks)
        return row_loss, tracks

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")  # type: ignore[untyped-decorator]  # unannotated in torch
    def backward(ctx: Any, g: Tensor, _gtracks: Tensor | None) -> tuple[Tensor | None, ...]:
        rows, cols, scale, bias = ctx.saved_tensors
        t, pos = ctx.t, ctx.pos
        dt = rows.dtype
        cdt = compute_dtype(dt)
        s = scale_of(scale, dt)
        b = bias.reshape(()).to(cdt)
        d_rows = torch.empty_like(rows)
        d_cols = torch.zeros(cols.shape, dtype=cdt, device=cols.device)
        d_scale = torch.zeros((), dtype=cdt, device=rows.device)
        d_bias = torch.zeros((), dtype=cdt, device=rows.device)
        ws = Workspace(min(t, max(rows.shape[0], cols.shape[0])), cdt, rows.device, n=1)
        for i0, i1 in tile_ranges(rows.shape[0], t):
            acc = torch.zeros((i1 - i0, rows.shape[1]), dtype=cdt, device=rows.device)  # sum_j G_ij y_j
            rows_s = fold_scale(rows[i0:i1], s)  # (ti, D)
            for j0, j1 in tile_ranges(cols.shape[0], t):
                grad = scaled_tile(rows_s, cols[j0:j1], s, ws.get(0, i1 - i0, j1 - j0))
                grad.add_(b).sigmoid_()  # (ti, tj)
                mask = pos.mask(i0, i1, j0, j1, rows.device, skip_empty=False)  # no host read
                if mask is not None:
                    grad.sub_(mask.to(cdt))
                grad.mul_(g[i0:i1, None])
                d_bias += grad.sum()
                grad = grad.to(dt)
                add_mm(acc, grad, cols[j0:j1])  # (ti, D)
                add_mm(d_cols[j0:j1], grad.T, rows[i0:i1])  # (tj, D)
            d_rows[i0:i1] = (acc * s).to(dt)
            d_scale += (rows[i0:i1].to(cdt) * acc).sum()
        d_cols = d_cols.mul_(s).to(dt)
        return (
            d_rows,
            d_cols,
            d_scale.reshape(scale.shape).to(scale.dtype),
            d_bias.reshape(bias.shape).to(bias.dtype),
            None,
            None,
            None,
        )


def tiled_sigmoid_rows(
    rows: Tensor,
    cols: Tensor,
    scale: Tensor,
    bias: Tensor,
    tile_size: int,
    *,
    positives: Positives,
    track: bool,
) -> tuple[Tensor, Tensor]:
    """Per-row SigLIP losses (M,) ``sum_j -log sigmoid(z_ij l_ij)`` and the
    (3, M) monitor tracks; differentiable in rows, cols, scale and bias."""
    if tile_size <= 0:
        raise ValueError(f"tile_size must be positive, got {tile_size}")
    out: tuple[Tensor, Tensor] = _TiledSigmoid.apply(
        rows, cols, scale, bias, int(tile_size), positives, bool(track)
    )
    return out
