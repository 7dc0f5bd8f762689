"""``Objective``: the loss of a training step as a list of terms, and ``build_objective``,
the one place that reads ``cfg.loss.*`` (and the data keys that feed terms) at run time.

One evaluation (:meth:`Objective.__call__`) builds a :class:`~.base.StepContext` (the
positives derived from the batch once, each feature gathered across ranks at most once),
runs the terms in order and sums their summands, then averages every term's stats over
ranks in ONE packed all_reduce (only when stats are asked for: the training loop asks at
log steps only, so other steps make no stats collective and no host read).  The total is
``sum_t weight_t * loss_t``; the logged ``loss`` is that total, and when a weighted term is
present its parts are logged too (``contrastive_loss``: the unweighted terms' sum, and the
term's own ``stat``).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch

from mmalign.config import Config, ConfigError
from mmalign.config import loss_rules as rules
from mmalign.data.batch import MODEL_INPUTS, Batch
from mmalign.dist import distributed as mdist
from mmalign.models.embeddings import Embeddings

from .base import LossOutput, StepContext, Term, UpdateContext
from .contrastive import Contrastive, PositiveSource
from .distill import Distill, teacher_autocast, teacher_rows, teacher_source
from .extras import ImageImage, MinedNegatives
from .queue import MomentumQueue, QueueNegatives

__all__ = ["Objective", "build_objective"]

# Batch fields that are optional model inputs: fed only when a term reads them
# "seeds" is the image tower's (each row's FLIP mask), whatever the terms read: always fed
_OPTIONAL_INPUTS = tuple(k for k in MODEL_INPUTS if k not in ("images", "tokens", "seeds"))


class Objective:
    """The terms of a step's loss, applied to a batch's :class:`Embeddings`.

    Args:
        terms: in evaluation order (a queue before the contrastive term it feeds, the
            mined negatives after it).
        positives: where the positives come from (:class:`PositiveSource`).
        compute_stats: fill ``LossOutput.stats`` (no_grad; O(B) memory).
        reduce_stats: average the stats over ranks (one small all_reduce).
    """

    def __init__(
        self,
        terms: list[Term],
        positives: PositiveSource | None = None,
        *,
        compute_stats: bool = True,
        reduce_stats: bool = True,
    ):
        if not terms:
            raise ValueError("an objective needs at least one term")
        self.terms = list(terms)
        self.positives = positives or PositiveSource()
        self.compute_stats, self.reduce_stats = compute_stats, reduce_stats

    def __repr__(self) -> str:
        return f"Objective({self.terms!r})"

    # ------------------------------------------------------------ what terms read

    @property
    def embeddings(self) -> set[str]:
        """The Embeddings fields some term reads."""
        return {f for t in self.terms for f in t.embeddings}

    @property
    def batch_fields(self) -> set[str]:
        """The Batch fields some term (or the positives) reads."""
        return {f for t in self.terms for f in t.batch_fields} | set(self.positives.batch_fields)

    def select(self, batch: Batch) -> Batch:
        """``batch`` without the optional model inputs no term reads (e.g. a second view the
        loader made while the image-image term is off): the model encodes only what is used."""
        unused = [k for k in _OPTIONAL_INPUTS if k not in self.batch_fields and getattr(batch, k) is not None]
        return batch.without(*unused) if unused else batch

    def positive_ids(self, batch: Batch) -> torch.Tensor | None:
        return self.positives.ids(batch)

    @property
    def queue(self) -> MomentumQueue | None:
        """The MoCo queue state, if a queue term is present (checkpointed as ``momentum``)."""
        for term in self.terms:
            if isinstance(term, QueueNegatives):
                return term.queue
        return None

    # ------------------------------------------------------------ the loss

    def loss_for(self, batch: Batch, stats: bool | None = None) -> Callable[[Embeddings], LossOutput]:
        """``emb -> LossOutput`` for this batch (what ``Engine.step`` calls); ``stats``: see
        :meth:`__call__`."""
        return lambda emb: self(emb, batch, stats)

    def __call__(self, emb: Embeddings, batch: Batch, stats: bool | None = None) -> LossOutput:
        """The step's loss; with ``stats`` (default ``compute_stats``) also its stats, averaged
        over ranks. The training loop asks for them at log steps only: off, no rank tracks are
        kept and no all_reduce or host read is made (``LossOutput.stats`` is empty)."""
        track = self.compute_stats if stats is None else bool(stats)
        ctx = StepContext(emb, batch, self.positives.ids(batch), self.positives.mask(batch), track)
        main: torch.Tensor | None = None
        weighted: list[tuple[str, float, torch.Tensor]] = []  # (stat, weight, unweighted loss)
        values: dict[str, torch.Tensor] = {}
        for term in self.terms:
            out = term(ctx)
            values.update(out.stats)
            if out.loss is None:
                continue
            if term.stat is None:  # part of the contrastive value
                main = out.loss if main is None else main + out.loss
            else:
                weighted.append((term.stat, term.weight, out.loss))
        if main is None:
            raise ValueError("an objective needs a contrastive term")
        loss = main
        for _, weight, value in weighted:
            loss = loss + weight * value
        return LossOutput(
            loss=loss,
            stats=self._finish_stats(values, main, [(s, w) for s, w, _ in weighted]) if track else {},
        )

    def _finish_stats(
        self, stats: dict[str, torch.Tensor], main: torch.Tensor, weighted: list[tuple[str, float]]
    ) -> dict[str, float]:
        """The stats averaged over ranks; ``weighted``: (stat, weight) of the weighted terms."""
        if not stats:
            return {}
        stats = dict(stats, loss=main.detach())
        names = sorted(stats)
        packed = torch.stack([stats[k].float().reshape(()).to(main.device) for k in names])
        if self.reduce_stats:
            mdist.all_reduce_mean(packed)  # equal rows per rank: mean of means = global mean
        out = dict(zip(names, packed.tolist()))
        if weighted:  # the total from the rank-averaged parts
            out["contrastive_loss"] = out["loss"]
            out["loss"] = out["loss"] + sum(w * out[s] for s, w in weighted)
        return out

    # ------------------------------------------------------------ after the update

    def after_update(
        self,
        params: Callable[[], dict[str, torch.Tensor]],
        buffers: Callable[[], dict[str, torch.Tensor]],
        batch: Batch,
        *,
        chunk: int = 0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        """Let the terms with training state follow an update that was made (not skipped):
        the queue's EMA and enqueue (collectives: every rank calls it)."""
        stateful = [t for t in self.terms if type(t).after_update is not Term.after_update]
        if not stateful:
            return
        ctx = UpdateContext(params, buffers, batch, self.positives.ids(batch), chunk, autocast)
        for term in stateful:
            term.after_update(ctx)


