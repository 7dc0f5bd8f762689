"""A training-mode forward that leaves no trace on the model: for measurements made before a
run starts (its FLOP count, mmalign.run.monitors; its activation memory, mmalign.run.memory_plan).

Inside :func:`traceless_training`, every module is in train mode (patch dropout masks,
BatchNorm batch statistics: what a training step runs); on leaving it, each module's own mode
comes back (a run may hold some in eval, e.g. frozen BatchNorm), every buffer (BatchNorm
running statistics) holds its old value, and the random generators of the CPU and the
model's device continue as if nothing had drawn from them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["traceless_training"]


@contextlib.contextmanager
def traceless_training(model: torch.nn.Module) -> Iterator[None]:
    modes = [(m, m.training) for m in model.modules()]
    buffers = {name: b.detach().clone() for name, b in model.named_buffers()}
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices):
            model.train()
            yield
    finally:
        for module, training in modes:
            module.training = training
        with torch.no_grad():
            for name, b in model.named_buffers():
                if name in buffers:
                    b.copy_(buffers[name])
