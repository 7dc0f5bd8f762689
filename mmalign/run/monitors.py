"""Training monitors beyond the loss: throughput, FLOP utilisation and collapse.

A falling loss does not prove that the model learned anything: a collapsing
encoder can still lower it.  So, on a fixed probe batch, the loop logs the
per-dimension standard deviation and the effective rank of both modalities and
raises an alarm in the log when they fall below configured thresholds.  FLOP
utilisation uses the model FLOPs of forward + backward (3x the forward, counted
once per sample in train mode with torch's FLOP counter on the model's device, at
the full context length, attention's QK^T and AV included, so patch dropout's
shorter sequences count), whatever caching re-computes, over the peak of all
devices for the dtype the matmuls run in (:func:`matmul_dtype`).  Values that
differ by rank (loss, data wait, skipped samples) are made global at log steps
only (:func:`global_log_values`).
"""

from __future__ import annotations

import logging
import math

import torch

from mmalign.dist import distributed as mdist
from mmalign.evaluation.diagnostics import effective_rank, per_dim_std
from mmalign.models.flops import ATTENTION_FLOP_FORMULAS, flop_counter  # noqa: F401 (re-exported)
from mmalign.models.probe_pass import traceless_training

log = logging.getLogger("mmalign.run.monitors")

# Dense peaks per device (TFLOP/s, datasheet figures without 2:4 sparsity), by the dtype the
# matmuls run in: bf16 / fp16 on the tensor cores, tf32 (fp32 tensors, TF32 tensor cores:
# train.tf32), fp32 (exact, the CUDA cores).  Keys match torch.cuda.get_device_name, longest
# first ("H100 PCIe" before "H100").  A dtype a GPU has no units for is absent (V100: no bf16,
# so no MFU); pre-Ampere GPUs have no TF32, their "tf32" is the fp32 peak (the flag is a no-op).
GPU_PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 67.0},  # SXM
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 67.0},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "V100-PCIE": {"fp16": 112.0, "tf32": 14.0, "fp32": 14.0},
    "V100": {"fp16": 125.0, "tf32": 15.7, "fp32": 15.7},  # SXM2
}
DTYPES = ("bf16", "fp16", "tf32", "fp32")


@torch.no_grad()
def forward_flops_per_sample(
    model: torch.nn.Module,
    image_size: int,
    context_length: int,
    *,
    second_view: bool = False,
    negatives: int = 0,
    towers: tuple[str, ...] = ("visual", "text"),
) -> float:
    """FLOPs of one training-mode forward pass of ``towers`` (both by default) for a single
    sample (on the model's device, float32), including its second image view and its
    ``negatives`` mined captions when the run embeds them.

    Captions fill all ``context_length`` columns and the trailing-padding trim
    (``model.trim_text``, models/text_trim.py) is off for the pass, so the text tower counts
    the configured context length: the model FLOPs of a padded caption, whatever a batch's
    trim saves.  Attention's matmuls count on every SDPA backend (:func:`flop_counter`).
    Train mode, so patch dropout shrinks the count; the pass leaves no trace: the RNG is
    forked (the run's dropout stream is unchanged), every buffer (BatchNorm running
    statistics), the mode and the trim flag are restored.  A model with BatchNorm gets two
    samples (train-mode BatchNorm needs more than one value per channel) and the count is halved.
    """
    trim = getattr(model, "trim_text", None)
    has_bn = any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())
    n = 2 if has_bn else 1
    device = next(model.parameters()).device
    images = torch.zeros(n, 3, image_size, image_size, device=device)
    # (n, L): ids every vocabulary has (an HF or sentencepiece tower's is small); no column is
    # padding (pad id 0), and id 2 last is the argmax (EOT-pooled towers read the last column)
    tokens = torch.ones(n, context_length, dtype=torch.long, device=device)
    tokens[:, -1] = 2
    extra = {}
    if second_view and "visual" in towers:
        extra["images2"] = images.clone()
    if negatives and "text" in towers:
        extra["neg_texts"] = tokens[:, None].repeat(1, negatives, 1)  # (n, k, L)
    counter = flop_counter()
    try:
        with traceless_training(model), counter:  # modes, buffers and RNG restored after
            if trim is not None:
                model.trim_text = False  # type: ignore[assignment]  # nn.Module types attributes as Tensor | Module
            model(images if "visual" in towers else None, tokens if "text" in towers else None, **extra)
    finally:
        if trim is not None:
            model.trim_text = trim
    return float(counter.get_total_flops()) / n


