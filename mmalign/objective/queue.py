"""The MoCo queue: its state (an EMA copy of the towers and a FIFO queue of their
embeddings) and the objective's term that puts its entries into the InfoNCE softmax.

He, Fan, Wu, Xie & Girshick 2020, "Momentum Contrast for Unsupervised Visual
Representation Learning" (MoCo, arXiv 1911.05722). Two pieces of training
state, used by the loss kernel of :mod:`mmalign.losses.queue`:

* **the momentum encoder**: a copy of the model whose weights follow the
  trained ("online") ones slowly, ``ema = m * ema + (1 - m) * online`` after
  every optimiser step (buffers are copied). Queued embeddings of different
  ages then come from nearly the same encoder, which is what makes them usable
  as negatives (MoCo's ablation: m = 0, a plain copy, fails to train). It runs
  in eval mode and without grad: a BatchNorm tower (ResNet) then normalises with
  its running statistics, which the EMA copies from the online model (train mode
  would normalise each push with that batch's own statistics); dropout / patch
  dropout would add noise to the negatives and draw from the RNG that the run's
  exact resume relies on.
* **the queue**: a ring buffer of the last Q (image, text, id) embeddings of
  the momentum encoder, oldest overwritten first. Entries not yet written are
  never used. Each rank encodes its local batch and enqueues the GATHERED
  global batch (rank order), so every rank holds the same queue, bit for bit,
  and the sharded loss stays the global loss.

The order per step is MoCo's (:class:`QueueNegatives`): the loss sees the queue of
earlier steps only; after the optimiser step the EMA is updated and this step's
batch, encoded by the updated EMA, is enqueued. Both pieces are saved in checkpoints
(:meth:`MomentumQueue.state_dict`), so a resumed run continues exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from mmalign.dist import distributed as mdist
from mmalign.losses.queue import QueueEntries

from .base import StepContext, Term, TermOutput, UpdateContext

__all__ = ["FeatureQueue", "MomentumQueue", "QueueNegatives"]


class FeatureQueue:
    """FIFO ring buffer of (Q, D) image and text embeddings and optional (Q,) int64 ids.

    ``ptr`` is the next slot to write, ``fill`` how many slots hold an entry
    (< Q until the first wrap-around; writes start at slot 0, so until then
    the live entries are slots [0, fill)).
    """

    def __init__(
        self,
        size: int,
        dim: int,
        *,
        with_ids: bool,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ):
        if size <= 0 or dim <= 0:
            raise ValueError(f"queue size and dim must be > 0, got {size}, {dim}")
        self.size, self.dim, self.with_ids = int(size), int(dim), bool(with_ids)
        self.image = torch.zeros(size, dim, dtype=dtype, device=device)  # (Q, D)
        self.text = torch.zeros(size, dim, dtype=dtype, device=device)  # (Q, D)
        self.ids = torch.zeros(size, dtype=torch.int64, device=device) if with_ids else None  # (Q,)
        self.ptr = 0
        self.fill = 0

    @torch.no_grad()
    def enqueue(self, image: Tensor, text: Tensor, ids: Tensor | None = None) -> None:
        """Append n rows in order, overwriting the oldest; with n > Q only the newest Q are kept."""
        if image.ndim != 2 or image.shape != text.shape or image.shape[1] != self.dim:
            raise ValueError(
                f"expected two (n, {self.dim}) tensors, got {tuple(image.shape)} and {tuple(text.shape)}"
            )
        if (ids is not None) != self.with_ids or (ids is not None and ids.shape != image.shape[:1]):
            raise ValueError(f"this queue {'needs' if self.with_ids else 'takes no'} (n,) ids")
        if image.shape[0] > self.size:  # the older rows would be overwritten within this call
            image, text = image[-self.size :], text[-self.size :]
            ids = None if ids is None else ids[-self.size :]
        n = image.shape[0]
        slots = (self.ptr + torch.arange(n, device=self.image.device)) % self.size  # (n,) wraps around
        self.image[slots] = image.detach().to(self.image)
        self.text[slots] = text.detach().to(self.text)
        if ids is not None and self.ids is not None:  # with_ids (checked above)
            self.ids[slots] = ids.to(self.ids)
        self.ptr = (self.ptr + n) % self.size
        self.fill = min(self.fill + n, self.size)

    def entries(self) -> QueueEntries:
        """The live entries as views (storage order, no copy); empty before the first enqueue."""
        n = self.fill  # before the first wrap the live slots are [0, fill); after it, all of them
        return QueueEntries(self.image[:n], self.text[:n], None if self.ids is None else self.ids[:n])

    def ordered(self) -> QueueEntries:
        """The live entries oldest first (copies; for inspection and tests)."""
        if self.fill < self.size:
            live = self.entries()
            return QueueEntries(
                live.image.clone(), live.text.clone(), None if live.ids is None else live.ids.clone()
            )
        order = (self.ptr + torch.arange(self.size, device=self.image.device)) % self.size
        return QueueEntries(
            self.image[order], self.text[order], None if self.ids is None else self.ids[order]
        )

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {
            "size": self.size,
            "dim": self.dim,
            "ptr": self.ptr,
            "fill": self.fill,
            "image": self.image.detach().cpu().clone(),
            "text": self.text.detach().cpu().clone(),
        }
        if self.ids is not None:
            state["ids"] = self.ids.cpu().clone()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if (state["size"], state["dim"], "ids" in state) != (self.size, self.dim, self.with_ids):
            raise ValueError(
                f"queue state of size {state['size']}, dim {state['dim']}, ids {'ids' in state} does "
                f"not fit this queue (size {self.size}, dim {self.dim}, ids {self.with_ids})"
            )
        self.image.copy_(state["image"])
        self.text.copy_(state["text"])
        if self.ids is not None:
            self.ids.copy_(state["ids"])
        self.ptr, self.fill = int(state["ptr"]), int(state["fill"])


class MomentumQueue:
    """An EMA copy of the model plus the :class:`FeatureQueue` of its embeddings.

    Args:
        model: the momentum encoder, a copy of the online model taken before
            training (it is put in eval mode and frozen here); it must return
            ``image_features`` / ``text_features`` from ``model(images, tokens)``.
        size: Q, the number of queued (image, text) pairs.
        momentum: m in [0, 1), the EMA decay.
        with_ids: keep a positive id per entry (runs with false_negative_ids).
    """

    def __init__(
        self,
        model: nn.Module,
        size: int,
        momentum: float,
        *,
        with_ids: bool,
        device: torch.device | str = "cpu",
    ):
        if not 0 <= momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.model = model.to(device).eval().requires_grad_(False)
        self.momentum = float(momentum)
        dim = int(model.embed_dim)  # type: ignore[arg-type]  # nn.Module types attributes as Tensor | Module
        self.queue = FeatureQueue(size, dim, with_ids=with_ids, device=device)

    @torch.no_grad()
    def update(self, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor] | None = None) -> None:
        """``ema = m * ema + (1 - m) * online`` for every parameter; buffers are copied.

        ``params`` maps every parameter name of the model to the online model's
        full weight (e.g. ``Engine.full_params()``); ``buffers`` (optional) maps
        buffer names to values.
        """
        own = dict(self.model.named_parameters())
        if own.keys() != params.keys():
            missing, extra = sorted(own.keys() - params.keys()), sorted(params.keys() - own.keys())
            raise KeyError(
                f"online parameters do not match the momentum encoder: missing {missing[:3]}, "
                f"extra {extra[:3]}"
            )
        m = self.momentum
        for name, ema in own.items():
            ema.mul_(m).add_(params[name].detach().to(ema), alpha=1.0 - m)
        if buffers:
            for name, buf in self.model.named_buffers():
                if name in buffers:
                    buf.copy_(buffers[name])

    @torch.no_grad()
    def encode(
        self,
        images: Tensor,
        tokens: Tensor,
        chunk: int = 0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> tuple[Tensor, Tensor]:
        """(B, D) float32 image and text embeddings of the momentum encoder, ``chunk`` rows per forward."""
        autocast = autocast or contextlib.nullcontext
        step = chunk if chunk > 0 else images.shape[0]
        image_parts, text_parts = [], []
        for i in range(0, images.shape[0], step):
            with autocast():
                out = self.model(images[i : i + step], tokens[i : i + step])
            image_parts.append(out.image.float())
            text_parts.append(out.text.float())
        return torch.cat(image_parts), torch.cat(text_parts)

    @torch.no_grad()
    def push(
        self,
        images: Tensor,
        tokens: Tensor,
        ids: Tensor | None = None,
        *,
        chunk: int = 0,
        autocast: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        """Encode this rank's batch, gather every rank's, enqueue the global batch (collective).

        ``ids`` (B,): this rank's positive ids, iff the queue keeps ids."""
        image, text = self.encode(images, tokens, chunk, autocast)  # (B, D) local
        image, text = mdist.all_gather_nograd(image), mdist.all_gather_nograd(text)  # (W*B, D), rank order
        if ids is not None:
            ids = mdist.all_gather_nograd(ids.to(image.device))
        self.queue.enqueue(image, text, ids)

    def entries(self) -> QueueEntries:
        return self.queue.entries()

    @property
    def fill(self) -> int:
        return self.queue.fill

    def state_dict(self) -> dict[str, Any]:
        """Weights-only-loadable state: EMA weights and buffers, queue contents, pointer and fill."""
        return {
            "momentum": self.momentum,
            "queue": self.queue.state_dict(),
            "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.queue.load_state_dict(state["queue"])
        self.model.load_state_dict(state["model"])


class QueueNegatives(Term):
    """The queue's live entries as extra InfoNCE negatives of both directions (same-id
    entries excluded); after each update: EMA <- the new weights, then this step's batch,
    as the updated EMA encodes it, is enqueued (a collective: every rank enqueues the
    gathered global batch).  It adds no summand of its own: the contrastive term scores
    the entries (:func:`mmalign.losses.queue.queue_infonce_local`)."""

    name = "queue"
    embeddings = ("image", "text")
    batch_fields = ("images", "tokens")

    def __init__(self, queue: MomentumQueue):
        self.queue = queue

    def __call__(self, ctx: StepContext) -> TermOutput:
        entries = self.queue.entries()  # earlier steps' entries only
        ctx.queue = entries if entries.size else None  # empty (first step): the plain loss, bit for bit
        return TermOutput()

    def after_update(self, ctx: UpdateContext) -> None:
        self.queue.update(ctx.params(), ctx.buffers())
        self.queue.push(ctx.batch.images, ctx.batch.tokens, ctx.ids, chunk=ctx.chunk, autocast=ctx.autocast)
