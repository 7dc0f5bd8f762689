"""ZeRO-1/2 on one process with fp32 weights runs DeepSpeed at ZeRO-0 (mmalign/run/zero_stage.py).

* Which configs drop to ZeRO-0 (one process, fp32 weights, stage 1 or 2, no ZeRO machinery asked
  for by name) and which keep their stage (bf16 / fp16 weights, ZeRO-3, offload, several ranks).
* The same step as the current path (DeepSpeed's real ZeRO-1/2 on one rank, forced here): AdamW,
  SGD with momentum and LAMB give the same gradients and weights bit for bit without clipping, and
  to float32 rounding with it (the global norm is summed in another order); AdamW also against a
  plain-torch reference (naive CLIP loss, torch.optim.AdamW), gradients and weights.
* Checkpoints across world sizes: a one-process run of a zero_stage 1 / 2 config (ZeRO-0 underneath)
  resumes on 2 ranks at ZeRO-1 / 2 and a 2-rank checkpoint resumes on one process, each continuing
  as the uninterrupted run (<= 1e-5 relative, the reduction order apart), with the optimizer state
  carried over bit for bit; ``consolidate_checkpoint`` (export) reads the one-process checkpoint.
  LAMB both ways: tests/run/test_reshard_engine.py.
"""

from __future__ import annotations

import pytest
import torch

from mmalign.config import load_config
from tests.harness import engine_batch, engine_cfg, max_rel_error, naive_clip_loss, run_ranks


def _stage(*overrides: str, world: int = 1):
    from mmalign.run.zero_stage import effective_stage

    return effective_stage(load_config(None, ["train.global_batch_size=8", *overrides]), world)


def test_which_configs_run_zero0_on_one_process():
    for stage in (1, 2):
        got, line = _stage(f"deepspeed.zero_stage={stage}")
        assert got == 0 and f"deepspeed.zero_stage={stage}" in line and "ZeRO-0" in line and "\n" not in line
        # communication knobs are moot on one rank
        assert (
            _stage(
                f"deepspeed.zero_stage={stage}",
                "deepspeed.extra.zero_optimization.overlap_comm=true",
                "deepspeed.extra.zero_optimization.reduce_bucket_size=1000",
            )[0]
            == 0
        )
    kept = [
        ("deepspeed.zero_stage=0",),
        ("deepspeed.zero_stage=3",),  # parameter partitioning (with offload) may be what the user wants
        ("deepspeed.zero_stage=1", "deepspeed.precision=bf16"),  # ZeRO-0 cannot sum bf16 gradients in fp32
        ("deepspeed.zero_stage=2", "deepspeed.precision=bf16"),
        ("deepspeed.zero_stage=1", "deepspeed.extra.zero_optimization.offload_optimizer.device=cpu"),
        ("deepspeed.zero_stage=2", "deepspeed.extra.zero_optimization.zenflow.topk_ratio=0.1"),
    ]
    for overrides in kept:
        configured = int(overrides[0].split("=")[1])
        assert _stage(*overrides) == (configured, None), overrides
    assert _stage("deepspeed.zero_stage=1", world=2) == (1, None)


def test_the_deepspeed_config_at_zero0_keeps_no_zero_knobs():
    from mmalign.run.engine import ds_config, plan_batch

    cfg = load_config(
        None,
        [
            "train.global_batch_size=8",
            "deepspeed.zero_stage=2",
            "deepspeed.extra.zero_optimization.overlap_comm=true",
        ],
    )
    as_configured = ds_config(cfg, plan_batch(cfg, 1))["zero_optimization"]
    assert as_configured == {"stage": 2, "overlap_comm": True}
    assert ds_config(cfg, plan_batch(cfg, 1), stage=0)["zero_optimization"] == {"stage": 0}


# --------------------------------------------------------------- the same step

CASES = {
    "adamw": ("train.optimizer=adamw", "train.weight_decay=0.1"),
    "adamw_clip": ("train.optimizer=adamw", "train.weight_decay=0.1", "train.grad_clip=0.5"),
    "sgd": ("train.optimizer=sgd", "train.momentum=0.9", "train.lr=0.05"),
    "sgd_clip": ("train.optimizer=sgd", "train.momentum=0.9", "train.lr=0.05", "train.grad_clip=0.5"),
    "lamb": ("train.optimizer=lamb", "train.weight_decay=0.1"),
    "lamb_clip": ("train.optimizer=lamb", "train.weight_decay=0.1", "train.grad_clip=0.5"),
}
STEPS = 2


