"""Tiled (memory-bounded) log-sum-exp of a scaled similarity matrix.

Inf-CL (Cheng et al., "Breaking the Memory Barrier: Near Infinite Batch Size
Scaling for Contrastive Loss", arXiv 2410.17243) observes that InfoNCE only
needs, per row, the log-sum-exp of its logits; the positive term is linear.
So the M x N logit matrix ``scale * rows @ cols.T`` never has to exist:

* **forward** walks t x t tiles and keeps a running (max, sum-exp) pair per
  row and per column (the online softmax of Milakov & Gimelshein 2018). Each
  tile is computed once and updates both directions. The running max is the
  tile-wise row / column max, never a constant shift, so no row underflows
  however spread the logits are.
* **backward** recomputes each tile. With ``g_r`` / ``g_c`` the incoming
  gradients on the row / column LSEs, the gradient on a logit is
  ``G_ij = g_r[i] exp(l_ij - LSE_r[i]) + g_c[j] exp(l_ij - LSE_c[j])``, and
  ``d rows = scale G cols``, ``d cols = scale G^T rows``,
  ``d scale = sum_i rows_i . (G cols)_i``.

**Masked LSE** (``select``): the hard-negative / debiased estimators of
:mod:`.hardneg` need LSEs over the negatives only ("neg") or the positives
only ("pos"). Excluded logits are set to -inf in the forward and in the
recomputed backward tile, so they get exactly zero gradient; a row with
nothing selected has LSE -inf (its shift is sanitised to 0 in the backward,
where its incoming gradient must then be 0).

Extra memory: O((M + N) D + t^2). The monitors of :mod:`.monitors` ride on
the forward pass (one more pass over tiles only in id mode, see RankTracker).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .positives import Positives
from .tracks import RankTracker, track_tile

__all__ = [
    "tiled_lse",
    "tile_ranges",
    "compute_dtype",
    "count_pass",
    "Workspace",
    "tile_logits",
    "add_mm",
    "scale_of",
    "fold_scale",
    "scaled_tile",
]


def tile_ranges(n: int, t: int) -> list[tuple[int, int]]:
    return [(s, min(s + t, n)) for s in range(0, n, t)]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    # Accumulate half-precision inputs in float32; keep float32 / float64.
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def scale_of(scale: Tensor, dtype: torch.dtype) -> Tensor:
    """The scalar scale at the compute precision of ``dtype`` features: never rounded to half
    precision (bf16 has 8 significant bits: 1/0.07 = 14.2857 would become 14.3125, biasing
    every logit by +0.2%)."""
    return scale.reshape(()).to(compute_dtype(dtype))


def fold_scale(rows: Tensor, s: Tensor) -> Tensor:
    """A row block to multiply tiles with: ``rows * s`` when the rows are at compute precision
    (folding saves a pass per tile), else the rows unscaled (see :func:`scaled_tile`)."""
    return rows * s if rows.dtype == s.dtype else rows


def scaled_tile(rows_s: Tensor, cols: Tensor, s: Tensor, out: Tensor) -> Tensor:
    """The logit tile ``s * rows @ cols.T`` (compute dtype) from a :func:`fold_scale` block;
    half rows are scaled here, in the compute dtype."""
    tile = tile_logits(rows_s, cols, out)
    return tile if rows_s.dtype == s.dtype else tile.mul_(s)


def _merge_lse(
    run_max: Tensor,
    run_sum: Tensor,
    tile: Tensor,
    tile_max: Tensor,
    buf: Tensor,
    dim: int,
    masked: bool = False,
) -> None:
    """Online LSE update reducing ``dim`` of ``tile``: (run_max, run_sum) <- merged.

    ``sum exp(l - M_new) = run_sum * exp(M_old - M_new) + sum_tile exp(l - M_new)``.
    """
    new_max = torch.maximum(run_max, tile_max)
    if masked:
        # A row with nothing selected so far keeps max -inf: shift by 0, not -inf (-inf - -inf = nan).
        shift = torch.where(new_max == float("-inf"), torch.zeros_like(new_max), new_max)
    else:
        shift = new_max
    run_sum.mul_(torch.exp(run_max - shift))  # exp(-inf) = 0 on the first tile
    torch.sub(tile, shift.unsqueeze(dim), out=buf)
    buf.exp_()
    run_sum.add_(buf.sum(dim=dim))
    run_max.copy_(new_max)


class Workspace:
    """Reusable t x t tile buffers, allocated once per call rather than per
    tile: repeated large malloc/free inflates CPU RSS and costs page faults."""

    def __init__(self, t: int, dtype: torch.dtype, device: torch.device, n: int = 2):
        self._bufs = [torch.empty(t * t, dtype=dtype, device=device) for _ in range(n)]

    def get(self, k: int, rows: int, cols: int) -> Tensor:
        return self._bufs[k][: rows * cols].view(rows, cols)


def tile_logits(rows_s: Tensor, cols: Tensor, out: Tensor) -> Tensor:
    """``rows_s @ cols.T`` written into ``out`` (compute dtype)."""
    if rows_s.dtype == out.dtype:
        return torch.mm(rows_s, cols.T, out=out)
    return out.copy_(rows_s @ cols.T)  # half inputs: accumulate in float32


def add_mm(acc: Tensor, a: Tensor, b: Tensor) -> None:
    """``acc += a @ b`` without a temporary when dtypes agree."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    else:
        acc.add_((a @ b).to(acc.dtype))