def build_objective(
    cfg: Config, world_size: int = 1, model: torch.nn.Module | None = None, device: torch.device | str = "cpu"
) -> Objective:
    """The run's objective from its config (``loss.*``, ``data.hard_negatives``, ``data.id_field``).

    ``model``: the initial model, copied into the queue's momentum encoder when
    ``loss.queue_size`` > 0 (take it before DeepSpeed partitions or casts the weights).
    Combinations are checked by :func:`mmalign.config.loss_rules.check` (one ConfigError line).
    """
    rules.check(cfg, world_size)
    loss = cfg.loss
    if loss.name == "siglip" and model is not None and getattr(model, "logit_bias", None) is None:
        raise ConfigError(
            f"config key 'model.init_logit_bias' must be set for loss.name=siglip (e.g. -10): "
            f"model.pretrained {cfg.model.pretrained} carries no bias"
        )
    fn_ids = str(loss.false_negative_ids or "none")
    positives = PositiveSource(
        ids="none" if fn_ids == "none" else "caption" if fn_ids == "caption" else "field",
        mask=str(loss.positive_mask or "none"),
    )
    terms: list[Term] = []
    if loss.queue_size > 0:
        if model is None:
            raise ValueError(
                "loss.queue_size > 0: build_objective needs the initial model for the EMA encoder"
            )
        terms.append(
            QueueNegatives(
                MomentumQueue(
                    copy.deepcopy(model),
                    loss.queue_size,
                    loss.momentum,
                    with_ids=fn_ids != "none",
                    device=device,
                )
            )
        )
    terms.append(
        Contrastive(
            loss.name, loss.tile_size, loss.hard_negative_beta, loss.debias_prior, loss.tile_budget_mb
        )
    )
    if cfg.data.hard_negatives > 0:
        terms.append(MinedNegatives())
    if loss.image_image_weight > 0:
        terms.append(
            ImageImage(
                loss.image_image_weight, loss.image_image_temperature, loss.tile_size, loss.tile_budget_mb
            )
        )
    if "distill" in rules.active_parts(cfg):  # the teacher: loaded once, frozen (objective/distill.py)
        assert loss.distill.teacher is not None  # the part's switch
        terms.append(
            Distill(
                teacher_source(
                    loss.distill.teacher,
                    device,
                    teacher_autocast(cfg.train.precision, device),
                    teacher_rows(cfg.train.grad_cache_chunk_size),
                ),
                loss.distill.weight,
            )
        )
    return Objective(terms, positives)