def _train(cfg, seed: int, forced: bool) -> dict:
    """STEPS engine steps; with ``forced`` at the configured stage (the path before ZeRO-0 was
    chosen for one rank). The stage run, the gradients of each step and the weights after."""
    import logging

    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run import engine as engine_module

    real = engine_module.effective_stage
    if forced:
        engine_module.effective_stage = lambda cfg, world: (cfg.deepspeed.zero_stage, None)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("mmalign.run.engine")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        torch.manual_seed(seed)
        engine = engine_module.Engine(build_model(cfg.model), cfg)
    finally:
        engine_module.effective_stage = real
        logger.removeHandler(handler)
    objective = build_objective(cfg)
    grads = []
    for k in range(STEPS):
        engine.step(
            Batch(*engine_batch(seed + 1 + k, 0, 1)),
            objective,
            before_update=lambda: grads.append(engine.full_grads()),
        )
    return {
        "stage": (engine.stage, engine.ds.zero_optimization_stage()),
        "grads": grads,
        "params": engine.consolidated_state_dict(),
        "lines": lines,
    }


def _reference_adamw(cfg, seed: int) -> dict:
    """Plain torch: the naive CLIP loss over the whole batch, torch.optim.AdamW (no decay: one group)."""
    from mmalign.models import build_model

    torch.manual_seed(seed)
    model = build_model(cfg.model)
    t = cfg.train
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=tuple(t.betas), eps=t.eps, weight_decay=0.0, fused=True
    )
    grads = []
    for k in range(STEPS):  # warmup 1 of 4 steps: the lr stays t.lr for the first two
        opt.zero_grad()
        images, tokens = engine_batch(seed + 1 + k, 0, 1)
        out = model(images, tokens)
        naive_clip_loss(out.image, out.text, out.logit_scale).backward()
        grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        opt.step()
        model.clamp_logit_scale()
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _same_step_worker(rank: int, world: int, seed: int) -> dict:
    out = {}
    for stage in (1, 2):
        for name, extra in CASES.items():
            cfg = engine_cfg(stage, *extra)
            out[stage, name] = (_train(cfg, seed, forced=False), _train(cfg, seed, forced=True))
    cfg = engine_cfg(
        1, "train.optimizer=adamw", "train.weight_decay=0.0", "train.eps=1e-2"
    )  # no noise-sized steps
    out["reference"] = (_train(cfg, seed, forced=False), _reference_adamw(cfg, seed))
    return out


@pytest.mark.integration
def test_one_process_zero1_and_zero2_step_as_deepspeeds_zero_and_as_plain_torch(seed):
    out = run_ranks(_same_step_worker, 1, seed, pooled=True)[0]
    for (stage, name), (got, want) in ((k, v) for k, v in out.items() if k != "reference"):
        assert got["stage"] == (0, 0) and want["stage"] == (stage, stage), (stage, name)
        assert sum("running DeepSpeed at ZeRO-0" in line for line in got["lines"]) == 1, got["lines"]
        pairs = [*zip(got["grads"], want["grads"]), (got["params"], want["params"])]
        for g, w in pairs:
            assert g.keys() == w.keys()
            if name.endswith("_clip"):  # the global norm summed in another order: float32 rounding
                rel, where = max_rel_error(g, w)
                assert rel <= 1e-5, (stage, name, where, rel)
            else:
                assert all(torch.equal(g[k], w[k]) for k in w), (stage, name)
    got, ref = out["reference"]
    # the second step's gradients are taken at weights that differ at float32 rounding already, which a
    # small-norm gradient (a bias) magnifies in relative terms: 1e-4 there, 1e-5 elsewhere
    for g, w, tol in (
        (got["grads"][0], ref["grads"][0], 1e-5),
        (got["grads"][1], ref["grads"][1], 1e-4),
        (got["params"], ref["params"], 1e-5),
    ):
        rel, where = max_rel_error(g, w)
        assert rel <= tol, (where, rel, tol)


# ------------------------------------------------------------- across world sizes

RESUME_CASES = ((1, "adamw"), (2, "sgd"))  # LAMB (stages 1, 2 and 3): tests/run/test_reshard_engine.py
RESUME_STEPS = 3  # saved after step 2; the resume takes step 3


def _state_by_name(engine) -> dict:
    """The ZeRO-0 engine's optimizer state per parameter name (tensors only)."""
    params = dict(engine.named_parameters())
    by_id = {id(p): n for n, p in params.items()}
    return {
        by_id[id(p)]: {k: v.clone() for k, v in s.items() if torch.is_tensor(v) and v.dim() > 0}
        for p, s in engine.base_optimizer.state.items()
    }


