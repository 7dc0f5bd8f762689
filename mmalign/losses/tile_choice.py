"""``loss.tile_size: auto``: the full logit matrix while it fits a memory budget, tiles above it.

The untiled kernels materialise the (M, N) logits of each pass (M local rows, N gathered
candidates) and keep them for the backward; the tiled kernels (Inf-CL, Cheng et al. 2024,
arXiv 2410.17243; :mod:`.tiled`) hold t x t tiles instead. The untiled path is faster while
it fits (one large matmul, no recomputation in the backward), so ``auto`` keeps it while the
estimate below stays within ``loss.tile_budget_mb`` and otherwise picks the largest
power-of-two tile whose workspace fits the budget.

The choice is a pure function of the shapes, the feature dtype and the config, all equal on
every rank (every rank passes the same B), so every rank takes the same kernel and the
collectives inside a step stay matched.

Memory model (bytes, ``c`` = the compute dtype's size: 4 for fp32 / bf16 / fp16 features, whose
logits are computed in float32, 8 for float64):

* untiled: ``(saved + 2) * M * N * c`` - the ``saved`` logit matrices autograd keeps until the
  backward, plus two transients of the same size (the exp inside ``logsumexp`` / the
  sigmoid, then the logits' gradient). ``saved`` per kernel, counted from their untiled code:
  InfoNCE 1 in one process (one B x B matrix serves both directions), 2 sharded (one pass
  per direction); the queue kernel 2 over the batch and queue columns together; the
  hard-negative estimators 6 (two directions x up to three masked LSEs); SigLIP 4 (the logits,
  the signed logits, logsigmoid's input and output); NT-Xent 2 (the logits and their masked
  copy).
* tiled: ``3 * t * t * c`` - two t x t workspace buffers (:class:`.tiled.Workspace`) and one
  more tile-sized temporary (a half-precision copy of the gradient tile, a monitor mask). The
  O((M + N) D) feature gradients are the same for both paths and are not counted.
"""

from __future__ import annotations

import torch

__all__ = [
    "AUTO",
    "DEFAULT_BUDGET_MB",
    "MIN_TILE",
    "SAVED_MATRICES",
    "untiled_bytes",
    "tiled_bytes",
    "choose_tile",
    "resolve_tile",
]

AUTO = "auto"
# Fits next to a ViT-B/L's activations on a 40-80 GB GPU and keeps the untiled path for every
# CPU-sized batch (one process, B = 4096: 3 * 4096^2 * 4 bytes = 192 MiB).
DEFAULT_BUDGET_MB = 256.0
MIN_TILE = 64  # smaller tiles spend their time in Python, not in the matmul
SAVED_MATRICES = {"infonce": 1, "infonce_sharded": 2, "queue": 2, "hardneg": 6, "siglip": 4, "ntxent": 2}
_TILED_BUFFERS = 3


def _compute_itemsize(dtype: torch.dtype) -> int:
    # the kernels accumulate half-precision features in float32 (tiled.compute_dtype)
    return 8 if dtype == torch.float64 else 4


def untiled_bytes(kernel: str, m: int, n: int, dtype: torch.dtype = torch.float32) -> int:
    """Estimated peak bytes of ``kernel``'s untiled path over (m, n) logits."""
    if kernel not in SAVED_MATRICES:
        raise ValueError(f"unknown kernel {kernel!r}; expected one of {sorted(SAVED_MATRICES)}")
    return (SAVED_MATRICES[kernel] + 2) * m * n * _compute_itemsize(dtype)


def tiled_bytes(t: int, dtype: torch.dtype = torch.float32) -> int:
    """Estimated peak bytes of the tiled kernels' workspace at tile edge ``t``."""
    return _TILED_BUFFERS * t * t * _compute_itemsize(dtype)


def choose_tile(
    kernel: str, m: int, n: int, dtype: torch.dtype = torch.float32, budget_mb: float = DEFAULT_BUDGET_MB
) -> int | None:
    """None (untiled) while :func:`untiled_bytes` fits ``budget_mb`` MiB, else the largest
    power-of-two tile edge (at least :data:`MIN_TILE`) whose :func:`tiled_bytes` fits."""
    if budget_mb <= 0:
        raise ValueError(f"budget_mb must be > 0, got {budget_mb}")
    budget = budget_mb * 2**20
    if untiled_bytes(kernel, m, n, dtype) <= budget:
        return None
    t = MIN_TILE
    while tiled_bytes(2 * t, dtype) <= budget:
        t *= 2
    return t


def resolve_tile(
    tile_size: int | str | None,
    kernel: str,
    m: int,
    n: int,
    dtype: torch.dtype,
    budget_mb: float = DEFAULT_BUDGET_MB,
) -> int | None:
    """The tile edge a kernel call uses: ``auto`` -> :func:`choose_tile`; 0 / None -> None
    (untiled); an integer -> itself."""
    if tile_size == AUTO:
        return choose_tile(kernel, m, n, dtype, budget_mb)
    if not tile_size:
        return None
    return int(tile_size)
