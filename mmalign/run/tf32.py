"""``train.tf32``: TensorFloat-32 for the float32 matmuls and convolutions of a CUDA run.

On Ampere and later GPUs a TF32 matmul rounds its float32 inputs to a 10-bit mantissa and
accumulates in float32, several times faster than exact float32 (torch's notes, "TensorFloat-32
(TF32) on Ampere (and later) devices"). It changes fp32 runs and the float32 matmuls of
autocast runs; bf16 / fp16 matmuls are unaffected. torch leaves cuBLAS
matmuls exact and cuDNN convolutions in TF32 by default; this module sets both one way, so
``train.tf32: false`` means exact float32 throughout.

Only the CUDA backends' flags are set (not ``torch.set_float32_matmul_precision``, which is
global, not CUDA's alone), and only when the run's device is CUDA: CPU runs are left as they were.
"""

from __future__ import annotations

import torch

__all__ = ["set_tf32"]


def set_tf32(device: torch.device, enabled: bool, backends=None) -> bool:
    """Turn TF32 on (``enabled``) or off for cuBLAS matmuls and cuDNN convolutions when
    ``device`` is CUDA; returns whether anything was set (False on CPU).

    torch 2.9+ has per-backend ``fp32_precision`` ("tf32" / "ieee") and refuses to read the
    legacy ``allow_tf32`` flags once the two APIs are mixed, so the new one is used where it
    exists. ``backends``: ``torch.backends`` (a stand-in in tests).
    """
    if torch.device(device).type != "cuda":
        return False
    backends = torch.backends if backends is None else backends
    matmul, cudnn = backends.cuda.matmul, backends.cudnn
    if hasattr(matmul, "fp32_precision") and hasattr(getattr(cudnn, "conv", None), "fp32_precision"):
        mode = "tf32" if enabled else "ieee"
        matmul.fp32_precision = mode
        cudnn.conv.fp32_precision = mode
    else:  # torch before 2.9
        matmul.allow_tf32 = bool(enabled)
        cudnn.allow_tf32 = bool(enabled)
    return True
