"""Symmetric InfoNCE (CLIP) with optional false-negative-aware targets.

CLIP (Radford et al. 2021, arXiv 2103.00020) averages the image->text and
text->image cross-entropies over the logits ``l = scale * X @ Y.T``.

**Multi-positive targets** (SupCon, Khosla et al. 2020, arXiv 2004.11362;
UniCL, Yang et al. 2022, arXiv 2204.03610). Given ``positive_ids``, every
pair with equal ids is a positive, P(i) = {j : id_j == id_i}, and the target
of row i is uniform over P(i) (soft-target cross-entropy):

    l_i = LSE_j(l_ij) - (1/|P(i)|) * sum_{j in P(i)} l_ij

whose gradient on a logit is ``p_ij - 1[j in P(i)] / |P(i)|`` (p = softmax of
the row). With all ids distinct P(i) = {i} and this is plain InfoNCE, bit for
bit. The positive term is linear in the logits, so it is computed from group
means of the candidates (:func:`.positives.positive_logit`); only the LSE
needs the full row, which the tiled path (Inf-CL) streams.

**Hard-negative weighting / debiasing** (Robinson et al. 2021; Chuang et
al. 2020): ``hard_negative_beta`` > 0 or ``debias_prior`` > 0 switch the
negatives' term to the estimator of :mod:`.hardneg` (formulas there); with
both 0 the code path below is the plain one, unchanged.

**Sharded** (open_clip ``local_loss`` + ``gather_with_grad``): a rank scores
its B local rows against all W*B gathered candidates in each direction and
averages over its local rows, so the mean over ranks is the global loss.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .hardneg import hardneg_local
from .positives import Positives, positive_logit
from .tiled import tiled_lse
from .tracks import full_matrix_tracks

__all__ = ["clip_loss", "infonce_local"]


def _row_lse(
    rows: Tensor,
    cols: Tensor,
    scale: Tensor,
    tile_size: int | None,
    *,
    want_cols: bool,
    positives: Positives,
    track: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Row (and optionally column) LSEs of ``scale * rows @ cols.T`` + tracks."""
    if tile_size:
        return tiled_lse(rows, cols, scale, tile_size, want_cols=want_cols, positives=positives, track=track)
    logits = scale.reshape(()) * rows @ cols.T  # (M, N), the whole matrix
    lse_r = torch.logsumexp(logits, dim=1)
    lse_c = torch.logsumexp(logits, dim=0) if want_cols else logits.new_empty(0)
    tr_r = tr_c = logits.new_empty(0)
    if track:
        mask = positives.full_mask(logits.shape[0], logits.shape[1], logits.device)
        tr_r = full_matrix_tracks(logits, mask)
        if want_cols:
            tr_c = full_matrix_tracks(logits.T, mask.T)
    return lse_r, lse_c, tr_r, tr_c


def both_directions_lse(
    image: Tensor,
    text: Tensor,
    image_all: Tensor,
    text_all: Tensor,
    scale: Tensor,
    pos: Positives,
    tile_size: int | None,
    track: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Positives]:
    """Row LSEs of local image rows over all texts and local text rows over all images.

    Returns (lse_i (B,), lse_t (B,), track_i, track_t, positives of the text rows). One
    process (``*_all`` are the local tensors): a single pass gives both directions as the
    row and column LSEs of one B x B matrix; sharded, each direction is its own pass.
    """
    if image_all is image and text_all is text:
        lse_i, lse_t, tr_i, tr_t = _row_lse(
            image, text, scale, tile_size, want_cols=True, positives=pos, track=track
        )
        return lse_i, lse_t, tr_i, tr_t, pos.transposed()
    lse_i, _, tr_i, _ = _row_lse(
        image, text_all, scale, tile_size, want_cols=False, positives=pos, track=track
    )
    lse_t, _, tr_t, _ = _row_lse(
        text, image_all, scale, tile_size, want_cols=False, positives=pos, track=track
    )
    return lse_i, lse_t, tr_i, tr_t, pos  # local text rows vs all images: same ids, same offset


