"""InfoNCE with a momentum queue of extra negatives (MoCo).

He, Fan, Wu, Xie & Girshick 2020, "Momentum Contrast for Unsupervised Visual
Representation Learning" (MoCo, arXiv 1911.05722): negatives need not come
from the current batch. A FIFO queue holds the embeddings of the last Q
samples, produced by a slowly moving (EMA) copy of the encoders so that
entries of different ages stay comparable; the queue enlarges the negative set
without enlarging the batch. Here, cross-modal (as in CLIP pretraining with a
queue): image rows get the queued TEXT embeddings as extra negatives, text
rows the queued IMAGE embeddings. The queue state itself lives in
:mod:`mmalign.objective.queue`; this module is the loss, a pure function.

For image row i (global candidate index ``offset + i``), with in-batch text
candidates y_j (j < N, all ranks' texts), queued texts u_k (k < Q), logits
``l_ij = s x_i . y_j`` and ``q_ik = s x_i . u_k``:

    loss_i = log( sum_j exp(l_ij) + sum_{k not in E(i)} exp(q_ik) )
             - (1/|P(i)|) sum_{j in P(i)} l_ij

P(i) are the in-batch positives exactly as in :mod:`.infonce` (the pair, or
every candidate with the same id). E(i) = {k : queued id_k == id_i} are the
queued entries that share the anchor's id: they are not negatives (the same
caption / class seen in an earlier batch), so they are EXCLUDED from the sum;
they are not made positives either, since a stale EMA embedding would then be
a target. Without ids, E(i) is empty. Text rows are the same with the roles
swapped (queued images v_k); the loss is the mean of both directions, each a
mean over its rows. Queue entries are constants (no gradient): the gradient on
a queued logit is its softmax probability, which only moves the anchor.

The LSE splits into the batch part (the plain path of :mod:`.infonce`,
untiled or tiled) and the queue part, joined by ``logaddexp``; a row whose
every entry is excluded has queue LSE -inf and gets no queue gradient.
Sharded: each rank scores its local rows against the gathered batch and the
(identical on every rank) queue, so the mean over ranks is the global loss, as
in :mod:`mmalign.objective.base`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .infonce import both_directions_lse, infonce_local
from .positives import Positives, positive_logit
from .tiled import fold_scale, scale_of, tile_ranges, tiled_lse

__all__ = ["QueueEntries", "queue_infonce_local", "queue_clip_loss"]

_NEG_INF = float("-inf")


@dataclass(frozen=True)
class QueueEntries:
    """The live entries of a queue: (Q, D) image and text embeddings, (Q,) int64 ids or None."""

    image: Tensor
    text: Tensor
    ids: Tensor | None = None

    @property
    def size(self) -> int:
        return int(self.image.shape[0])


def _queue_lse(
    rows: Tensor,
    queue: Tensor,
    scale: Tensor,
    row_ids: Tensor | None,
    queue_ids: Tensor | None,
    tile_size: int | None,
    pos_max: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """(M,) LSE of ``scale * rows @ queue.T`` over the non-excluded entries (-inf if none),
    and the (3, M) monitor tracks of the queue part when ``pos_max`` (the rows' best
    positive logit) is given: hardest queued negative, -, count above the positive."""
    queue = queue.detach().to(rows.dtype)
    use_ids = row_ids is not None and queue_ids is not None
    if tile_size:
        pos = Positives(0, row_ids, queue_ids) if use_ids else Positives(0)
        lse, _, _, _ = tiled_lse(
            rows,
            queue,
            scale,
            tile_size,
            want_cols=False,
            positives=pos,
            track=False,
            select="neg" if use_ids else "all",
        )
        tracks = (
            None
            if pos_max is None
            else _tiled_tracks(
                rows, queue, scale, row_ids if use_ids else None, queue_ids, tile_size, pos_max
            )
        )
        return lse, tracks
    logits = scale.reshape(()) * rows @ queue.T  # (M, Q)
    if row_ids is None or queue_ids is None:  # not use_ids
        lse = torch.logsumexp(logits, dim=1)
        excl = None
    else:
        excl = row_ids[:, None] == queue_ids[None, :]  # (M, Q) same id: not a negative
        has = (~excl).any(dim=1)  # (M,)
        # A row with every entry excluded: fill 0, not -inf, so logsumexp's backward is not nan.
        filled = logits.masked_fill(excl, _NEG_INF).masked_fill(~has[:, None], 0.0)
        lse = torch.where(
            has, torch.logsumexp(filled, dim=1), torch.full_like(has, _NEG_INF, dtype=logits.dtype)
        )
    tracks = None
    if pos_max is not None:
        with torch.no_grad():
            neg = logits.detach().float()
            if excl is not None:
                neg = neg.masked_fill(excl, _NEG_INF)
            tracks = _tracks_of(neg, pos_max)
    return lse, tracks


@torch.no_grad()
def _tracks_of(neg: Tensor, pos_max: Tensor) -> Tensor:
    """(3, M): per-row max of ``neg`` (excluded = -inf), unused, count of entries above pos_max."""
    return torch.stack(
        [neg.amax(dim=1), torch.full_like(pos_max, _NEG_INF), (neg > pos_max[:, None]).sum(dim=1).float()]
    )


@torch.no_grad()
def _tiled_tracks(
    rows: Tensor,
    queue: Tensor,
    scale: Tensor,
    row_ids: Tensor | None,
    queue_ids: Tensor | None,
    t: int,
    pos_max: Tensor,
) -> Tensor:
    """The queue tracks in t x t tiles (one extra no-grad pass; the tiled LSE keeps none)."""
    out = torch.empty(3, rows.shape[0], device=rows.device)
    s = scale_of(scale, rows.dtype)  # float32 for half rows, as in the tiled LSE
    for i0, i1 in tile_ranges(rows.shape[0], t):
        parts = []
        rows_s = fold_scale(rows[i0:i1], s)
        for j0, j1 in tile_ranges(queue.shape[0], t):
            neg = (rows_s @ queue[j0:j1].T).float()  # (ti, tj)
            if rows_s.dtype != s.dtype:
                neg = neg * s
            if row_ids is not None and queue_ids is not None:
                neg = neg.masked_fill(row_ids[i0:i1, None] == queue_ids[None, j0:j1], _NEG_INF)
            parts.append(_tracks_of(neg, pos_max[i0:i1]))
        part = torch.stack(parts)  # (tiles, 3, ti): max over tiles of the max, sum of the counts
        out[:, i0:i1] = torch.stack([part[:, 0].amax(dim=0), part[0, 1], part[:, 2].sum(dim=0)])
    return out


def _merge_tracks(batch: Tensor, queue: Tensor) -> Tensor:
    """Batch tracks (neg_max, pos_max, n_above) + queue tracks -> tracks over both."""
    return torch.stack([torch.maximum(batch[0], queue[0]), batch[1], batch[2] + queue[2]])


def queue_infonce_local(
    image: Tensor,
    text: Tensor,
    image_all: Tensor,
    text_all: Tensor,
    logit_scale: Tensor,
    queue: QueueEntries,
    *,
    ids: Tensor | None = None,
    ids_all: Tensor | None = None,
    offset: int = 0,
    tile_size: int | None = None,
    track: bool = False,
) -> tuple[Tensor, list[Tensor], list[Tensor]]:
    """InfoNCE of local rows against all in-batch candidates plus the queue.

    image, text: (B, D) local rows; image_all, text_all: (N, D) in-batch
    candidates (local row i at ``offset + i``; pass the local tensors
    themselves in one process); ids (B,) / ids_all (N,) optional, and then
    ``queue.ids`` (Q,) excludes same-id entries. Returns (loss, [tracks_i2t,
    tracks_t2i], [lse_i2t, lse_t2i]) like :func:`.infonce.infonce_local`,
    the tracks and LSEs over batch + queue candidates.
    """
    if queue.image.shape != queue.text.shape or queue.image.shape[1:] != image.shape[1:]:
        raise ValueError(
            f"queue entries must be (Q, {image.shape[1]}), got {tuple(queue.image.shape)} and "
            f"{tuple(queue.text.shape)}"
        )
    if queue.size == 0:  # an empty queue (the first step): the plain loss, bit for bit
        return infonce_local(
            image,
            text,
            image_all,
            text_all,
            logit_scale,
            ids=ids,
            ids_all=ids_all,
            offset=offset,
            tile_size=tile_size,
            track=track,
        )
    qids = queue.ids if ids is not None else None
    if ids is not None and qids is None:
        raise ValueError("positive ids are in use: the queue must hold ids too")
    if qids is not None:
        qids = qids.to(image.device)
    pos = Positives(offset) if ids is None else Positives(offset, ids, ids_all)
    lse_i, lse_t, tr_i, tr_t, pos_t = both_directions_lse(
        image, text, image_all, text_all, logit_scale, pos, tile_size, track
    )
    # image rows get queued texts, text rows queued images
    q_i, qtr_i = _queue_lse(image, queue.text, logit_scale, ids, qids, tile_size, tr_i[1] if track else None)
    q_t, qtr_t = _queue_lse(text, queue.image, logit_scale, ids, qids, tile_size, tr_t[1] if track else None)
    lse_i = torch.logaddexp(lse_i, q_i.to(lse_i.dtype))  # (B,) over batch + queue
    lse_t = torch.logaddexp(lse_t, q_t.to(lse_t.dtype))
    loss_i2t = lse_i - positive_logit(image, text_all, logit_scale, pos)  # (B,)
    loss_t2i = lse_t - positive_logit(text, image_all, logit_scale, pos_t)  # (B,)
    loss = 0.5 * (loss_i2t.mean() + loss_t2i.mean())
    tracks = (  # the queue tracks are there when track
        [_merge_tracks(tr_i, qtr_i), _merge_tracks(tr_t, qtr_t)]
        if qtr_i is not None and qtr_t is not None
        else [tr_i, tr_t]
    )
    return loss, tracks, [lse_i, lse_t]


def queue_clip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    queue: QueueEntries,
    *,
    positive_ids: Tensor | None = None,
    tile_size: int | None = None,
) -> Tensor:
    """One-process symmetric InfoNCE with the queue's entries as extra negatives.

    image_features, text_features: (B, D) L2-normalised; logit_scale: the
    exponentiated scale; queue: live entries (their ids are needed iff
    ``positive_ids`` is given); tile_size as in :func:`.infonce.clip_loss`.
    """
    if image_features.ndim != 2 or image_features.shape != text_features.shape:
        raise ValueError(
            f"expected two (B, D) feature tensors, got {tuple(image_features.shape)} and "
            f"{tuple(text_features.shape)}"
        )
    ids = None if positive_ids is None else positive_ids.to(image_features.device)
    loss, _, _ = queue_infonce_local(
        image_features,
        text_features,
        image_features,
        text_features,
        logit_scale,
        queue,
        ids=ids,
        ids_all=ids,
        tile_size=tile_size,
    )
    return loss
