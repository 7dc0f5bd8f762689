"""The ZeRO stage DeepSpeed runs at: the configured one, except where ZeRO would partition nothing.

ZeRO-1 partitions the optimizer state over the data-parallel ranks, ZeRO-2 the gradients
too. With one process there is nothing to partition, yet DeepSpeed's stage-1/2 optimizer
still does all of its bookkeeping every step: a copy of every gradient into reduce buckets
and a flat partition, an "all-reduce" over one rank, a float64 cast per tensor for the
global norm (and a host read of it), a second fp32 copy of every weight that it steps and
copies back into the module. One process with fp32 weights therefore runs at stage 0,
where the torch optimizer steps the module's own parameters (and the engine skips
DeepSpeed's gradient averaging over one rank, mmalign.run.engine).

The update is the same: the optimizers are elementwise or per tensor, so without gradient
clipping AdamW, SGD and LAMB give the same weights bit for bit; with clipping the global
norm is summed in another order (ZeRO-1/2: float64 per tensor; ZeRO-0: float32) and the
weights agree to float32 rounding (tests/dist/test_one_rank_zero.py).

Kept at the configured stage:

* bf16 / fp16 weights: ZeRO-0 cannot accumulate their gradients in fp32 (DeepSpeed raises;
  :func:`mmalign.config.grad_accum_dtype`), and the fp32 master copy is what ZeRO gives them;
* ZeRO-3: a user asking for it on one GPU may rely on its parameter partitioning with offload;
* any ``deepspeed.extra.zero_optimization`` key beyond the communication knobs of
  :data:`MOOT_ON_ONE_RANK` (``offload_optimizer``, ``zenflow``, ...): the user asked for
  ZeRO's own machinery.

Checkpoints stay interchangeable: a one-process run of a ``zero_stage: 1`` config writes a
ZeRO-0 checkpoint (the module and the torch optimizer's per-parameter state in its
model-states file), which :mod:`mmalign.run.reshard` re-cuts into ZeRO-1/2 partitions when the
run resumes on several ranks, and a several-rank ZeRO-1/2 checkpoint is consolidated back
into per-parameter state when it resumes on one.
"""

from __future__ import annotations

# ZeRO keys that only tune how partitions are communicated or bucketed: on one rank, at
# stage 0, there is nothing for them to act on, so they do not keep the configured stage.
MOOT_ON_ONE_RANK = frozenset(
    {
        "stage",
        "contiguous_gradients",
        "reduce_scatter",
        "reduce_bucket_size",
        "use_multi_rank_bucket_allreduce",
        "allgather_partitions",
        "allgather_bucket_size",
        "overlap_comm",
        "round_robin_gradients",
        "ignore_unused_parameters",
        "elastic_checkpoint",
        "load_from_fp32_weights",
    }
)


def effective_stage(cfg, world_size: int) -> tuple[int, str | None]:
    """(the ZeRO stage to run ``cfg`` at on ``world_size`` processes, the line to log when
    that is not ``deepspeed.zero_stage``; None otherwise). Equal on every rank."""
    ds = cfg.deepspeed
    stage = ds.zero_stage
    if world_size != 1 or stage not in (1, 2) or ds.precision != "fp32":
        return stage, None
    zero_extra = ds.extra.get("zero_optimization", {})
    kept = sorted(
        k for k in (zero_extra if isinstance(zero_extra, dict) else {}) if k not in MOOT_ON_ONE_RANK
    )
    if kept:  # e.g. offload_optimizer: ZeRO's own machinery, asked for by name
        return stage, None
    return 0, (
        f"deepspeed.zero_stage={stage} on one process with fp32 weights: running DeepSpeed at ZeRO-0 "
        f"(one rank has nothing to partition; the same update without ZeRO's bucket copies, second "
        f"fp32 weight copy and float64 norms); checkpoints still resume at ZeRO-{stage} on more ranks"
    )
