"""Engine checkpoints on all ranks (ZeRO 0-3), consolidation, bf16 and LAMB smoke runs."""

from __future__ import annotations

import math

import pytest
import torch

from tests.harness import engine_batch, engine_cfg, run_ranks

pytestmark = pytest.mark.integration


def _worker(rank, world, seed, ckpt_dir):
    from mmalign.data.batch import Batch
    from mmalign.dist import distributed as mdist
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine, consolidate_checkpoint

    results = {}

    def run(engine, batch_seed):
        objective = build_objective(engine.cfg)
        return engine.step(Batch(*engine_batch(batch_seed, rank, world)), objective)

    for stage in (0, 1, 2, 3):
        cfg = engine_cfg(stage)
        torch.manual_seed(seed)
        a = Engine(build_model(cfg.model), cfg)
        run(a, seed + 1)
        after_one = a.consolidated_state_dict()
        a.save_checkpoint(ckpt_dir, f"s{stage}", client_state={"step": 1})
        run(a, seed + 2)
        want = a.consolidated_state_dict()
        torch.manual_seed(seed + 99)  # a different init: everything must come from the checkpoint
        b = Engine(build_model(cfg.model), cfg)
        client = b.load_checkpoint(ckpt_dir, f"s{stage}")
        run(b, seed + 2)
        got = b.consolidated_state_dict()
        mdist.barrier()
        consolidated = consolidate_checkpoint(ckpt_dir, f"s{stage}") if rank == 0 else None
        results[stage] = (want, got, after_one, consolidated, client, b.lr, a.lr)

    # the temperature clamp reaches ZeRO's fp32 master copy: start above ln 100, step twice
    for stage in (0, 1, 2, 3):
        cfg = engine_cfg(stage, "model.init_logit_scale=5.0", "train.optimizer=sgd", "train.lr=1e-4")
        torch.manual_seed(seed)
        e = Engine(build_model(cfg.model), cfg)
        for k in range(2):
            run(e, seed + 10 + k)
        seen = float(e.forward(*engine_batch(seed, rank, world)).logit_scale.detach().reshape(-1)[0])
        results[f"clamp{stage}"] = (float(e.consolidated_state_dict()["logit_scale"].reshape(-1)[0]), seen)

    # precision and optimizer smoke: bf16 weights (ZeRO-2), bf16 autocast, LAMB under ZeRO-3
    for name, cfg, auto in (
        ("bf16_weights", engine_cfg(2, "deepspeed.precision=bf16"), None),
        (
            "bf16_autocast",
            engine_cfg(1, "train.precision=bf16"),
            lambda: torch.autocast("cpu", dtype=torch.bfloat16),
        ),
        ("lamb_zero3", engine_cfg(3, "train.optimizer=lamb"), None),
    ):
        torch.manual_seed(seed)
        e = Engine(build_model(cfg.model), cfg)
        before = e.consolidated_state_dict()
        objective = build_objective(cfg)
        res = e.step(Batch(*engine_batch(seed + 1, rank, world)), objective, autocast=auto)
        after = e.consolidated_state_dict()
        results[name] = (float(res.loss), before, after)
    return results


def test_checkpoint_resume_consolidation_and_precisions(tmp_path, seed):
    world = 2
    results = run_ranks(_worker, world, seed, str(tmp_path / "ckpt"), pooled=True)[0]
    for stage in (0, 1, 2, 3):
        want, got, after_one, consolidated, client, lr_b, lr_a = results[stage]
        assert client == {"step": 1} or client.get("step") == 1
        assert lr_b == pytest.approx(lr_a)  # the scheduler came back too
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-6, atol=1e-7, msg=f"stage {stage} {k}")
        assert consolidated.keys() >= {k for k in after_one if k in consolidated}
        for k, v in after_one.items():
            if k in consolidated:
                torch.testing.assert_close(consolidated[k], v, rtol=0, atol=0, msg=f"stage {stage} {k}")
        params = {k for k in after_one if not k.endswith("attn_mask")}
        assert params <= consolidated.keys()
    for stage in (0, 1, 2, 3):
        stored, seen = results[f"clamp{stage}"]
        assert stored <= math.log(100) + 1e-6, (stage, stored)
        # clamped to 100 after each update; the second update may lower it by one small SGD step
        assert 99.0 <= seen <= 100.0 + 1e-4, (stage, seen)
    for name in ("bf16_weights", "bf16_autocast", "lamb_zero3"):
        loss, before, after = results[name]
        assert torch.isfinite(torch.tensor(loss)), name
        assert all(v.dtype == torch.float32 for v in after.values() if v.is_floating_point()), name
        moved = sum(int(not torch.equal(before[k], after[k])) for k in before)
        assert moved > len(before) // 2, (name, moved)
