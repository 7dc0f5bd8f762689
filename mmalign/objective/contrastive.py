"""The contrastive term: InfoNCE or SigLIP between images and captions, with its positive
structure (the pair, id groups, or a metadata mask) and, for InfoNCE, the hard-negative
estimators.  The maths are the kernels of :mod:`mmalign.losses`; this module picks the
kernel, feeds it the gathered features, and turns its rank tracks into stats.

Stats (0-dim tensors per rank; the objective averages them over ranks): ``pos_rank``,
``top1``, ``hardest_neg_prob`` (see :mod:`mmalign.losses.tracks`), ``loss_floor`` (the
loss of a model that cannot tell candidates apart), ``n_candidates``, ``logit_scale``
(+ ``logit_bias`` for SigLIP).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mmalign.data.batch import Batch
from mmalign.losses.infonce import infonce_local
from mmalign.losses.metadata import subset_mask
from mmalign.losses.positives import caption_ids
from mmalign.losses.queue import queue_infonce_local
from mmalign.losses.siglip import siglip_local
from mmalign.losses.tile_choice import AUTO, DEFAULT_BUDGET_MB, resolve_tile

from .base import StepContext, Term, TermOutput

__all__ = ["Contrastive", "PositiveSource", "LOSS_NAMES", "infonce_stats", "siglip_stats"]

LOSS_NAMES = ("infonce", "siglip")


class PositiveSource:
    """Where a step's positives come from (``loss.false_negative_ids`` / ``loss.positive_mask``).

    ``ids``: "none" (the pair only), "caption" (equal normalised captions,
    :func:`~mmalign.losses.positives.caption_ids`) or "field" (the batch's ``ids``, read
    from ``data.id_field``); ``mask``: "none" or "attribute_subset" (the (B, B) mask of
    :func:`~mmalign.losses.metadata.subset_mask`, decoded from the batch's ``ids``).
    """

    def __init__(self, ids: str = "none", mask: str = "none"):
        if ids not in ("none", "caption", "field") or mask not in ("none", "attribute_subset"):
            raise ValueError(f"unknown positives ids={ids!r} mask={mask!r}")
        self.ids_mode, self.mask_mode = ids, mask

    @property
    def batch_fields(self) -> tuple[str, ...]:
        return (
            ("captions",) if self.ids_mode == "caption" else ("ids",) if self.ids_mode == "field" else ()
        ) + (("ids",) if self.mask_mode != "none" else ())

    def ids(self, batch: Batch) -> Tensor | None:
        """(B,) int64 positive ids, or None."""
        if self.ids_mode == "caption":
            assert batch.captions is not None  # a batch_fields entry: the loader keeps them
            return caption_ids(batch.captions)
        if self.ids_mode == "field":
            if batch.ids is None:
                raise ValueError("positive ids from data.id_field, but the batch has no ids")
            return batch.ids
        return None

    def mask(self, batch: Batch) -> Tensor | None:
        """(B, B) bool metadata positives (image i vs caption j), or None."""
        if self.mask_mode == "none":
            return None
        assert batch.ids is not None  # a batch_fields entry: the loader reads data.id_field
        return subset_mask(batch.ids)  # ids are subset codes


class Contrastive(Term):
    """InfoNCE (CLIP) or SigLIP over the (possibly sharded) global batch.

    Args:
        name: "infonce" | "siglip".
        tile_size: 0 / None for the full-matrix path, an integer for the tile edge t (Inf-CL),
            "auto" to choose per call from the shapes and ``tile_budget_mb``
            (:mod:`mmalign.losses.tile_choice`).
        tile_budget_mb: the memory budget of ``tile_size="auto"``.
        hard_negative_beta, debias_prior: InfoNCE only; the estimators of
            :mod:`mmalign.losses.hardneg` (Robinson et al. 2021; Chuang et al. 2020).

    The positives come from the step context (ids or mask, see :class:`PositiveSource`);
    a queue term's entries (``ctx.queue``) join the InfoNCE candidates of both directions.
    It leaves the image->text row LSE in ``ctx.lse_i2t`` for the mined-negatives term.
    """

    name = "contrastive"

    def __init__(
        self,
        name: str = "infonce",
        tile_size: int | str | None = 0,
        hard_negative_beta: float = 0.0,
        debias_prior: float = 0.0,
        tile_budget_mb: float = DEFAULT_BUDGET_MB,
    ):
        if name not in LOSS_NAMES:
            raise ValueError(f"unknown loss {name!r}; expected one of {LOSS_NAMES}")
        if tile_size != AUTO and tile_size is not None and (isinstance(tile_size, str) or tile_size < 0):
            raise ValueError(f"tile_size must be >= 0 or {AUTO!r}, got {tile_size!r}")
        if hard_negative_beta < 0 or not 0 <= debias_prior < 1:
            raise ValueError(
                f"need hard_negative_beta >= 0 and 0 <= debias_prior < 1, got "
                f"{hard_negative_beta}, {debias_prior}"
            )
        self.kind, self.tile_size, self.tile_budget_mb = name, tile_size or None, float(tile_budget_mb)
        self.hard_negative_beta, self.debias_prior = float(hard_negative_beta), float(debias_prior)
        self.embeddings = ("image", "text", "logit_scale") + (("logit_bias",) if name == "siglip" else ())

    def __repr__(self) -> str:
        return (
            f"Contrastive({self.kind}, tile_size={self.tile_size!r}, hard_negative_beta={self.hard_negative_beta}, "
            f"debias_prior={self.debias_prior})"
        )

    def __call__(self, ctx: StepContext) -> TermOutput:
        emb = ctx.emb
        image, text, scale = emb.image, emb.text, emb.logit_scale
        assert image is not None and text is not None and scale is not None  # self.embeddings
        if image.ndim != 2 or image.shape != text.shape:
            raise ValueError("expected two (B, D) feature tensors of the same shape")
        if ctx.mask is not None:
            if (
                self.kind != "infonce" or ctx.world > 1
            ):  # the kernels cannot honour it (config/loss_rules.py refuses the config)
                raise ValueError("positive_mask is supported for infonce in one process only")
            b = image.shape[0]
            if ctx.mask.shape != (b, b) or not bool(ctx.mask.diagonal().all()):
                raise ValueError(f"positive_mask must be ({b}, {b}) with a True diagonal")
        ids = None if ctx.mask is not None else ctx.ids  # a mask overrides ids
        ids_all = ctx.ids_all if ids is not None else None
        if self.kind == "siglip":
            if ctx.queue is not None:
                raise ValueError("queue entries are negatives of the infonce loss, not siglip")
            if emb.logit_bias is None:
                raise ValueError("siglip needs logit_bias")
            text_all = ctx.gathered("text")  # images stay local
            tile = self.tile_for("siglip", image, text_all.shape[0])
            loss, tracks_i = siglip_local(
                image,
                text_all,
                scale,
                emb.logit_bias,
                ids=ids,
                ids_all=ids_all,
                offset=ctx.offset,
                tile_size=tile,
                track=ctx.track,
            )
            stats = siglip_stats(tracks_i, text_all.shape[0], scale, emb.logit_bias) if ctx.track else {}
            return TermOutput(loss, stats)
        image_all, text_all = ctx.gathered("image"), ctx.gathered("text")  # (W*B, D)
        queue = ctx.queue
        if queue is not None and (self.hard_negative_beta or self.debias_prior or ctx.mask is not None):
            raise ValueError("queue entries need the plain infonce (no estimator, no positive_mask)")
        if queue is not None:  # in-batch candidates + queued negatives
            tile = self.tile_for("queue", image, text_all.shape[0] + queue.size)
            loss, tracks, lses = queue_infonce_local(
                image,
                text,
                image_all,
                text_all,
                scale,
                queue,
                ids=ids,
                ids_all=ids_all,
                offset=ctx.offset,
                tile_size=tile,
                track=ctx.track,
            )
        else:
            kernel = (
                "hardneg"
                if self.hard_negative_beta or self.debias_prior
                else "infonce_sharded"
                if ctx.world > 1
                else "infonce"
            )
            tile = self.tile_for(kernel, image, text_all.shape[0])
            loss, tracks, lses = infonce_local(
                image,
                text,
                image_all,
                text_all,
                scale,
                ids=ids,
                ids_all=ids_all,
                offset=ctx.offset,
                tile_size=tile,
                track=ctx.track,
                hard_negative_beta=self.hard_negative_beta,
                debias_prior=self.debias_prior,
                pair_mask=ctx.mask,
            )
        # the estimators' LSEs (if any) are monitors without grad: only the plain row LSE can be extended
        plain = not (self.hard_negative_beta or self.debias_prior)
        ctx.lse_i2t = lses[0] if lses and plain else None
        n_cand = text_all.shape[0] + (queue.size if queue is not None else 0)
        stats = infonce_stats(tracks, lses, n_cand, scale) if ctx.track else {}
        return TermOutput(loss, stats)

    def tile_for(self, kernel: str, rows: Tensor, n_cols: int) -> int | None:
        """The tile edge of this call (None: untiled); ``auto`` decides from the shapes, equal on
        every rank."""
        return resolve_tile(self.tile_size, kernel, rows.shape[0], n_cols, rows.dtype, self.tile_budget_mb)


def _rank_stats(tracks: Tensor) -> dict[str, Tensor]:
    neg_max, pos_max, n_above = tracks
    return {
        "pos_rank": (1.0 + n_above).mean(),
        "top1": (pos_max > neg_max).float().mean(),
    }


@torch.no_grad()
def infonce_stats(
    tracks: list[Tensor], lses: list[Tensor], n_candidates: int, scale: Tensor
) -> dict[str, Tensor]:
    """Stats over all rows of all directions (i2t and t2i rows pooled)."""
    tr = torch.cat(tracks, dim=1)  # (3, rows)
    lse = torch.cat([x.detach().float() for x in lses])  # (rows,)
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
