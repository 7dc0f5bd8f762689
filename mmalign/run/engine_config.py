"""Our config -> DeepSpeed's: the single source of the batch arithmetic.

::

    global batch = micro batch x gradient accumulation x world size

Without gradient caching the micro batch is the whole local batch (accumulation 1). With
caching, a micro batch is one chunk and the accumulation steps are the chunks
(:mod:`mmalign.run.engine` steps DeepSpeed after each chunk; it updates at the last one).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from mmalign.config import Config, ConfigError, grad_accum_dtype, valid_world_sizes
from mmalign.run.gradcache import chunk_sizes


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    world_size: int
    local_batch: int
    chunks: tuple[int, ...]  # chunk sizes of the local batch; (local_batch,) when caching is off

    @property
    def micro_batch(self) -> int:
        return self.chunks[0]

    @property
    def accumulation(self) -> int:
        return len(self.chunks)

    def describe(self) -> str:
        return (
            f"global batch {self.global_batch} = micro batch {self.micro_batch} x accumulation "
            f"{self.accumulation} x world size {self.world_size}"
            + ("" if self.local_batch % self.micro_batch == 0 else f" (last chunk {self.chunks[-1]})")
        )


def plan_batch(cfg: Config, world_size: int) -> BatchPlan:
    t = cfg.train
    if t.global_batch_size % world_size:
        raise ConfigError(
            f"config key 'train.global_batch_size'={t.global_batch_size} is not divisible "
            f"by the world size {world_size}: {valid_world_sizes(t.global_batch_size)}"
        )
    if not isinstance(t.grad_cache_chunk_size, int):  # auto: a memory measurement, made before the engine
        raise ValueError(
            "train.grad_cache_chunk_size: auto is resolved before the engine is built "
            "(mmalign.run.memory_plan.resolve_grad_cache_chunk), not by plan_batch"
        )
    local = t.global_batch_size // world_size
    return BatchPlan(
        t.global_batch_size, world_size, local, tuple(chunk_sizes(local, t.grad_cache_chunk_size))
    )


def ds_config(cfg: Config, plan: BatchPlan, stage: int | None = None) -> dict:
    """Our config -> DeepSpeed's (the single source of the batch arithmetic).

    ``stage``: the ZeRO stage to run (:func:`mmalign.run.zero_stage.effective_stage`); None =
    deepspeed.zero_stage as configured."""
    configured = cfg.deepspeed.zero_stage
    stage = configured if stage is None else stage
    precision = cfg.deepspeed.precision
    if precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("config key 'deepspeed.precision': fp16 needs a GPU (use bf16 or fp32 on CPU)")
    conf: dict[str, Any] = {
        # DeepSpeed checks micro x accumulation x world == train_batch_size; with an
        # uneven last chunk the nominal micro batch is the first chunk's size.
        "train_batch_size": plan.micro_batch * plan.accumulation * plan.world_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
        "gradient_clipping": float(cfg.train.grad_clip),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
    }
    accum = grad_accum_dtype(cfg)
    if accum is not None:
        # bf16/fp16 weights: sum the chunks' gradients in fp32 (DeepSpeed's default is the
        # weight dtype; at ZeRO-1 this selects its BF16_Optimizer). config.validate refuses
        # ZeRO-0 low-precision weights with more than one micro-step.
        conf["data_types"] = {"grad_accum_dtype": accum}
    if precision != "fp32":
        # ... and average them over ranks in fp32: DeepSpeed's default reduces in the weight
        # dtype, which rounds the fp32 sum to bf16 even on one rank and sums ranks in bf16.
        conf["communication_data_type"] = "fp32"
    if stage == 3:
        # Tiny towers: do not keep whole-model copies around for prefetch heuristics.
        conf["zero_optimization"].update({"stage3_param_persistence_threshold": 0})
    # config.validate refused extra keys that contradict the typed ones
    conf = _merged(conf, cfg.deepspeed.extra)
    if stage != configured:
        # ZeRO-0 in place of ZeRO-1/2 on one rank: the extra ZeRO keys left are communication
        # knobs (zero_stage.MOOT_ON_ONE_RANK), with nothing to act on; the stage is ours
        conf["zero_optimization"] = {"stage": stage}
    return conf


def _merged(base: dict, extra: dict) -> dict:
    """``extra`` merged into ``base`` recursively: mappings merge, other values replace."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out