def _resume_worker(rank: int, world: int, ckpt_dir: str, train: bool, load_from: int) -> dict:
    from mmalign.data.batch import Batch
    from mmalign.dist import distributed as mdist
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine, consolidate_checkpoint

    seed, results = 7, {}
    for stage, optimizer in RESUME_CASES:
        extra = (
            ("train.momentum=0.9", "train.lr=0.05")
            if optimizer == "sgd"
            else ("train.grad_clip=0.5", "train.eps=1e-2")
        )  # eps: no noise-sized Adam steps
        cfg = engine_cfg(stage, f"train.optimizer={optimizer}", "train.weight_decay=0.1", *extra)
        objective = build_objective(cfg)
        here = f"{ckpt_dir}/w{world}_z{stage}"

        def step(engine, k):
            engine.step(Batch(*engine_batch(seed + 1 + k, rank, world)), objective)

        if train:
            torch.manual_seed(seed)
            engine = Engine(build_model(cfg.model), cfg)
            results[stage, "stage"] = engine.stage
            for k in range(RESUME_STEPS):
                step(engine, k)
                if k == RESUME_STEPS - 2:
                    engine.save_checkpoint(here, "ckpt")
                    if world == 1:  # ZeRO-0 underneath: its state per parameter, and what export reads
                        results[stage, "saved_state"] = _state_by_name(engine)
                        results[stage, "saved_weights"] = engine.consolidated_state_dict()
                        results[stage, "exported"] = consolidate_checkpoint(here, "ckpt")
            results[stage, "lr"] = engine.lr
            results[stage, "uninterrupted"] = engine.consolidated_state_dict()
        if load_from:
            there = f"{ckpt_dir}/w{load_from}_z{stage}"
            torch.manual_seed(seed + 99)  # other initial weights: everything must come from the checkpoint
            engine = Engine(build_model(cfg.model), cfg)
            engine.load_checkpoint(there, "ckpt")
            if world == 1:  # ZeRO-0 loaded from ZeRO partitions: the moments, as the 2 ranks held them
                keys = sorted({k for s in _state_by_name(engine).values() for k in s})
                results[stage, "loaded_state"] = _state_by_name(engine)
                results[stage, "source_state"] = {
                    k: consolidate_checkpoint(there, "ckpt", state_key=k) for k in keys
                }
            else:  # ZeRO partitions loaded from ZeRO-0: saved again, consolidated as DeepSpeed stores them
                engine.save_checkpoint(f"{ckpt_dir}/again_z{stage}", "ckpt")
                mdist.barrier()
                keys = ["momentum_buffer"] if optimizer == "sgd" else ["exp_avg", "exp_avg_sq"]
                results[stage, "resaved_state"] = {
                    k: consolidate_checkpoint(f"{ckpt_dir}/again_z{stage}", "ckpt", state_key=k) for k in keys
                }
            step(engine, RESUME_STEPS - 1)
            results[stage, "resumed_lr"] = engine.lr
            results[stage, "resumed"] = engine.consolidated_state_dict()
    return results


@pytest.mark.integration
def test_one_process_zero0_checkpoints_resume_on_two_ranks_and_back(tmp_path):
    ckpt = str(tmp_path)
    one = run_ranks(_resume_worker, 1, ckpt, True, 0, pooled=True)[0]
    two = two_from_one = run_ranks(_resume_worker, 2, ckpt, True, 1, pooled=True)[0]
    one_from_two = run_ranks(_resume_worker, 1, ckpt, False, 2, pooled=True)[0]
    for stage, optimizer in RESUME_CASES:
        assert one[stage, "stage"] == 0 and two[stage, "stage"] == stage
        # export reads the one-process (ZeRO-0) checkpoint
        exported, saved = one[stage, "exported"], one[stage, "saved_weights"]
        assert all(torch.equal(exported[k], v) for k, v in saved.items()), stage
        for got, want, how in ((one_from_two, two, "2 -> 1"), (two_from_one, one, "1 -> 2")):
            rel, name = max_rel_error(got[stage, "resumed"], want[stage, "uninterrupted"])
            assert rel <= 1e-5, (stage, optimizer, how, name, rel)
            assert got[stage, "resumed_lr"] == pytest.approx(want[stage, "lr"], rel=1e-12), (stage, how)
        # the optimizer state carried over bit for bit, both ways
        loaded, source = one_from_two[stage, "loaded_state"], one_from_two[stage, "source_state"]
        assert loaded and all(
            torch.equal(loaded[n][k], source[k][n].view_as(loaded[n][k])) for n in loaded for k in loaded[n]
        ), (stage, "2 -> 1")
        saved, resaved = one[stage, "saved_state"], two_from_one[stage, "resaved_state"]
        assert saved and all(
            torch.equal(resaved[k][n].view_as(saved[n][k]), saved[n][k]) for n in saved for k in saved[n]
        ), (stage, "1 -> 2")
        same, _ = max_rel_error(one[stage, "uninterrupted"], two[stage, "uninterrupted"])
        assert same <= 1e-5  # the premise: with the same global batch, 1 and 2 ranks train the same weights
