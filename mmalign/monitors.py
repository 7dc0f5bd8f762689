"""Training monitors beyond the loss: throughput, FLOP utilisation and collapse.

A falling loss does not prove that the model learned anything: a collapsing
encoder can still lower it.  So, on a fixed probe batch, the loop logs the
per-dimension standard deviation and the effective rank of both modalities and
raises an alarm in the log when they fall below configured thresholds.  FLOP
utilisation uses the model FLOPs of forward + backward (3x the forward, counted
once per sample in train mode with torch's FLOP counter, so patch dropout's
shorter sequences count), whatever caching re-computes, over the peak of all
devices.  Values that differ by rank (loss, data wait, skipped samples) are made
global at log steps only (:func:`global_log_values`).
"""

from __future__ import annotations

import logging
import math

import torch
from torch.utils.flop_counter import FlopCounterMode

from mmalign import distributed as mdist
from mmalign.evaluation.diagnostics import effective_rank, per_dim_std

log = logging.getLogger("mmalign.monitors")

# Dense bf16/fp16 tensor-core peaks (TFLOP/s, no sparsity) for the usual training GPUs.
GPU_PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0, "V100": 125.0}


@torch.no_grad()
def forward_flops_per_sample(model: torch.nn.Module, image_size: int, context_length: int, *,
                             second_view: bool = False, negatives: int = 0,
                             towers: tuple[str, ...] = ("visual", "text")) -> float:
    """FLOPs of one training-mode forward pass of ``towers`` (both by default) for a single
    sample (on the model's device, float32), including its second image view and its
    ``negatives`` mined captions when the run embeds them.

    Train mode, so patch dropout shrinks the count; the pass leaves no trace: the RNG is
    forked (the run's dropout stream is unchanged) and every buffer (BatchNorm running
    statistics) is restored.  A model with BatchNorm gets two samples (train-mode
    BatchNorm needs more than one value per channel) and the count is halved.
    """
    was_training = model.training
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    n = 2 if has_bn else 1
    device = next(model.parameters()).device
    images = torch.zeros(n, 3, image_size, image_size, device=device)
    tokens = torch.zeros(n, context_length, dtype=torch.long, device=device)
    tokens[:, 0], tokens[:, 1] = 1, 2  # ids every vocabulary has (an HF or sentencepiece tower's is small)
    extra = {}
    if second_view and "visual" in towers:
        extra["images2"] = images.clone()
    if negatives and "text" in towers:
        extra["neg_texts"] = tokens[:, None].repeat(1, negatives, 1)  # (n, k, L)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    counter = FlopCounterMode(display=False)
    devices = [device.index or 0] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), counter:
            model.train()
            model(images if "visual" in towers else None, tokens if "text" in towers else None, **extra)
    finally:
        model.train(was_training)
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
    return float(counter.get_total_flops()) / n


def train_flops_per_sample(model: torch.nn.Module, image_size: int, context_length: int, *,
                           second_view: bool = False, negatives: int = 0) -> float:
    """FLOPs of one training step for a single sample: forward and backward (about twice the
    forward: gradients of inputs and of weights) of each tower that trains, the forward alone of
    a fully locked one (LiT: no gradient flows into it, so it has no backward at all).  A partly
    locked tower counts as trainable (its backward stops at the lowest unlocked layer; this
    over-counts it, never under-counts)."""
    locked = set(model.fully_locked()) if hasattr(model, "fully_locked") else set()
    return sum((1 if tower in locked else 3)
               * forward_flops_per_sample(model, image_size, context_length, second_view=second_view,
                                          negatives=negatives, towers=(tower,))
               for tower in ("visual", "text"))


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


def mfu(tflops: float, peak_per_device: float | None, world_size: int) -> float | None:
    """Achieved TFLOP/s of the whole run over the peak of all its devices."""
    return tflops / (peak_per_device * world_size) if peak_per_device else None


@torch.no_grad()
def global_log_values(loss: torch.Tensor, data_wait_s: float, skipped: dict[str, int]) -> dict[str, float]:
    """This rank's log values made global (a collective: every rank calls it, at log steps only).

    ``loss`` (this rank's loss) -> the mean over ranks, which is the global batch's loss
    (each rank's loss is the mean over its local rows); ``data_wait_s`` -> the sum over
    ranks; ``skipped`` (samples skipped so far by reason; ranks may know different
    reasons) -> ``skipped_samples/<reason>``, summed over ranks.
    """
    packed = torch.stack([loss.detach().reshape(()).double(),
                          torch.tensor(float(data_wait_s), dtype=torch.float64, device=loss.device)])
    mdist.all_reduce_sum(packed)
    total: dict[str, int] = {}
    for counts in mdist.all_gather_object(dict(skipped)):
        for reason, count in counts.items():
            total[reason] = total.get(reason, 0) + int(count)
    return {"loss": float(packed[0]) / mdist.get_world_size(), "data_wait_s": float(packed[1]),
            **{f"skipped_samples/{k}": total[k] for k in sorted(total)}}


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
