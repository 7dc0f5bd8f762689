"""BatchNorm under gradient caching and data parallelism: an explicit, tested semantics.

Gradient caching (Gao, Zhang, Han & Callan 2021, "Scaling Deep Contrastive
Learning Batch Size under Memory Limited Setup", GradCache) is exact only when
each sample's representation depends on that sample alone.  BatchNorm in train
mode (Ioffe & Szegedy 2015) breaks this: it normalises with the statistics of
the rows of one forward, so a representation depends on which rows share its
chunk (caching) or its rank (data parallelism), and the "full-batch gradient"
the cache reproduces does not exist.  Re-forwarding a chunk would also update
the running statistics a second time.  open_clip's ResNet towers (the
quickstart's ``tiny-rn``) have BatchNorm, so ``model.batchnorm`` chooses:

* ``frozen``: always normalise with the running statistics (eval-mode maths,
  even in ``model.train()``) and never update them; the affine weight and bias
  still train.  Every row is then independent: cached, sharded and ZeRO
  gradients equal the full-batch ones exactly (what fine-tuning commonly does;
  open_clip's ``lock_image_tower(freeze_bn_stats=True)``).
* ``local``: each forward normalises with the statistics of the rows it sees,
  one chunk of one rank ("ghost" batch norm, Hoffer, Hubara & Soudry 2017).
  The gradient is that of per-chunk normalisation, not the full batch's.
* ``sync``: each forward normalises with the statistics of the same chunk of
  every rank (a differentiable all-reduce of per-channel sums; works on gloo,
  unlike torch's SyncBatchNorm).  Without caching this is the full-batch
  BatchNorm exactly; under caching the statistics are still per chunk (of all
  ranks).

Whatever the mode, the running statistics are updated exactly once per step
from every sample of the global batch, each counted once, as one uncached
step updates them (a deeper layer's inputs, though, depend on how the layers
before it normalised: under ``local`` / cached ``sync`` they are not the
full-batch step's): during an engine step (:class:`StepStatistics`) the layers do not touch their
buffers; each train-mode forward of the first pass records its per-channel
(count, mean, biased variance), the re-forwards of gradient caching record
nothing (they see the same rows again), and after a non-skipped update the
engine commits: the records of every chunk and every rank are combined (one
small all-reduce) and the buffers take one momentum update, identical on
every rank.  A skipped step discards them.  Outside an engine step a ``local``
or ``sync`` layer is exactly torch's BatchNorm (per-forward statistics, buffers
updated on each train-mode forward); a ``frozen`` one is frozen everywhere.

The layer keeps torch's parameter and buffer names, so state dicts, exports and
``load_pretrained`` (which builds plain torch BatchNorm) are unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from mmalign.config import ConfigError
from mmalign.dist import distributed as mdist

MODES = ("frozen", "sync", "local")

__all__ = ["MODES", "BatchNorm", "StepStatistics", "check_batchnorm", "convert_batchnorm", "has_batchnorm"]


class BatchNorm(_BatchNorm):
    """torch's BatchNorm{1,2,3}d with a ``mode`` (``frozen`` | ``sync`` | ``local``) and
    step-level running statistics (see the module docstring)."""

    def __init__(self, num_features: int, mode: str, input_dims: tuple[int, ...] = (2, 3, 4, 5), **kwargs):
        super().__init__(num_features, **kwargs)
        if mode not in MODES:
            raise ValueError(f"BatchNorm mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.input_dims = tuple(input_dims)  # what the replaced torch class accepted
        self._records: list | None = None  # None = outside an engine step
        self._replaying = False

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() not in self.input_dims:
            raise ValueError(
                f"expected a {' or '.join(f'{d}D' for d in self.input_dims)} input, got {input.dim()}D"
            )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mode={self.mode}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(x)
        if self.mode == "frozen":
            return F.batch_norm(
                x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps
            )
        if not self.training or self._records is None:
            return super().forward(x)  # eval, or outside an engine step: exactly torch's
        if not self._replaying:
            self._records.append(_moments(x))
        if self.mode == "local":
            # batch statistics of these rows; no running buffers passed, so none is touched
            return F.batch_norm(x, None, None, self.weight, self.bias, True, 0.0, self.eps)
        return self._sync_normalise(x)

    def _sync_normalise(self, x: torch.Tensor) -> torch.Tensor:
        """Normalise with the mean and biased variance over these rows of every rank
        (two differentiable all-reduces: exact two-pass statistics)."""
        dims = [0, *range(2, x.dim())]
        shape = [1, -1] + [1] * (x.dim() - 2)
        xf = x.float()  # (N, C, ...) statistics in float32
        count = torch.full((1,), float(xf.numel() // xf.shape[1]), device=xf.device)
        sums = mdist.all_reduce_sum_with_grad(torch.cat([xf.sum(dims), count]))  # (C + 1,)
        mean = sums[:-1] / sums[-1]  # (C,)
        centred = xf - mean.view(shape)
        var = mdist.all_reduce_sum_with_grad((centred * centred).sum(dims)) / sums[-1]  # (C,) biased
        y = centred * torch.rsqrt(var + self.eps).view(shape)
        if self.weight is not None:
            y = y * self.weight.float().view(shape) + self.bias.float().view(shape)
        return y.to(x.dtype)

    # ------------------------------------------------------- step statistics

    def _running(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """running_mean, running_var, num_batches_tracked (always kept: track_running_stats=True)."""
        mean, var, tracked = self.running_mean, self.running_var, self.num_batches_tracked
        assert mean is not None and var is not None and tracked is not None
        return mean, var, tracked

    def _sums(self) -> torch.Tensor:
        """This rank's recorded forwards as float64 [count, sum x (C,), sum x^2 (C,)]."""
        running_mean, _, _ = self._running()
        out = torch.zeros(1 + 2 * self.num_features, dtype=torch.float64, device=running_mean.device)
        for n, mean, var in self._records or []:
            out[0] += n
            out[1 : 1 + self.num_features] += n * mean
            out[1 + self.num_features :] += n * (var + mean * mean)
        return out

    @torch.no_grad()
    def _update_running(self, sums: torch.Tensor) -> None:
        """One momentum update from global [count, sum, sum of squares] (torch's rule:
        unbiased variance into running_var; ``momentum=None`` = cumulative average)."""
        n = float(sums[0])
        if n == 0:
            return
        c = self.num_features
        mean = sums[1 : 1 + c] / n  # (C,) float64
        var = (sums[1 + c :] / n - mean * mean).clamp_min(0.0)  # (C,) biased
        unbiased = var * (n / (n - 1)) if n > 1 else var
        running_mean, running_var, tracked = self._running()
        tracked.add_(1)
        factor = 1.0 / float(tracked) if self.momentum is None else float(self.momentum)
        for buf, value in ((running_mean, mean), (running_var, unbiased)):
            buf.copy_((buf.double() * (1.0 - factor) + value * factor).to(buf.dtype))


