"""An engine checkpoint resumes on a different world size at ZeRO 0, 1, 2 and 3.

The global batch of every step is the same whatever the world size (each rank takes
its slice), so a run resumed on another number of ranks must continue exactly as
the uninterrupted run: the weights after the step that follows the resume are
compared with the uninterrupted run's, <= 1e-5 relative (the two differ only in
reduction order; a lost or misplaced optimizer moment gives ~1e-2, a fresh optimizer
state ~1).  LAMB under ZeRO >= 1 (flat partitions with a per-tensor layout), AdamW
at ZeRO-0; 2 ranks -> 1 and 1 -> 2.  Reference: the uninterrupted run on the world
size the checkpoint was written by.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import engine_batch, engine_cfg, max_rel_error, run_ranks

pytestmark = pytest.mark.integration

CASES = ((0, "adamw"), (1, "lamb"), (2, "lamb"), (3, "lamb"))
STEPS = 3  # the checkpoint is written after step 2; the resume takes step 3


def _worker(rank: int, world: int, ckpt_dir: str, train: bool, load_from: int) -> dict:
    """Per case: with ``train``, train STEPS steps saving after STEPS-1 (the reference); when
    ``load_from`` names another world size, resume that world's checkpoint and take the last step."""
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    seed, results = 11, {}
    for stage, optimizer in CASES:
        cfg = engine_cfg(stage, f"train.optimizer={optimizer}", "train.weight_decay=0.1", "train.eps=1e-2")
        objective = build_objective(cfg)

        def step(engine, k):
            engine.step(Batch(*engine_batch(seed + 1 + k, rank, world)), objective)

        if train:
            torch.manual_seed(seed)
            engine = Engine(build_model(cfg.model), cfg)
            for k in range(STEPS):
                step(engine, k)
                if k == STEPS - 2:
                    engine.save_checkpoint(f"{ckpt_dir}/w{world}_z{stage}", "ckpt")
            results[stage, "lr"] = engine.lr
            results[stage, "uninterrupted"] = engine.consolidated_state_dict()
        if load_from:
            torch.manual_seed(seed + 99)  # other initial weights: everything must come from the checkpoint
            engine = Engine(build_model(cfg.model), cfg)
            engine.load_checkpoint(f"{ckpt_dir}/w{load_from}_z{stage}", "ckpt")
            step(engine, STEPS - 1)
            results[stage, "resumed_lr"] = engine.lr
            results[stage, "resumed"] = engine.consolidated_state_dict()
    return results


def test_resume_on_another_world_size_continues_exactly(tmp_path):
    ckpt = str(tmp_path)
    one = run_ranks(_worker, 1, ckpt, True, 0, pooled=True)[0]
    two = two_from_one = run_ranks(_worker, 2, ckpt, True, 1, pooled=True)[0]
    one_from_two = run_ranks(_worker, 1, ckpt, False, 2, pooled=True)[0]
    for stage, _ in CASES:
        for got, want, how in ((one_from_two, two, "2 -> 1"), (two_from_one, one, "1 -> 2")):
            rel, name = max_rel_error(got[stage, "resumed"], want[stage, "uninterrupted"])
            assert rel <= 1e-5, (stage, how, name, rel)
            assert got[stage, "resumed_lr"] == pytest.approx(want[stage, "lr"], rel=1e-12), (stage, how)
        # the premise: with the same global batch, 1 and 2 ranks train the same weights
        same, _ = max_rel_error(one[stage, "uninterrupted"], two[stage, "uninterrupted"])
        assert same <= 1e-5
