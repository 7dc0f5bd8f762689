"""train.ema_decay (issue 42, point 5): the EMA of the weights equals a naive EMA over the same
steps, on 1 and on 2 ranks and at every ZeRO stage, its per-rank pieces carry over to another
world size, and an out-of-range decay is one line.

The naive reference folds full snapshots of the fp32 master weights, taken after each step
(``Engine.full_params(master=True)``), with the formula of the docs written out here:
``d_t = min(d, (1 + t) / (10 + t))``, ``ema = ema * d_t + theta * (1 - d_t)`` in float32.
Elementwise float32 products do not depend on how the elements are split over ranks, so the
comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import cli_main, engine_batch, engine_cfg, run_ranks

STAGES = (0, 1, 2, 3)
STEPS = 3
DECAY = 0.9


def _naive_decay(t: int) -> float:
    return min(DECAY, (1 + t) / (10 + t))


def _worker(rank: int, world: int, ema_dir: str, restore_from: int) -> dict:
    """Per ZeRO stage: STEPS steps with an Ema beside a naive one; the consolidated EMA, the
    naive one, and this rank's state (written to ``ema_dir``). With ``restore_from``: a fresh
    engine restores the EMA that ``restore_from`` ranks wrote, and consolidates it."""
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.ema import Ema
    from mmalign.run.engine import Engine

    out = {}
    for stage in STAGES:
        cfg = engine_cfg(stage, "train.optimizer=adamw", "train.weight_decay=0.1")
        objective = build_objective(cfg)
        torch.manual_seed(5)
        engine = Engine(build_model(cfg.model), cfg)
        ema = Ema(engine, DECAY, warmup=True)
        trainable = [n for n, p in engine.named_parameters() if p.requires_grad]
        naive = {n: engine.full_params(master=True)[n].cpu().clone() for n in trainable}
        for k in range(STEPS):
            result = engine.step(Batch(*engine_batch(20 + k, rank, world)), objective)
            assert not result.skipped
            ema.update()
            snap = engine.full_params(master=True)  # a collective at ZeRO >= 1
            d = _naive_decay(k)
            for n in trainable:
                naive[n] = naive[n] * d + snap[n].cpu().float() * (1.0 - d)
        raw = engine.consolidated_state_dict()
        out[stage, "ema"] = ema.consolidated_state_dict()
        out[stage, "naive"] = naive
        out[stage, "raw"] = raw
        out[stage, "stage"] = engine.stage
        torch.save(ema.state_dict(), f"{ema_dir}/w{world}_z{stage}_rank{rank}.pt")
        if restore_from:
            import shutil
            import tempfile
            from pathlib import Path

            from mmalign.layout.run_dir import ema_file

            with tempfile.TemporaryDirectory() as step_dir:
                for r in range(restore_from):
                    shutil.copy(
                        f"{ema_dir}/w{restore_from}_z{stage}_rank{r}.pt", Path(step_dir) / ema_file(r)
                    )
                torch.manual_seed(77)  # other weights: the EMA must come from the files
                fresh = Ema(Engine(build_model(cfg.model), cfg), DECAY)
                fresh.restore(Path(step_dir))
                state = fresh.consolidated_state_dict()  # a collective
                out[stage, "restored"] = {n: state[n] for n in trainable}
                out[stage, "restored_updates"] = fresh.updates
    return out


def _check_against_naive(results: dict, world: int) -> None:
    for stage in STAGES:
        ema, naive, raw = results[stage, "ema"], results[stage, "naive"], results[stage, "raw"]
        assert set(naive) <= set(ema)
        for name, want in naive.items():
            assert torch.equal(ema[name], want), (world, stage, name, (ema[name] - want).abs().max())
        # the premise: after 3 steps the average is not the raw weights (a test that could not fail)
        assert any(not torch.equal(ema[n], raw[n]) for n in naive), (world, stage)
        # frozen weights and buffers: the raw ones
        for name in set(raw) - set(naive):
            assert torch.equal(ema[name], raw[name]), (world, stage, name)


@pytest.mark.integration
def test_ema_equals_a_naive_ema_on_1_and_2_ranks_and_carries_over_world_sizes(tmp_path):
    one = run_ranks(_worker, 1, str(tmp_path), 0, pooled=True)[0]
    _check_against_naive(one, 1)
    two = run_ranks(_worker, 2, str(tmp_path), 1, pooled=True)
    assert [two[0][s, "stage"] for s in STAGES] == [0, 1, 2, 3]  # ZeRO-1/2/3 do partition on 2 ranks
    _check_against_naive(two[0], 2)
    for stage in STAGES:  # every rank holds the same consolidated EMA
        assert all(
            torch.equal(two[0][stage, "ema"][n], two[1][stage, "ema"][n]) for n in two[0][stage, "ema"]
        )
        # 1 -> 2 ranks: the pieces one rank wrote, re-cut for two, give the same EMA
        for name in one[stage, "naive"]:
            assert torch.equal(two[0][stage, "restored"][name], one[stage, "ema"][name]), (stage, name)
        assert two[0][stage, "restored_updates"] == STEPS
    back = run_ranks(_worker, 1, str(tmp_path), 2, pooled=True)[0]  # 2 -> 1
    for stage in STAGES:
        for name in two[0][stage, "naive"]:
            assert torch.equal(back[stage, "restored"][name], two[0][stage, "ema"][name]), (stage, name)


def test_a_decay_outside_0_1_is_one_line(tmp_path):
    for bad in ("1.0", "-0.5", "1.5"):
        res = cli_main("train", "--output", tmp_path / "run", "--set", f"train.ema_decay={bad}")
        assert res.returncode == 2, res.stderr[-2000:]
        lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "train.ema_decay" in lines[0], res.stderr


def test_naive_decay_warms_up():
    from mmalign.run.ema import decay_at

    assert [decay_at(0.9, True, t) for t in range(3)] == [0.1, 2 / 11, 3 / 12]
    assert decay_at(0.9, True, 1000) == 0.9
    assert decay_at(0.9, False, 0) == 0.9