def infonce_local(
    image: Tensor,
    text: Tensor,
    image_all: Tensor,
    text_all: Tensor,
    logit_scale: Tensor,
    *,
    ids: Tensor | None = None,
    ids_all: Tensor | None = None,
    offset: int = 0,
    tile_size: int | None = None,
    track: bool = False,
    hard_negative_beta: float = 0.0,
    debias_prior: float = 0.0,
    pair_mask: Tensor | None = None,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """InfoNCE of local rows against all candidates.

    image, text: (B, D) local rows; image_all, text_all: (N, D) candidates, in
    which local row i sits at ``offset + i``; ids (B,) / ids_all (N,) optional.
    Pass the same tensors as local and all for the single-process (square)
    case, where each tile serves both directions.

    Returns (loss, [tracks_i2t, tracks_t2i], [lse_i2t, lse_t2i]). With
    ``hard_negative_beta`` / ``debias_prior`` set the loss is the estimator of
    :mod:`.hardneg`; tracks and LSEs (monitors only) are then those of the
    plain logits, computed without grad.
    """
    if pair_mask is not None:  # metadata positives: (B, N) image i vs text j (single process)
        pos = Positives(offset, pair_mask=pair_mask)
    else:
        pos = Positives(offset) if ids is None else Positives(offset, ids, ids_all)
    if hard_negative_beta or debias_prior:
        loss = hardneg_local(
            image,
            text,
            image_all,
            text_all,
            logit_scale,
            pos,
            tile_size=tile_size,
            beta=float(hard_negative_beta),
            prior=float(debias_prior),
        )
        if not track:
            return loss, [], []
        with torch.no_grad():
            _, tracks, lses = infonce_local(
                image,
                text,
                image_all,
                text_all,
                logit_scale,
                ids=ids,
                ids_all=ids_all,
                offset=offset,
                tile_size=tile_size,
                track=True,
                pair_mask=pair_mask,
            )
        return loss, tracks, lses
    lse_i, lse_t, tr_i, tr_t, pos_t = both_directions_lse(
        image, text, image_all, text_all, logit_scale, pos, tile_size, track
    )
    loss_i2t = lse_i - positive_logit(image, text_all, logit_scale, pos)  # (B,)
    loss_t2i = lse_t - positive_logit(text, image_all, logit_scale, pos_t)  # (B,)
    loss = 0.5 * (loss_i2t.mean() + loss_t2i.mean())
    return loss, [tr_i, tr_t], [lse_i, lse_t]


def _check(
    image: Tensor, text: Tensor, positive_ids: Tensor | None, positive_mask: Tensor | None = None
) -> None:
    if image.ndim != 2 or image.shape != text.shape:
        raise ValueError(
            f"expected two (B, D) feature tensors, got {tuple(image.shape)} and {tuple(text.shape)}"
        )
    if positive_mask is not None:
        b = image.shape[0]
        if positive_ids is not None:
            raise ValueError("pass positive_ids or positive_mask, not both")
        if positive_mask.shape != (b, b) or positive_mask.dtype != torch.bool:
            raise ValueError(f"positive_mask must be a ({b}, {b}) bool tensor")
        if not bool(positive_mask.diagonal().all()):
            raise ValueError("positive_mask must hold every pair (i, i): a caption describes its own image")
    if positive_ids is not None and positive_ids.shape != (image.shape[0],):
        raise ValueError(f"positive_ids must be ({image.shape[0]},), got {tuple(positive_ids.shape)}")


def clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    *,
    positive_ids: Tensor | None = None,
    tile_size: int | None = None,
    hard_negative_beta: float = 0.0,
    debias_prior: float = 0.0,
    positive_mask: Tensor | None = None,
) -> Tensor:
    """Symmetric InfoNCE: mean of image->text and text->image cross-entropy.

    Args:
        image_features, text_features: (B, D), L2-normalised.
        logit_scale: the multiplicative scale ``1/tau``, already exponentiated
            (shape [] or [1]; may require grad).
        positive_ids: optional (B,) int ids; pairs with equal ids are all
            positives and row i's loss is
            ``LSE_j(l_ij) - (1/|P(i)|) sum_{j in P(i)} l_ij`` (SupCon / UniCL
            soft targets; gradient ``p_ij - 1[j in P(i)]/|P(i)|``).
        tile_size: if set, stream t x t tiles (Inf-CL, arXiv 2410.17243):
            O(B D + t^2) extra memory, same values and gradients.
        hard_negative_beta: beta >= 0 of Robinson et al. 2021, negatives
            weighted by ``exp(beta l_ij)`` (normalised to mean 1 per row).
        debias_prior: tau+ in [0, 1) of Chuang et al. 2020; the negatives' sum
            becomes ``max((R - tau+ M e+) / (1 - tau+), M e^{-scale})``.
            Exact formulas: :mod:`mmalign.losses.hardneg`.
        positive_mask: optional (B, B) bool, ``[i, j]`` = image i and text j
            are a positive pair (metadata positives, e.g.
            :func:`mmalign.losses.metadata.subset_mask`); the diagonal must be
            True. Row i's targets are uniform over its positives, and the
            text->image direction uses the transpose.
    """
    _check(image_features, text_features, positive_ids, positive_mask)
    ids = None if positive_ids is None else positive_ids.to(image_features.device)
    loss, _, _ = infonce_local(
        image_features,
        text_features,
        image_features,
        text_features,
        logit_scale,
        ids=ids,
        ids_all=ids,
        tile_size=tile_size,
        hard_negative_beta=hard_negative_beta,
        debias_prior=debias_prior,
        pair_mask=None if positive_mask is None else positive_mask.to(image_features.device),
    )
    return loss
