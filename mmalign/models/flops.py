"""torch's FLOP counter with the CPU attention kernels added: the one counter of model FLOPs.

Below the towers (a timm or Hugging Face tower counts its own forward with it) and below the
training monitors (MFU), which both import it from here.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode

# torch's FLOP counter has formulas for the CUDA attention kernels but not for the CPU one
# (flash attention for CPU): without these, a CPU count misses QK^T and AV, yet counts them
# under the math backend (plain bmm).  Analytic formulas make both backends agree.
_aten = torch.ops.aten


def _attention_flops(query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Forward of softmax(Q K^T) V from the shapes q (B, H, L, E), k (B, Hkv, S, E),
    v (B, Hkv, S, Ev): the two matmuls Q K^T (B H L S E multiply-adds) and P V (B H L S Ev),
    2 FLOPs each; a mask (causal or additive) still computes every score, as on the math
    backend. Softmax and scaling are not matmuls and, as everywhere in the count, not counted."""
    b, h, length, e = query
    s, ev = key[-2], value[-1]
    return 2 * b * h * length * s * (e + ev)


def _attention_backward_flops(grad_out, query, key, value, *args, out_shape=None, **kwargs) -> int:
    """Backward of the same: a flash kernel keeps no (L, S) probabilities, so it recomputes
    Q K^T, then dP = dO V^T, dV = P^T dO, dQ = dS K, dK = dS^T Q: 2.5x the forward at E = Ev,
    the convention of torch's formulas for the CUDA kernels. (The math backend's autograd
    keeps P and skips the recompute: 2x. The training count never runs a backward: it is
    3x the forward, whichever backend runs.)"""
    b, h, length, e = query
    s, ev = key[-2], value[-1]
    return 2 * b * h * length * s * (3 * e + 2 * ev)


ATTENTION_FLOP_FORMULAS = {
    op: formula
    for name, formula in (
        ("_scaled_dot_product_flash_attention_for_cpu", _attention_flops),
        ("_scaled_dot_product_flash_attention_for_cpu_backward", _attention_backward_flops),
    )
    if (op := getattr(_aten, name, None)) is not None
}


def flop_counter() -> FlopCounterMode:
    """torch's FLOP counter (matmuls and convolutions, 2 FLOPs per multiply-add) with the CPU
    attention kernels added (:data:`ATTENTION_FLOP_FORMULAS`)."""
    return FlopCounterMode(display=False, custom_mapping=ATTENTION_FLOP_FORMULAS)
