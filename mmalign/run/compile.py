"""``train.compile``: the towers under ``torch.compile``, and a compiler failure as one line.

Each tower (``model.visual``, ``model.text``) is compiled in place with ``nn.Module.compile``:
the module keeps its class and its submodules, so parameter and buffer names stay as they are
(no ``_orig_mod.`` prefix from an ``OptimizedModule`` wrapper) for checkpoints, export, the
final model and DeepSpeed's partitioning.  Only the towers' forwards are compiled: the loss
kernels (custom autograd functions), the temperature and the gradient cache stay eager.

Behaviour the engine relies on:

- Dropout inside a compiled graph draws from torch's global generator (inductor takes its
  seeds from it at each call), so a gradient-cache re-forward under the RNG state its first
  pass recorded draws the same masks, as in eager mode (tested).  The masks are not those of
  eager mode's kernels: a compiled run with dropout is not bitwise an eager run.
- Chunk sizes: ``dynamic=None`` (torch's automatic dynamic shapes).  The first call compiles
  for its static batch size; the first different size (an uneven last gradient-cache chunk,
  an evaluation batch) compiles once more with a dynamic batch dimension, which then serves
  every size.  ``train()`` / ``eval()`` each get their own graph (a guard on the mode).
- Compilation is lazy: it happens in the first step's forward (and backward).  A failure
  there (no C++ compiler for inductor on CPU, a backend error) is turned by
  :func:`compile_failures` into one ``ConfigError`` line naming ``train.compile``.
"""

from __future__ import annotations

import contextlib

from torch import nn

from mmalign.errors import ConfigError

TOWERS = ("visual", "text")


def compile_towers(model: nn.Module, backend: str = "inductor") -> None:
    """Compile ``model``'s towers in place (their names unchanged); before DeepSpeed wraps it."""
    import torch._dynamo

    try:
        torch._dynamo.lookup_backend(backend)  # an unknown name fails now, not at the first step
    except torch._dynamo.exc.InvalidBackend:
        raise ConfigError(
            f"config key 'train.compile_backend': unknown torch.compile backend {backend!r} "
            f"(try inductor, aot_eager or eager)"
        ) from None
    for name in TOWERS:
        tower = getattr(model, name, None)
        if tower is not None:
            tower.compile(backend=backend, dynamic=None)


def _failures() -> tuple[type[BaseException], ...]:
    from torch._dynamo.exc import BackendCompilerFailed
    from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

    return BackendCompilerFailed, InvalidCxxCompiler, CppCompileError


@contextlib.contextmanager
def compile_failures(enabled: bool):
    """Around a training step: a compiler failure becomes one ConfigError line suggesting
    ``train.compile: false`` (the user's machine lacks what the compiler needs), not a traceback."""
    if not enabled:
        yield
        return
    try:
        yield
    except _failures() as e:
        cause = getattr(e, "inner_exception", None) or e
        first = next((line.strip() for line in str(cause).splitlines() if line.strip()), "")
        raise ConfigError(
            f"config key 'train.compile': torch.compile of the towers failed "
            f"({type(cause).__name__}: {first[:200]}); set train.compile: false to train "
            f"without it"
        ) from None
