"""What every term of the objective shares: the ``Term`` interface, the per-step context
(features gathered once, positives derived from the batch once) and ``LossOutput``.

Across W ranks the objective follows open_clip's ``local_loss=True,
gather_with_grad=True`` semantics: features are gathered with
:func:`mmalign.dist.distributed.all_gather_with_grad`, each rank scores its LOCAL rows
against ALL candidates and averages over its local rows.  The per-rank loss is then
``L_r`` with ``mean_r L_r`` = the full-batch loss, and after the data-parallel
average (DeepSpeed divides by W) rank r's feature gradients are exactly the
full-batch gradient rows of its slice, and ``logit_scale`` / ``logit_bias`` get the
full-batch gradient, not W times it (Inf-CL's ring) nor k times it (open_clip's
accum_freq).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

from mmalign.data.batch import Batch
from mmalign.dist import distributed as mdist
from mmalign.models.embeddings import Embeddings

if TYPE_CHECKING:  # the queue's kernel module is loaded by the term that uses it
    from mmalign.losses.queue import QueueEntries

__all__ = ["LossOutput", "Term", "TermOutput", "StepContext"]


@dataclass
class LossOutput:
    loss: Tensor
    stats: dict[str, float] = field(default_factory=dict)


@dataclass
class TermOutput:
    """A term's summand of the loss (with graph; None: it adds no summand of its own, e.g. the
    queue, whose entries join the contrastive softmax) and its stats (0-dim tensors, per rank;
    the objective averages them over ranks in one all_reduce)."""

    loss: Tensor | None = None
    stats: dict[str, Tensor] = field(default_factory=dict)


class Term:
    """One part of the objective.

    ``embeddings``: the :class:`Embeddings` fields it reads; ``batch_fields``: the
    :class:`Batch` fields it reads (the objective feeds the model only the inputs some
    term needs).  ``stat``: the name under which its unweighted loss is logged when it is
    weighted into the total (None: folded into the contrastive value, ``loss`` /
    ``contrastive_loss``); ``weight``: its factor in the total.  Which terms combine is
    :mod:`mmalign.config.loss_rules`.
    """

    name: ClassVar[str] = ""
    embeddings: tuple[str, ...] = ()
    batch_fields: tuple[str, ...] = ()
    stat: str | None = None
    weight: float = 1.0

    def __call__(self, ctx: StepContext) -> TermOutput:
        raise NotImplementedError

    def after_update(self, ctx: UpdateContext) -> None:
        """Called once after each optimiser update that was not skipped (e.g. the queue's EMA)."""


@dataclass
class UpdateContext:
    """What a term may use after an update: the new full weights / buffers (callables: a
    collective under ZeRO-3, called only by terms that need them), this step's batch and ids."""

    params: Callable[[], dict[str, Tensor]]  # () -> {name: full tensor}
    buffers: Callable[[], dict[str, Tensor]]  # () -> {name: tensor}
    batch: Batch
    ids: Tensor | None
    chunk: int = 0
    autocast: Callable[[], AbstractContextManager[Any]] | None = None


class StepContext:
    """One loss evaluation's inputs, shared by the terms: the (leaf) embeddings, the batch,
    the positives, and each feature gathered across ranks at most once."""

    def __init__(self, emb: Embeddings, batch: Batch, ids: Tensor | None, mask: Tensor | None, track: bool):
        self.emb, self.batch, self.track = emb, batch, track
        self.world, self.rank = mdist.get_world_size(), mdist.get_rank()
        assert emb.image is not None  # every objective reads the image features
        device = emb.image.device
        self.ids = None if ids is None else ids.to(device)  # (B,) local positive ids
        self.mask = None if mask is None else mask.to(device)  # (B, B) metadata positives
        self._ids_all: Tensor | None = None
        self._gathered: dict[str, Tensor] = {}
        self.queue: QueueEntries | None = None  # joins the contrastive softmax (set by the queue term)
        self.lse_i2t: Tensor | None = None  # (B,) the contrastive image->text row LSE, with graph

    @property
    def offset(self) -> int:
        """Global candidate index of local row 0 (equal B per rank)."""
        assert self.emb.image is not None  # checked in __init__
        return self.rank * self.emb.image.shape[0]

    def gathered(self, name: str) -> Tensor:
        """(W*B, ...) the Embeddings field ``name`` of every rank, with grad; gathered once."""
        if name not in self._gathered:
            self._gathered[name] = mdist.all_gather_with_grad(getattr(self.emb, name))
        return self._gathered[name]

    @property
    def ids_all(self) -> Tensor | None:
        """(W*B,) every rank's positive ids (no grad); gathered once."""
        if self.ids is not None and self._ids_all is None:
            self._ids_all = mdist.all_gather_nograd(self.ids)
        return self._ids_all
