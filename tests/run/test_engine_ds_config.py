"""The generated DeepSpeed config: precision rules, ``deepspeed.extra`` merging and its
contradictions, and the JSON that rank 0 logs is the one DeepSpeed runs with."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from mmalign.config import ConfigError, load_config, validate
from tests.harness import run_ranks


def _conf(*overrides: str, world: int = 1) -> dict:
    from mmalign.run.engine import ds_config, plan_batch

    cfg = load_config(None, list(overrides))
    return ds_config(cfg, plan_batch(cfg, world))


def _one_line_error(overrides: list[str], *names: str, world: int = 1) -> str:
    with pytest.raises(ConfigError) as err:
        validate(load_config(None, overrides), world_size=world) if world > 1 else load_config(
            None, overrides
        )
    msg = str(err.value)
    assert "\n" not in msg and all(n in msg for n in names), msg
    return msg


def test_low_precision_weights_accumulate_and_reduce_in_fp32():
    for precision in ("bf16",) + (("fp16",) if torch.cuda.is_available() else ()):
        for stage in (1, 2, 3):
            conf = _conf(
                f"deepspeed.precision={precision}",
                f"deepspeed.zero_stage={stage}",
                "train.global_batch_size=64",
                "train.grad_cache_chunk_size=8",
            )
            assert conf["data_types"] == {"grad_accum_dtype": "fp32"}
            assert conf["communication_data_type"] == "fp32"
    # fp32 weights: DeepSpeed's defaults are fp32 already
    conf = _conf("deepspeed.zero_stage=1", "train.grad_cache_chunk_size=8")
    assert "data_types" not in conf and "communication_data_type" not in conf
    # ZeRO-0 with bf16 weights and one micro-step: nothing is summed, DeepSpeed's default stands
    # (it raises NotImplementedError for ZeRO-0 with bf16 weights and fp32 accumulation)
    conf = _conf("deepspeed.precision=bf16", "deepspeed.zero_stage=0")
    assert "data_types" not in conf and conf["gradient_accumulation_steps"] == 1


def test_precision_combinations_refused_in_one_line():
    # ZeRO-0 low-precision weights with several chunks: DeepSpeed cannot accumulate them in fp32
    msg = _one_line_error(
        ["deepspeed.precision=bf16", "train.global_batch_size=64", "train.grad_cache_chunk_size=8"],
        "deepspeed.precision",
        "zero_stage>=1",
        "train.precision=bf16",
    )
    assert "8 gradient-cache chunks" in msg
    # ... also when the chunks only appear with the real world size (validate at launch)
    load_config(
        None, ["deepspeed.precision=bf16", "train.global_batch_size=16", "train.grad_cache_chunk_size=16"]
    )
    _one_line_error(
        ["deepspeed.precision=bf16", "train.global_batch_size=16", "train.grad_cache_chunk_size=4"],
        "deepspeed.precision",
        world=2,
    )
    # a chunk as large as the local batch is one micro-step: allowed
    load_config(
        None, ["deepspeed.precision=bf16", "train.global_batch_size=16", "train.grad_cache_chunk_size=16"]
    )
    # fp16 autocast without DeepSpeed's loss scaler
    _one_line_error(["train.precision=fp16"], "train.precision", "deepspeed.precision=fp16")
    load_config(None, ["train.precision=fp16", "deepspeed.precision=fp16", "deepspeed.zero_stage=1"])


def test_extra_merges_recursively():
    conf = _conf(
        "deepspeed.zero_stage=2",
        "deepspeed.extra.zero_optimization.overlap_comm=true",
        "deepspeed.extra.zero_optimization.reduce_bucket_size=1000",
        "deepspeed.extra.steps_per_print=7",
    )
    assert conf["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000}
    assert conf["steps_per_print"] == 7
    conf = _conf("deepspeed.zero_stage=3", "deepspeed.extra.zero_optimization.overlap_comm=false")
    assert conf["zero_optimization"] == {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "overlap_comm": False,
    }
    # equal values of derived keys are allowed
    conf = _conf(
        "deepspeed.zero_stage=1",
        "deepspeed.extra.zero_optimization.stage=1",
        "train.grad_clip=5",
        "deepspeed.extra.gradient_clipping=5.0",
        "deepspeed.extra.bf16.enabled=false",
    )
    assert conf["zero_optimization"]["stage"] == 1 and conf["gradient_clipping"] == 5.0


@pytest.mark.parametrize(
    "override, typed",
    [
        ("deepspeed.extra.zero_optimization.stage=2", "deepspeed.zero_stage"),
        ("deepspeed.extra.bf16.enabled=true", "deepspeed.precision"),
        ("deepspeed.extra.bfloat16.enabled=true", "deepspeed.precision"),
        ("deepspeed.extra.fp16.enabled=true", "deepspeed.precision"),
        ("deepspeed.extra.bf16=true", "deepspeed.precision"),
        ("deepspeed.extra.zero_optimization=2", "deepspeed.zero_stage"),
        ("deepspeed.extra.train_batch_size=64", "train.global_batch_size"),
        ("deepspeed.extra.train_micro_batch_size_per_gpu=8", "train.grad_cache_chunk_size"),
        ("deepspeed.extra.gradient_accumulation_steps=4", "train.grad_cache_chunk_size"),
        ("deepspeed.extra.gradient_clipping=1.0", "train.grad_clip"),
        ("deepspeed.extra.data_types.grad_accum_dtype=bf16", "deepspeed.precision"),
        ("deepspeed.extra.communication_data_type=bf16", "deepspeed.precision"),
    ],
)
def test_extra_contradicting_a_typed_key_is_one_line_error(override, typed):
    key = override.split("=")[0]
    _one_line_error([override, "deepspeed.zero_stage=1"], key, typed)


def _log_worker(rank: int, world: int) -> dict:
    from mmalign.models import build_model
    from mmalign.run.engine import Engine

    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("mmalign.run.engine")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    cfg = load_config(
        None,
        [
            "model.preset=micro",
            "train.global_batch_size=8",
            "train.grad_cache_chunk_size=4",
            "deepspeed.zero_stage=2",
            "deepspeed.precision=bf16",
            "deepspeed.extra.zero_optimization.overlap_comm=true",
            "deepspeed.extra.zero_optimization.reduce_bucket_size=12345",
        ],
    )
    engine = Engine(build_model(cfg.model), cfg)
    logged = [r.getMessage() for r in records if r.getMessage().startswith("DeepSpeed config: ")]
    used = engine.ds._config
    return {
        "logged": logged,
        "ours": engine.ds_config,
        "passed": engine.ds.config,
        "used": (
            used.zero_optimization_stage,
            used.zero_config.overlap_comm,
            used.zero_config.reduce_bucket_size,
            str(engine.ds.get_data_types()[1]),
            str(engine.ds.communication_data_type),
            used.gradient_accumulation_steps,
        ),
    }


def test_rank0_logs_the_deepspeed_json_it_runs_with():
    out = run_ranks(_log_worker, 1, pooled=True)[0]
    (line,) = out["logged"]
    logged = json.loads(line.removeprefix("DeepSpeed config: "))
    assert logged == out["ours"] == out["passed"]
    assert logged["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 12345}
    assert out["used"] == (2, True, 12345, "torch.float32", "torch.float32", 2)
