"""Training monitors beyond the loss: throughput, FLOP utilisation and collapse.

A falling loss does not prove that the model learned anything: a collapsing
encoder can still lower it.  So, on a fixed probe batch, the loop logs the
per-dimension standard deviation and the effective rank of both modalities and
raises an alarm in the log when they fall below configured thresholds.  FLOP
utilisation uses the model FLOPs of forward + backward (3x the forward, counted
once per sample with torch's FLOP counter), whatever caching re-computes.
"""

from __future__ import annotations

import logging
import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from mmalign.evaluation.diagnostics import effective_rank, per_dim_std

log = logging.getLogger("mmalign.monitors")

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity) for the usual training GPUs.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


@torch.no_grad()
def forward_flops_per_sample(model: torch.nn.Module, image_size: int, context_length: int, *,
                             second_view: bool = False, negatives: int = 0) -> float:
    """FLOPs of one forward pass of both towers for a single sample (on CPU, float32),
    including its second image view and its ``negatives`` mined captions when the run embeds them."""
    was_training = model.training
    model.eval()
    images = torch.zeros(1, 3, image_size, image_size)
    tokens = torch.zeros(1, context_length, dtype=torch.long)
    tokens[0, 0], tokens[0, 1] = 49406, 49407
    extra = {}
    if second_view:
        extra["images2"] = images.clone()
    if negatives:
        extra["neg_texts"] = tokens.repeat(negatives, 1)[None]  # (1, k, L)
    counter = FlopCounterMode(display=False)
    with counter:
        model(images, tokens, **extra)
    model.train(was_training)
    return float(counter.get_total_flops())


def peak_tflops(device: torch.device, configured: float) -> float | None:
    """The configured peak, else a known GPU's bf16 peak, else None (CPUs vary too much)."""
    if configured > 0:
        return configured
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, value in GPU_PEAK_TFLOPS.items():
            if key in name:
                return value
    return None


@torch.no_grad()
def probe_stats(image_features: torch.Tensor, text_features: torch.Tensor) -> dict[str, float]:
    """Collapse indicators of the probe batch's normalised embeddings."""
    out = {}
    for name, feats in (("image", image_features), ("text", text_features)):
        std = per_dim_std(feats)
        out[f"probe_{name}_std_mean"] = float(std.mean())
        out[f"probe_{name}_std_min"] = float(std.min())
        out[f"probe_{name}_effective_rank"] = effective_rank(feats)
    return out


def collapse_alarms(stats: dict[str, float], dim: int, min_std: float, min_rank_frac: float) -> list[str]:
    alarms = []
    for name in ("image", "text"):
        std = stats[f"probe_{name}_std_mean"]
        rank = stats[f"probe_{name}_effective_rank"]
        if not (math.isfinite(std) and math.isfinite(rank)):
            alarms.append(f"{name} embeddings are not finite")
            continue
        if std < min_std:
            alarms.append(f"{name} embeddings collapsing: mean per-dimension std {std:.4f} < {min_std}")
        if rank < min_rank_frac * dim:
            alarms.append(f"{name} embeddings collapsing: effective rank {rank:.1f} < {min_rank_frac:g} x {dim}")
    return alarms