def _fold_weight(lse: Tensor, g: Tensor) -> tuple[Tensor, Tensor]:
    """``g * exp(l - lse) = sign(g) * exp(l - (lse - log|g|))``: the weight's magnitude folded
    into the shift (saves a pass per tile; the usual g = 1/(2B) has sign 1) and its sign
    returned, for the caller to apply outside the tile where it can. No host read: a zero
    weight gets the shift +inf, so its terms vanish whatever its LSE."""
    shift = torch.where(g == 0, torch.full_like(lse, float("inf")), lse - torch.log(g.abs()))
    return shift, torch.sign(g)


class _TiledLSE(torch.autograd.Function):
    @staticmethod
    # custom_fwd: backward replays the forward's autocast state
    @torch.amp.custom_fwd(device_type="cuda")  # type: ignore[untyped-decorator]  # unannotated in torch
    def forward(
        ctx: Any,  # torch's FunctionCtx, carrying our own attributes
        rows: Tensor,
        cols: Tensor,
        scale: Tensor,
        t: int,
        want_cols: bool,
        pos: Positives,
        track: bool,
        select: str = "all",
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        m, n = rows.shape[0], cols.shape[0]
        dev, cdt = rows.device, compute_dtype(rows.dtype)
        masked = select != "all"
        s = scale_of(scale, rows.dtype)  # float32 for half features
        r_max = torch.full((m,), float("-inf"), dtype=cdt, device=dev)
        r_sum = torch.zeros(m, dtype=cdt, device=dev)
        c_max = torch.full((n,), float("-inf"), dtype=cdt, device=dev)
        c_sum = torch.zeros(n, dtype=cdt, device=dev)

        known_r = known_c = None
        if track and pos.paired:
            # Paired rows know their positive logit up front: count in this pass.
            known_r = torch.linalg.vecdot(rows, cols[pos.offset : pos.offset + m]).to(cdt) * s
            known_c = known_r if want_cols else None
        trk_r = RankTracker(m, dev, known_r) if track else None
        trk_c = RankTracker(n, dev, known_c) if track and want_cols else None

        ws = Workspace(min(t, max(m, n)), cdt, dev)
        for i0, i1 in tile_ranges(m, t):
            rows_s = fold_scale(rows[i0:i1], s)  # (ti, D): scale folded into one row block at a time
            for j0, j1 in tile_ranges(n, t):
                if masked and _select_tile(pos, select, i0, i1, j0, j1, dev) is _SKIP:
                    continue  # "pos" and the tile holds no positive
                tile = scaled_tile(rows_s, cols[j0:j1], s, ws.get(0, i1 - i0, j1 - j0))  # (ti, tj)
                if masked:
                    _apply_select(tile, pos, select, i0, i1, j0, j1)
                buf = ws.get(1, i1 - i0, j1 - j0)
                t_rmax = tile.amax(dim=1)
                _merge_lse(r_max[i0:i1], r_sum[i0:i1], tile, t_rmax, buf, dim=1, masked=masked)
                if want_cols:
                    t_cmax = tile.amax(dim=0)
                    _merge_lse(c_max[j0:j1], c_sum[j0:j1], tile, t_cmax, buf, dim=0, masked=masked)
                if trk_r is not None:  # track
                    track_tile(
                        tile,
                        pos.mask(i0, i1, j0, j1, dev),
                        trk_r,
                        i0,
                        i1,
                        t_rmax,
                        trk_c,
                        j0,
                        j1,
                        t_cmax if want_cols else None,
                    )

        if trk_r is not None and not pos.paired:  # track
            # Id mode: the best positive is only known now; count in a 2nd pass.
            count_pass(rows, s, cols, pos, t, trk_r, trk_c, ws)

        lse_r = r_max + torch.log(r_sum)  # (M,)
        lse_c = c_max + torch.log(c_sum) if want_cols else torch.empty(0, dtype=cdt, device=dev)
        tr_r = trk_r.stacked() if trk_r is not None else torch.empty(0, device=dev)
        tr_c = trk_c.stacked() if trk_c is not None else torch.empty(0, device=dev)
        ctx.save_for_backward(rows, cols, scale, lse_r, lse_c)
        ctx.t, ctx.want_cols, ctx.pos, ctx.select = t, want_cols, pos, select
        ctx.mark_non_differentiable(tr_r, tr_c)
        return lse_r, lse_c, tr_r, tr_c

    @staticmethod
    @torch.amp.custom_bwd(device_type="cuda")  # type: ignore[untyped-decorator]  # unannotated in torch
    def backward(
        ctx: Any, g_r: Tensor | None, g_c: Tensor | None, _gtr: Tensor | None, _gtc: Tensor | None
    ) -> tuple[Tensor | None, ...]:
        rows, cols, scale, lse_r, lse_c = ctx.saved_tensors
        t, want_cols = ctx.t, ctx.want_cols
        dt, cdt = rows.dtype, lse_r.dtype
        s = scale_of(scale, dt)
        if g_r is None:
            g_r = torch.zeros_like(lse_r)
        shift_r, sign_r = _fold_weight(lse_r, g_r)
        shift_c: Tensor | None = None  # column weights: set when a gradient reaches the column LSEs
        sign_c: Tensor | None = None
        if want_cols and g_c is not None:
            shift_c, sign_c = _fold_weight(lse_c, g_c)
        use_c = shift_c is not None
        pos, select = ctx.pos, ctx.select
        masked = select != "all"
        if masked:  # rows with nothing selected: LSE -inf, gradient 0; avoid -inf - -inf
            shift_r = torch.where(shift_r == float("-inf"), torch.zeros_like(shift_r), shift_r)
            if shift_c is not None:  # use_c
                shift_c = torch.where(shift_c == float("-inf"), torch.zeros_like(shift_c), shift_c)
        d_rows = torch.empty_like(rows)
        d_cols = torch.zeros(cols.shape, dtype=cdt, device=cols.device)
        d_scale = torch.zeros((), dtype=cdt, device=rows.device)
        ws = Workspace(min(t, max(rows.shape[0], cols.shape[0])), cdt, rows.device)
        for i0, i1 in tile_ranges(rows.shape[0], t):
            acc = torch.zeros((i1 - i0, rows.shape[1]), dtype=cdt, device=rows.device)  # sum_j G_ij y_j
            rows_s = fold_scale(rows[i0:i1], s)  # (ti, D)
            # rows only: the row signs act on the (ti, D) operands, not on each (ti, tj) tile
            rows_w = rows[i0:i1] if use_c else rows[i0:i1] * sign_r[i0:i1, None].to(dt)  # (ti, D)
            for j0, j1 in tile_ranges(cols.shape[0], t):
                # only paired positives tell an empty tile without a host read; an empty "pos"
                # tile of ids is all -inf, its gradient 0
                if masked and pos.paired and _select_tile(pos, select, i0, i1, j0, j1, rows.device) is _SKIP:
                    continue
                tile = scaled_tile(rows_s, cols[j0:j1], s, ws.get(0, i1 - i0, j1 - j0))  # recomputed
                if masked:
                    _apply_select(tile, pos, select, i0, i1, j0, j1, skip_empty=False)
                grad = torch.sub(tile, shift_r[i0:i1, None], out=ws.get(1, i1 - i0, j1 - j0))
                grad.exp_()  # |g_r[i]| * softmax_row
                if shift_c is not None and sign_c is not None:  # use_c
                    # sign_c[j] |g_c[j]| softmax_col + sign_r[i] |g_r[i]| softmax_row
                    tile.sub_(shift_c[None, j0:j1]).exp_().mul_(sign_c[None, j0:j1])
                    grad = tile.addcmul_(grad, sign_r[i0:i1, None])
                grad = grad.to(dt)
                add_mm(acc, grad, cols[j0:j1])  # (ti, D)
                add_mm(d_cols[j0:j1], grad.T, rows_w)  # (tj, D)
            if not use_c:
                acc.mul_(sign_r[i0:i1, None])
            d_rows[i0:i1] = (acc * s).to(dt)
            d_scale += (rows[i0:i1].to(cdt) * acc).sum()
        d_cols = d_cols.mul_(s).to(dt)
        return d_rows, d_cols, d_scale.reshape(scale.shape).to(scale.dtype), None, None, None, None, None


_SKIP = object()


def _select_tile(
    pos: Positives, select: str, i0: int, i1: int, j0: int, j1: int, device: torch.device
) -> object:
    """``_SKIP`` when a "pos" selection leaves the tile empty, else None."""
    if select == "pos" and pos.mask(i0, i1, j0, j1, device) is None:
        return _SKIP
    return None


def _apply_select(
    tile: Tensor, pos: Positives, select: str, i0: int, i1: int, j0: int, j1: int, skip_empty: bool = True
) -> None:
    """Set the logits that ``select`` excludes to -inf, in place (``skip_empty``: see
    :meth:`Positives.mask`)."""
    mask = pos.mask(i0, i1, j0, j1, tile.device, skip_empty=skip_empty)  # (ti, tj) positives or None
    if select == "neg":
        if mask is not None:
            tile.masked_fill_(mask, float("-inf"))
    elif select == "pos":
        assert mask is not None  # callers skip a tile without positives first (_select_tile)
        tile.masked_fill_(~mask, float("-inf"))
    else:
        raise ValueError(f"select must be 'all', 'neg' or 'pos', got {select!r}")


@torch.no_grad()
def count_pass(
    rows: Tensor,
    s: Tensor,
    cols: Tensor,
    pos: Positives,
    t: int,
    trk_r: RankTracker,
    trk_c: RankTracker | None,
    ws: Workspace,
    bias: Tensor | None = None,
) -> None:
    """Second no_grad pass (id mode): count negatives above the best positive."""
    for i0, i1 in tile_ranges(rows.shape[0], t):
        rows_s = fold_scale(rows[i0:i1], s)
        for j0, j1 in tile_ranges(cols.shape[0], t):
            tile = scaled_tile(rows_s, cols[j0:j1], s, ws.get(0, i1 - i0, j1 - j0))
            if bias is not None:
                tile.add_(bias)
            mask = pos.mask(i0, i1, j0, j1, tile.device)
            if mask is not None:
                tile.masked_fill_(mask, float("-inf"))
            trk_r.count(tile, i0, i1)
            if trk_c is not None:
                trk_c.count(tile.T, j0, j1)


def tiled_lse(
    rows: Tensor,
    cols: Tensor,
    scale: Tensor,
    tile_size: int,
    *,
    want_cols: bool,
    positives: Positives,
    track: bool,
    select: str = "all",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row LSEs (M,) of ``scale * rows @ cols.T`` and, if ``want_cols``, column
    LSEs (N,); plus (3, M) / (3, N) monitor tracks when ``track``.

    Differentiable in rows, cols and scale through a custom backward that
    recomputes tiles. ``select`` = "neg" / "pos" restricts every LSE to the
    negatives / positives of ``positives`` (no tracks then).
    """
    if tile_size <= 0:
        raise ValueError(f"tile_size must be positive, got {tile_size}")
    if select not in ("all", "neg", "pos"):
        raise ValueError(f"select must be 'all', 'neg' or 'pos', got {select!r}")
    if select != "all" and track:
        raise ValueError("monitor tracks are only computed for select='all'")
    out: tuple[Tensor, Tensor, Tensor, Tensor] = _TiledLSE.apply(
        rows, cols, scale, int(tile_size), bool(want_cols), positives, bool(track), select
    )
    return out
