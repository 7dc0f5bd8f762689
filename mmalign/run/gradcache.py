"""Exact gradient caching for contrastive steps.

Gao, Zhang, Han & Callan 2021, "Scaling Deep Contrastive Learning Batch Size under
Memory Limited Setup" (GradCache).  The loss couples every sample of the batch,
so the batch cannot simply be split into micro-batches; but the loss only touches
the encoders through their *representations*.  One step is:

1. forward every chunk without grad, recording the RNG state before each one;
2. compute the (possibly sharded) loss on the detached, concatenated
   representations and cache d(loss)/d(representation);
3. re-forward each chunk under its recorded RNG state (same dropout / patch
   dropout masks as in 1) and back-propagate ``sum(rep * cached_grad)``.

By the chain rule the accumulated parameter gradients equal those of the
one-pass loss, with activation memory bounded by one chunk.

The last chunk is the exception: its first forward keeps its graph (one chunk of
activations, the same bound), and it is back-propagated first, straight from that
graph, so a step of n chunks costs n - 1 extra forwards, not n.  With one chunk,
caching costs nothing.

Extra per-sample inputs (a second image view, mined negative captions) ride
along: a chunk is whatever ``encode`` takes (the engine slices its Batch),
and every per-sample output field of the returned
:class:`~mmalign.models.embeddings.Embeddings` ((b, D) features of either view,
(b, k, D) negative-caption features, or a field a subclass adds) is
concatenated, cached and back-propagated like the two main ones: the fields'
metadata, not a list here, says which outputs are per-sample.

The temperature (``logit_scale``) and SigLIP bias are also representations here:
the model returns them from ``forward`` (ZeRO-3 only materialises parameters
inside forward).  Their cached gradient is back-propagated through exactly one
re-forwarded chunk, so they receive it once, not once per chunk (open_clip's
accum_freq gives the scale a k-times gradient).

Exactness needs each representation to depend on its own sample only; a
BatchNorm tower in train mode couples the rows of a chunk (see
:mod:`mmalign.models.batchnorm` for the modes that make that explicit).  The
re-forwards of 3 run inside the injected ``replay`` context, where such layers
record no statistics: they see the same rows a second time.

A fully locked tower (LiT: no weight takes a gradient) is not re-forwarded: the
injected ``reencode`` reuses its first-pass outputs, which need no graph, and runs
only the trainable tower(s).  Those must be the first to draw random numbers in
the model's forward (``TwoTower`` runs a locked tower last), so that the
recorded RNG state replays their masks exactly.  A step of n chunks then runs
the locked tower n times instead of 2n - 1.

This module never imports DeepSpeed: ``backward``, ``after_chunk`` and
``replay`` are injected (``engine.backward(x, scale_wrt_gas=False)`` /
``engine.step()`` under DeepSpeed, ``x.backward()`` in plain PyTorch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import torch

from mmalign.models.embeddings import PER_SAMPLE, PER_STEP, Embeddings


@dataclass
class RngState:
    """CPU and (when present) the current CUDA device's generator state: the forward runs on
    that device alone, and touching every visible device would create a context on each."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def capture(cls) -> RngState:
        cuda = (
            torch.cuda.get_rng_state() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        )
        return cls(torch.get_rng_state(), cuda)

    def restore(self) -> None:
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda)


