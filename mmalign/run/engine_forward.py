"""What crosses the boundary of the module DeepSpeed calls: train.precision's autocast, entered
inside it (:class:`InnerAutocast`), and the model's Embeddings, handed to DeepSpeed as a dict
(:func:`dict_at_the_deepspeed_boundary`). Both are ours: no DeepSpeed object is touched."""

from __future__ import annotations

import contextlib
import itertools

import torch

from mmalign.config import Config
from mmalign.models.embeddings import Embeddings


def autocast_for(cfg: Config, device: torch.device):
    """``() -> context manager``: train.precision's autocast on ``device`` (bf16 / fp16), or a
    no-op for fp32. Weights stay in deepspeed.precision; autocast only casts the ops' inputs."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def module_device(module: torch.nn.Module) -> torch.device:
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


class InnerAutocast:
    """Runs a module's ``forward`` under the autocast context of the current engine call.

    DeepSpeed 0.19.8 runs the module inside ``autocast_if_enabled`` (runtime/torch_autocast.py):
    when the caller's autocast is on and the DeepSpeed config has no ``torch_autocast``
    section, it enters ``torch.autocast(device, enabled=False)`` around the whole module call.
    Its check reads ``torch.is_autocast_enabled()`` without an argument, i.e. CUDA's state, so
    on a GPU a caller's bf16 autocast silently became fp32 towers (on CPU the check is False
    and bf16 survived, which is why CPU tests never saw it). An autocast opened inside the
    module's own ``forward`` is below that wrapper and is left alone.

    DeepSpeed's ``torch_autocast`` section is not the fix: it also casts and reduces the
    gradients of Linear / Conv weights in the low precision, and mmalign sums every gradient
    in fp32. Here only the forward's ops run in bf16; autograd casts each weight gradient back
    to the fp32 parameter's dtype, so accumulation and reduction stay fp32.

    The instance replaces ``module.forward`` (an instance attribute, not a wrapper module), so
    parameter names, ``state_dict`` keys and checkpoints are unchanged."""

    def __init__(self, module: torch.nn.Module):
        self._forward = module.forward  # the bound method of the module's class
        self._context = None
        module.forward = self

    @contextlib.contextmanager
    def using(self, context):
        previous, self._context = self._context, context
        try:
            yield
        finally:
            self._context = previous

    def __call__(self, *args, **kwargs):
        context = self._context
        if context is None:
            return self._forward(*args, **kwargs)
        with context():
            return self._forward(*args, **kwargs)


def dict_at_the_deepspeed_boundary(model: torch.nn.Module) -> list:
    """Let DeepSpeed see the model's output tensors: it looks for them only in tensors, tuples,
    lists and dicts (its backward hooks on a forward's outputs run the backward prologue that
    fp32 gradient accumulation of bf16 weights needs; ZeRO-3 wraps them for its pre-backward
    parameter fetch).  A forward hook registered before DeepSpeed's turns the model's
    Embeddings into a dict of its present fields; :meth:`mmalign.run.engine.Engine.forward` rebuilds the same
    Embeddings class from it.  Returns the one-element list holding that class."""
    kind: list = [Embeddings]

    def to_dict(module, args, output):
        if isinstance(output, Embeddings):
            kind[0] = type(output)
            return output.tensors()
        return output

    model.register_forward_hook(to_dict)
    return kind
