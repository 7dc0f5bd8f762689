"""``Engine.step``'s one calling convention and the logit-scale clamp's one owner (issue 40).

The step takes the :class:`~mmalign.objective.Objective` and asks it for this batch's loss, its
stats only when told (``stats``: the loop asks at log steps only). The range of the logit scale
is the model's (``TwoTower.log_scale_range``); the engine clamps its own and ZeRO's copies into
that range, not into one of its own read from the config."""

from __future__ import annotations

import math

import pytest

from tests.harness import engine_batch, engine_cfg, run_ranks

pytestmark = pytest.mark.integration

MODEL_MAX = 20.0  # the model's max_logit_scale; the engine's config keeps the default 100
START = 50.0  # the scale before the step: inside the config's range, outside the model's


def _worker(rank: int, world: int, seed: int) -> dict:
    import torch

    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    out: dict = {}
    for stage in (0, 3):
        cfg = engine_cfg(stage)
        model_cfg = engine_cfg(stage, f"model.max_logit_scale={MODEL_MAX}").model
        torch.manual_seed(seed)
        model = build_model(model_cfg)
        with torch.no_grad():
            model.logit_scale.fill_(math.log(START))
        engine = Engine(model, cfg)
        objective = build_objective(cfg, world)
        quiet = engine.step(Batch(*engine_batch(seed, rank, world)), objective, stats=False)
        scale = engine.consolidated_state_dict()["logit_scale"]  # the first update took it past the max
        told = engine.step(Batch(*engine_batch(seed + 1, rank, world)), objective, stats=True)
        out[stage] = {"quiet": dict(quiet.stats), "told": sorted(told.stats), "scale": float(scale.exp())}
    return out


def test_the_step_takes_the_objective_and_the_models_clamp(seed):
    results = run_ranks(_worker, 1, seed, pooled=True)[0]
    for stage, got in results.items():
        assert got["quiet"] == {}, stage  # no stats asked: none computed (no all_reduce, no host read)
        assert got["told"], stage  # asked: the loss terms' stats
        # open_clip's clamp, written out: log-scale into [0, ln max] with the model's max
        want = math.exp(min(max(math.log(START), 0.0), math.log(MODEL_MAX)))
        assert got["scale"] == pytest.approx(want, rel=1e-6), stage