def chunk_sizes(n: int, chunk: int) -> list[int]:
    """Split ``n`` into chunks of ``chunk`` (the last may be smaller)."""
    if chunk <= 0 or chunk >= n:
        return [n]
    return [chunk] * (n // chunk) + ([n % chunk] if n % chunk else [])


def split_batch(batch: Sequence[torch.Tensor], sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    """Split each tensor of ``batch`` along dim 0 into ``sizes`` (views, no copies)."""
    parts = [t.split(sizes) for t in batch]
    return [tuple(p[i] for p in parts) for i in range(len(sizes))]


@dataclass
class CachedStep:
    loss: torch.Tensor  # detached
    result: Any  # whatever loss_fn returned (e.g. LossOutput with stats)
    skipped: bool = False  # the guard refused the step: no backward ran


def grad_cache_step(
    encode: Callable[[Any], Embeddings],
    chunks: Sequence[Any],
    loss_fn: Callable[[Embeddings], Any],
    backward: Callable[[torch.Tensor], None],
    after_chunk: Callable[[int, bool], None] | None = None,
    guard: Callable[[torch.Tensor, dict], bool] | None = None,
    replay: Callable[[], AbstractContextManager] | None = None,
    reencode: Callable[[Any, Embeddings], Embeddings] | None = None,
) -> CachedStep:
    """One optimisation step's gradients, accumulated chunk by chunk.

    Args:
        encode: ``encode(chunk) -> Embeddings`` (per-sample fields (b, ...), per-step
            fields such as ``logit_scale``), e.g. the model's (or engine's) forward.
        chunks: the local batch split into chunks along the samples (e.g.
            ``Batch.slice`` or :func:`split_batch`).
        loss_fn: maps the full-batch Embeddings of detached leaf tensors to either
            a loss tensor or an object with a ``.loss`` tensor (e.g. LossOutput).
            A sharded loss may communicate here; every rank calls it once.
        backward: back-propagates a surrogate scalar through the model
            (gradients accumulate across chunks).
        after_chunk: called as ``after_chunk(index, is_last)`` after each
            backward (DeepSpeed: ``engine.step()``, which only updates at the
            accumulation boundary).
        guard: ``guard(loss, cached_grads) -> bool``; when False the step is
            skipped before any backward through the model (e.g. a non-finite
            loss or representation gradient), and ``skipped`` is set.
        replay: ``replay()`` returns a context entered around each re-forward
            (e.g. BatchNorm layers then record no running statistics).
        reencode: ``reencode(chunk, first) -> Embeddings``, the re-forward of step 3 given
            the chunk's first-pass (no-grad) outputs ``first``; default ``encode(chunk)``.
            It may reuse outputs that take no gradient (a locked tower's) instead of
            recomputing them, provided the parts it does recompute draw the same random
            numbers from the recorded RNG state as in the first pass (run them first).
    """
    # 1. no-grad forward of every chunk but the last, remembering the RNG state each
    #    started from; the last keeps its graph (it is back-propagated from it in 3)
    states: list[RngState] = []
    reps: list[Embeddings | None] = []
    last = len(chunks) - 1
    for i, chunk in enumerate(chunks):
        states.append(RngState.capture())
        with torch.set_grad_enabled(i == last):
            reps.append(encode(chunk))
    after_first_pass = RngState.capture()

    # 2. loss on detached representations; cache its gradient w.r.t. each of them
    kept = reps[-1]  # the last chunk's, with its graph
    assert kept is not None
    per_sample = list(kept.tensors(PER_SAMPLE))
    per_step = list(kept.tensors(PER_STEP))
    leaves: dict[str, torch.Tensor] = {}
    for name in per_sample:  # (B, ...) concatenated along the samples, whatever the trailing shape
        leaves[name] = torch.cat([getattr(r, name).detach() for r in reps]).requires_grad_(True)
    for name in per_step:  # taken once
        leaves[name] = getattr(kept, name).detach().requires_grad_(True)
    result = loss_fn(kept.replace(**leaves))
    loss = result if isinstance(result, torch.Tensor) else result.loss
    names = list(leaves)
    grads = dict(zip(names, torch.autograd.grad(loss, [leaves[k] for k in names], allow_unused=True)))
    if guard is not None and not guard(loss, grads):
        after_first_pass.restore()
        return CachedStep(loss=loss.detach(), result=result, skipped=True)
    sizes = [getattr(r, per_sample[0]).shape[0] for r in reps]
    sample_grads = {k: grads[k].split(sizes) for k in per_sample if grads.get(k) is not None}

    # 3. back-propagate rep . grad: the last chunk from its kept graph, then every
    #    other chunk re-forwarded under its recorded RNG state
    for n, i in enumerate([last, *range(last)]):
        if i == last:
            out = reps[last]
        else:
            states[i].restore()
            with (replay or contextlib.nullcontext)():
                out = encode(chunks[i]) if reencode is None else reencode(chunks[i], reps[i])
            reps[i] = None  # its first-pass outputs are not needed any more
        # outputs without a graph (a locked tower's) have nothing to back-propagate into
        surrogate = sum(
            (getattr(out, k) * g[i]).sum() for k, g in sample_grads.items() if getattr(out, k).requires_grad
        )
        if i == last:  # the per-step outputs take their gradient exactly once
            for key in per_step:
                if grads.get(key) is not None:
                    surrogate = surrogate + (getattr(out, key) * grads[key]).sum()
        backward(surrogate)
        if i == last:
            reps[last] = None  # free the kept graph before the next chunk's forward
            out = None
        if after_chunk is not None:
            after_chunk(n, n == last)
    # Leave the generator where a single pass would have left it, so the rest of
    # the run does not depend on whether caching was on.
    after_first_pass.restore()
    return CachedStep(loss=loss.detach(), result=result)
