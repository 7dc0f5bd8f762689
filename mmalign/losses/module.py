"""``ContrastiveLoss``: the config-built loss module used by the trainer.

Across W ranks it follows open_clip's ``local_loss=True, gather_with_grad=True``
semantics: each rank gathers all features with
:func:`mmalign.distributed.all_gather_with_grad`, scores its LOCAL rows
against ALL candidates and averages over its local rows. The per-rank loss
is then ``L_r`` with ``mean_r L_r`` = the full-batch loss, and after the
data-parallel average (DDP / DeepSpeed divide by W):

* rank r's feature gradients are exactly the full-batch gradient rows of its
  slice (the gather's backward sums every rank's contribution);
* ``logit_scale`` / ``logit_bias`` get ``mean_r dL_r/dscale`` = the
  full-batch gradient, not W times it (Inf-CL's ring) nor k times it
  (open_clip's accum_freq).

With a momentum queue (``queue=``, :mod:`.queue`, MoCo) the candidates are the
gathered batch plus the queue's entries, which are identical on every rank
(each rank enqueues the gathered batch), so the same argument holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from mmalign import distributed as mdist

from .infonce import infonce_local
from .mined import mined_negatives_term
from .monitors import infonce_stats, siglip_stats
from .queue import QueueEntries, queue_infonce_local
from .siglip import siglip_local

__all__ = ["LossOutput", "ContrastiveLoss", "build_loss", "LOSS_NAMES"]

LOSS_NAMES = ("infonce", "siglip")


@dataclass
class LossOutput:
    loss: Tensor
    stats: dict[str, float] = field(default_factory=dict)


class ContrastiveLoss(nn.Module):
    """InfoNCE or SigLIP over the (possibly sharded) global batch.

    Args:
        name: "infonce" | "siglip".
        tile_size: 0 / None for the full-matrix path, else the tile edge t.
        use_positive_ids: if True, ``forward`` requires ``positive_ids`` and
            treats equal ids as positives; if False they are ignored.
        compute_stats: fill ``LossOutput.stats`` (no_grad, O(B) memory; in
            tiled id mode it costs one extra matmul pass over the tiles).
        reduce_stats: average the stats over ranks (one small all_reduce).
        hard_negative_beta, debias_prior: InfoNCE only; the estimators of
            :mod:`.hardneg` (Robinson et al. 2021; Chuang et al. 2020).
    """

    def __init__(self, name: str = "infonce", tile_size: int | None = 0, use_positive_ids: bool = False,
                 compute_stats: bool = True, reduce_stats: bool = True, hard_negative_beta: float = 0.0,
                 debias_prior: float = 0.0):
        super().__init__()
        if name not in LOSS_NAMES:
            raise ValueError(f"unknown loss {name!r}; expected one of {LOSS_NAMES}")
        if (hard_negative_beta or debias_prior) and name != "infonce":
            raise ValueError("hard_negative_beta / debias_prior are options of the infonce loss")
        if hard_negative_beta < 0 or not 0 <= debias_prior < 1:
            raise ValueError(f"need hard_negative_beta >= 0 and 0 <= debias_prior < 1, got "
                             f"{hard_negative_beta}, {debias_prior}")
        self.hard_negative_beta = float(hard_negative_beta)
        self.debias_prior = float(debias_prior)
        if tile_size is not None and tile_size < 0:
            raise ValueError(f"tile_size must be >= 0, got {tile_size}")
        self.name = name
        self.tile_size = tile_size or None
        self.use_positive_ids = use_positive_ids
        self.compute_stats = compute_stats
        self.reduce_stats = reduce_stats

    def extra_repr(self) -> str:
        return (f"name={self.name}, tile_size={self.tile_size}, use_positive_ids={self.use_positive_ids}, "
                f"hard_negative_beta={self.hard_negative_beta}, debias_prior={self.debias_prior}")

    def forward(self, image_features: Tensor, text_features: Tensor, logit_scale: Tensor,
                logit_bias: Tensor | None = None, positive_ids: Tensor | None = None,
                positive_mask: Tensor | None = None, queue: QueueEntries | None = None,
                neg_text_features: Tensor | None = None, neg_mask: Tensor | None = None) -> LossOutput:
        """Loss of this rank's rows against all ranks' candidates.

        Args:
            image_features, text_features: (B, D) local, L2-normalised; every
                rank must have the same B.
            logit_scale: exponentiated scale ([] or [1]); logit_bias: SigLIP bias.
            positive_ids: (B,) local ids (gathered here, without grad).
            positive_mask: (B, B) bool metadata positives, image i vs text j
                (InfoNCE, one process only; overrides ids).
            queue: momentum-queue entries (InfoNCE without estimator or
                mask): extra negatives for both directions, same-id entries
                excluded (:mod:`.queue`); None or empty = the plain loss.
            neg_text_features, neg_mask: (B, k, D) mined negative captions of
                each local image and their (B, k) validity; extra image->text
                candidates of that row only (plain InfoNCE; :mod:`.mined`).

        Returns:
            LossOutput with ``loss`` (mean over local rows) and ``stats``:
            loss, loss_floor, pos_rank, top1, hardest_neg_prob, n_candidates,
            logit_scale (+ logit_bias for SigLIP); averaged over ranks when
            ``reduce_stats``.
        """
        if image_features.ndim != 2 or image_features.shape != text_features.shape:
            raise ValueError("expected two (B, D) feature tensors of the same shape")
        ids = None
        if self.use_positive_ids:
            if positive_ids is None:
                raise ValueError("this loss was built with false_negative_ids; pass positive_ids")
            ids = positive_ids.to(image_features.device)
        world, rank = mdist.get_world_size(), mdist.get_rank()
        if positive_mask is not None:
            if self.name != "infonce" or world > 1:
                raise ValueError("positive_mask is supported for infonce in one process only")
            b = image_features.shape[0]
            if positive_mask.shape != (b, b) or not bool(positive_mask.diagonal().all()):
                raise ValueError(f"positive_mask must be ({b}, {b}) with a True diagonal")
            ids = None
        if queue is not None and queue.size:
            if self.name != "infonce" or self.hard_negative_beta or self.debias_prior or positive_mask is not None:
                raise ValueError("a momentum queue needs the plain infonce loss (no beta, prior or positive_mask)")
            if ids is not None and queue.ids is None:
                raise ValueError("this loss uses positive ids: the queue must hold ids too")
        else:
            queue = None
        b = image_features.shape[0]
        offset = rank * b  # local row i is global candidate offset + i (equal B per rank)
        ids_all = mdist.all_gather_nograd(ids) if ids is not None else None
        track = self.compute_stats

        if self.name == "infonce":
            if world > 1:
                image_all = mdist.all_gather_with_grad(image_features)  # (W*B, D)
                text_all = mdist.all_gather_with_grad(text_features)
            else:
                image_all, text_all = image_features, text_features
            if queue is not None:  # in-batch candidates + queued negatives
                loss, tracks, lses = queue_infonce_local(image_features, text_features, image_all, text_all,
                                                         logit_scale, queue, ids=ids, ids_all=ids_all, offset=offset,
                                                         tile_size=self.tile_size, track=track)
            else:
                loss, tracks, lses = infonce_local(image_features, text_features, image_all, text_all, logit_scale,
                                                   ids=ids, ids_all=ids_all, offset=offset,
                                                   tile_size=self.tile_size, track=track,
                                                   hard_negative_beta=self.hard_negative_beta,
                                                   debias_prior=self.debias_prior,
                                                   pair_mask=None if positive_mask is None
                                                   else positive_mask.to(image_features.device))
            n_cand = text_all.shape[0] + (queue.size if queue is not None else 0)
            stats = infonce_stats(tracks, lses, n_cand, logit_scale) if track else {}
            if neg_text_features is not None:
                if self.hard_negative_beta or self.debias_prior:
                    raise ValueError("mined negatives need the plain infonce (no hard_negative_beta / debias_prior)")
                if queue is not None:
                    raise ValueError("mined negatives and a momentum queue are not combined")
                mined, mined_stats = mined_negatives_term(image_features, neg_text_features, neg_mask,
                                                          logit_scale, lses[0])
                loss = loss + mined
                stats.update(mined_stats if track else {})
        else:
            if neg_text_features is not None:
                raise ValueError("mined negatives are supported for infonce only")
            if logit_bias is None:
                raise ValueError("siglip needs logit_bias")
            text_all = mdist.all_gather_with_grad(text_features)  # images stay local
            loss, tracks = siglip_local(image_features, text_all, logit_scale, logit_bias,
                                        ids=ids, ids_all=ids_all, offset=offset,
                                        tile_size=self.tile_size, track=track)
            stats = siglip_stats(tracks, text_all.shape[0], logit_scale, logit_bias) if track else {}
        return LossOutput(loss=loss, stats=self._finish_stats(stats, loss))

    def _finish_stats(self, stats: dict[str, Tensor], loss: Tensor) -> dict[str, float]:
        if not stats:
            return {}
        stats = dict(stats, loss=loss.detach())
        names = sorted(stats)
        packed = torch.stack([stats[k].float().reshape(()).to(loss.device) for k in names])
        if self.reduce_stats:
            mdist.all_reduce_mean(packed)  # equal rows per rank: mean of means = global mean
        return dict(zip(names, packed.tolist()))


def build_loss(cfg: Any) -> ContrastiveLoss:
    """Build from any object with ``name``, ``tile_size`` (0 = untiled) and
    ``false_negative_ids`` ("none" | "caption" | a json id field name; the
    caller maps captions / fields to ids and passes ``positive_ids``)."""
    fn_ids = str(getattr(cfg, "false_negative_ids", "none") or "none")
    return ContrastiveLoss(
        name=str(cfg.name),
        tile_size=int(getattr(cfg, "tile_size", 0) or 0),
        use_positive_ids=fn_ids.lower() != "none",
        hard_negative_beta=float(getattr(cfg, "hard_negative_beta", 0.0) or 0.0),
        debias_prior=float(getattr(cfg, "debias_prior", 0.0) or 0.0),
    )