def train_flops_per_sample(
    model: torch.nn.Module,
    image_size: int,
    context_length: int,
    *,
    second_view: bool = False,
    negatives: int = 0,
) -> float:
    """FLOPs of one training step for a single sample: forward and backward (about twice the
    forward: gradients of inputs and of weights) of each tower that trains, the forward alone of
    a fully locked one (LiT: no gradient flows into it, so it has no backward at all).  A partly
    locked tower counts as trainable (its backward stops at the lowest unlocked layer; this
    over-counts it, never under-counts).  Text at the full ``context_length``
    (:func:`forward_flops_per_sample`); ViT-B-16 at 224 px and 77 tokens: ~123 GFLOP."""
    fully_locked = getattr(model, "fully_locked", None)  # a TwoTower's (models/two_tower.py)
    locked = set(fully_locked()) if fully_locked is not None else set()
    return sum(
        (1 if tower in locked else 3)
        * forward_flops_per_sample(
            model, image_size, context_length, second_view=second_view, negatives=negatives, towers=(tower,)
        )
        for tower in ("visual", "text")
    )


def matmul_dtype(cfg, device: torch.device | str) -> str:
    """The dtype a run's matmuls run in, one of :data:`DTYPES`, from its config: train.precision's
    autocast (bf16 / fp16), else deepspeed.precision's low-precision weights (their inputs are
    cast too), else fp32 tensors: TF32 on a CUDA device with train.tf32 (mmalign/run/tf32.py sets
    it there only), exact fp32 otherwise (CPU)."""
    for precision in (cfg.train.precision, cfg.deepspeed.precision):
        if precision in ("bf16", "fp16"):
            return precision
    return "tf32" if cfg.train.tf32 and torch.device(device).type == "cuda" else "fp32"


def _known_gpu(device: torch.device) -> tuple[str, dict[str, float]] | None:
    name = torch.cuda.get_device_name(device)
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):  # "H100 PCIe" before "H100"
        if key in name:
            return key, GPU_PEAK_TFLOPS[key]
    return None


def peak_tflops(device: torch.device | str, configured: float, dtype: str = "bf16") -> float | None:
    """Peak TFLOP/s of one device for MFU: ``configured`` (monitor.peak_tflops) when > 0, else
    a known GPU's dense peak in ``dtype`` (:data:`DTYPES`), else None (a CPU: they vary too
    much; an unknown GPU, or a dtype the GPU has no units for)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, not {dtype!r}")
    if configured > 0:
        return float(configured)
    device = torch.device(device)
    if device.type == "cuda":
        known = _known_gpu(device)
        if known is not None:
            return known[1].get(dtype)
    return None


def describe_peak(device: torch.device | str, configured: float, dtype: str) -> str:
    """One line for the run's log: which peak MFU is taken over, or why there is none."""
    device = torch.device(device)
    peak = peak_tflops(device, configured, dtype)
    if configured > 0:
        return f"MFU over monitor.peak_tflops = {peak:g} TFLOP/s per device (matmuls in {dtype})"
    known = _known_gpu(device) if peak is not None else None  # peak came from a known GPU
    if known is not None:
        return (
            f"MFU over the {known[0]} dense {dtype} peak, {peak:g} TFLOP/s per device "
            f"(monitor.peak_tflops overrides)"
        )
    if device.type == "cpu":
        return f"no peak FLOP/s for a CPU (matmuls in {dtype}): logging achieved GFLOP/s, no MFU"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return f"no known {dtype} peak for {name}: no MFU (set monitor.peak_tflops)"


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
    packed = torch.stack(
        [
            loss.detach().reshape(()).double(),
            torch.tensor(float(data_wait_s), dtype=torch.float64, device=loss.device),
        ]
    )
    mdist.all_reduce_sum(packed)
    total: dict[str, int] = {}
    for counts in mdist.all_gather_object(dict(skipped)):
        for reason, count in counts.items():
            total[reason] = total.get(reason, 0) + int(count)
    return {
        "loss": float(packed[0]) / mdist.get_world_size(),
        "data_wait_s": float(packed[1]),
        **{f"skipped_samples/{k}": total[k] for k in sorted(total)},
    }


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
            alarms.append(
                f"{name} embeddings collapsing: effective rank {rank:.1f} < {min_rank_frac:g} x {dim}"
            )
    return alarms