@torch.no_grad()
def _moments(x: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """(count, mean (C,), biased var (C,)) of one forward's rows, float32 maths, float64 out."""
    dims = [0, *range(2, x.dim())]
    var, mean = torch.var_mean(x.detach().float(), dim=dims, unbiased=False)
    return x.numel() // x.shape[1], mean.double(), var.double()


class StepStatistics:
    """The engine's hold on every :class:`BatchNorm` of a model for one step::

    with StepStatistics(model) as bn:
        ... first pass; re-forwards inside ``with bn.replay():`` ...
        if not skipped:
            bn.commit()  # every rank, after the update
    """

    def __init__(self, model: nn.Module):
        self.layers = [m for m in model.modules() if isinstance(m, BatchNorm)]

    def __enter__(self) -> StepStatistics:
        for layer in self.layers:
            layer._records, layer._replaying = [], False
        return self

    def __exit__(self, *exc: object) -> None:
        for layer in self.layers:  # whatever was not committed is discarded (exceptions propagate)
            layer._records, layer._replaying = None, False

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Around a re-forward of rows the first pass has already seen: record nothing."""
        for layer in self.layers:
            layer._replaying = True
        try:
            yield
        finally:
            for layer in self.layers:
                layer._replaying = False

    @torch.no_grad()
    def commit(self) -> None:
        """Combine the records of every chunk and rank; one buffer update per layer.
        A collective when any layer records (every rank must call it)."""
        recording = [layer for layer in self.layers if layer.mode != "frozen"]
        if not recording:
            return
        sums = mdist.all_reduce_sum(torch.cat([layer._sums() for layer in recording]))
        offset = 0
        for layer in recording:
            size = 1 + 2 * layer.num_features
            layer._update_running(sums[offset : offset + size])
            offset += size
            layer._records = []


def has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, _BatchNorm) for m in model.modules())


def convert_batchnorm(model: nn.Module, mode: str) -> int:
    """Replace every BatchNorm{1,2,3}d (or SyncBatchNorm) of ``model`` in place by a
    :class:`BatchNorm` of ``mode``, sharing its parameters and buffers (already
    converted layers just take the mode).  Returns the number of layers."""
    if mode not in MODES:
        raise ValueError(f"BatchNorm mode must be one of {MODES}, got {mode!r}")
    if isinstance(model, _BatchNorm):
        raise ValueError("convert_batchnorm needs a model containing BatchNorm layers, not a layer")
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, BatchNorm):
                child.mode = mode
            elif isinstance(child, _BatchNorm):
                parent._modules[name] = _converted(child, mode, name)
            else:
                continue
            count += 1
    return count


def _converted(old: _BatchNorm, mode: str, name: str) -> BatchNorm:
    if not old.track_running_stats:
        raise ConfigError(
            f"config key 'model.batchnorm': layer {name!r} keeps no running statistics "
            f"(track_running_stats=False), which {mode!r} needs"
        )
    dims = {nn.BatchNorm1d: (2, 3), nn.BatchNorm2d: (4,), nn.BatchNorm3d: (5,)}.get(type(old), (2, 3, 4, 5))
    running_mean = old.running_mean
    assert running_mean is not None  # track_running_stats, checked above
    new = BatchNorm(
        old.num_features,
        mode,
        dims,
        eps=old.eps,
        momentum=old.momentum,
        affine=False,
        track_running_stats=True,
        device=running_mean.device,
        dtype=running_mean.dtype,
    )
    # share, not copy: the same Parameter objects (requires_grad, optimiser membership) and buffers
    new.weight, new.bias = old.weight, old.bias
    new.affine = old.affine
    new.running_mean, new.running_var, new.num_batches_tracked = (
        old.running_mean,
        old.running_var,
        old.num_batches_tracked,
    )
    new.train(old.training)
    return new


def check_batchnorm(model: nn.Module, mode: str | None, *, chunks: int, world_size: int) -> str | None:
    """The engine's gate, before DeepSpeed is built: a model with BatchNorm under gradient
    caching or several ranks needs an explicit ``model.batchnorm`` (one-line ConfigError);
    with one, unconverted layers are converted.  Returns the line to log, if any."""
    if not has_batchnorm(model):
        return None if mode is None else f"model.batchnorm={mode}: the model has no BatchNorm layer; ignored"
    if mode is None:
        if chunks > 1 or world_size > 1:
            rows = " of ".join(w for w, on in (("one chunk", chunks > 1), ("one rank", world_size > 1)) if on)
            where = " and ".join(
                w
                for w, on in (("gradient caching", chunks > 1), (f"{world_size} processes", world_size > 1))
                if on
            )
            raise ConfigError(
                f"config key 'model.batchnorm' must be set (frozen | sync | local): the model has "
                f"BatchNorm layers, and under {where} each forward would normalise with the "
                f"statistics of {rows} (the gradient is then not the full batch's)"
            )
        return None
    n = convert_batchnorm(model, mode)
    return (
        f"model.batchnorm={mode}: {n} BatchNorm layers "
        + {
            "frozen": "normalise with their running statistics, never updated (eval-mode maths); gradients are exact",
            "local": (
                f"normalise each forward with its own rows' statistics (one of {chunks} chunks per step, on one of "
                f"{world_size} ranks: 'ghost' batch norm, not the full batch's); running statistics take one "
                f"update per step from the whole global batch"
            ),
            "sync": (
                "normalise with the statistics of the same chunk of every rank"
                + (
                    f" (still per chunk under gradient caching: {chunks} chunks per step)"
                    if chunks > 1
                    else " (the full global batch: no caching)"
                )
                + "; running statistics take one update per step from the whole global batch"
            ),
        }[mode]
    )
