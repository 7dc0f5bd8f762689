"""The loader position across a change of world size or worker count (mmalign.data.resharding).

The order is a function of the global batch (one lane per row), so a resume on any layout
continues the uninterrupted run's batches exactly: the naive reference is one process
reading the global batch with no checkpoint at all.  A position written before lanes
(version 2: one stream per rank and worker) restarts its lanes, as its phrase says.  The
ranks' loaders run in this process (``data.workers=0`` or DataLoader workers), so no process
group is needed.
"""

from __future__ import annotations

import json
import random

import pytest

from mmalign.data.resharding import RESTART, convert
from tests.data.test_data_loader import loader_for, make_shards, take

GLOBAL_BATCH = 8


def _loaders(spec, world, mode, seed, workers=0, states=None, step=0):
    loaders = [
        loader_for(
            spec, mode=mode, workers=workers, batch=GLOBAL_BATCH // world, seed=seed, rank=r, world_size=world
        )
        for r in range(world)
    ]
    if states is not None:
        for r, loader in enumerate(loaders):
            state, how = convert(json.loads(json.dumps(states)), loader.spec, r, step)
            assert "data order unchanged" in how, how
            loader.load_state_dict(state)
    return loaders


def _global(loaders, n):
    """The global batches of ``loaders`` (one per rank, in rank order): rows concatenated."""
    per_rank = [take(loader, n) for loader in loaders]
    return [[k for batches in per_rank for k in batches[t].keys] for t in range(n)]


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
@pytest.mark.parametrize("old,new", [((2, 2), (1, 0)), ((1, 0), (4, 1)), ((4, 0), (2, 3))])
def test_a_resume_on_another_layout_continues_the_same_order(tmp_path, mode, old, new, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [rng.randint(5, 13) for _ in range(4)], rng)
    spec = f"{tmp_path}/{{00000..00003}}.tar"
    seed, cut, total = rng.randrange(1000), rng.randint(1, 4), 9  # 72 rows: past epoch 0 (<= 52 samples)
    reference = _global(_loaders(spec, 1, mode, seed), total)  # one process, never interrupted

    before = _loaders(spec, old[0], mode, seed, workers=old[1])
    head = _global(before, cut)
    states = [loader.state_dict() for loader in before]
    after = _loaders(spec, new[0], mode, seed, workers=new[1], states=states, step=cut)
    assert head + _global(after, total - cut) == reference


def test_a_pre_lane_position_restarts_the_lanes_and_says_so(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [rng.randint(6, 12) for _ in range(3)], rng)
    spec = f"{tmp_path}/{{00000..00002}}.tar"
    loader = _loaders(spec, 1, "resampled", 5)[0]
    old = {
        "version": 2,
        "mode": "resampled",
        "seed": 5,
        "rank": 0,
        "world_size": 2,
        "workers": 1,
        "batch_size": 4,
        "shards": loader.state_dict()["shards"],
        "consumed": 3,
        "slots": {"0": {"epoch": 0, "skipped": {"corrupt_image": 2}}, "1": {"epoch": 0, "skipped": {}}},
    }
    state, how = convert([old], loader.spec, 0, 3)
    assert "data order restarted at step 3" in how
    assert all(s["epoch"] == RESTART + 3 for s in state["lane_states"].values())  # draws never reached before
    loader.load_state_dict(state)
    assert loader.skipped() == {"corrupt_image": 2}  # the run's skip totals continue
    restarted = [b.keys for b in take(loader, 3)]
    fresh = [b.keys for b in take(_loaders(spec, 1, "resampled", 5)[0], 3)]
    assert restarted != fresh  # not a replay of the run's start
    same_rank = _loaders(spec, 1, "resampled", 5)[0]
    same_rank.load_state_dict(old)  # no world-size change: the loader converts it itself, alike
    assert [b.keys for b in take(same_rank, 3)] == restarted


def test_a_pre_lane_position_keeps_each_ranks_skip_counts(tmp_path, seed, caplog):
    """Same world size (no merge): each rank converts its own old state; its skips stay its own."""
    import logging

    rng = random.Random(seed)
    make_shards(tmp_path, [rng.randint(6, 12) for _ in range(3)], rng)
    spec = f"{tmp_path}/{{00000..00002}}.tar"
    ranks = _loaders(spec, 2, "epoch", 5)
    shards = ranks[0].state_dict()["shards"]
    with caplog.at_level(logging.WARNING, logger="mmalign.data"):
        for r, loader in enumerate(ranks):
            loader.load_state_dict(
                {
                    "version": 2,
                    "mode": "epoch",
                    "seed": 5,
                    "rank": r,
                    "world_size": 2,
                    "workers": 1,
                    "batch_size": 4,
                    "shards": shards,
                    "consumed": 2,
                    "slots": {str(r): {"epoch": 0, "skipped": {"corrupt_image": r + 1}}},
                }
            )
    assert [loader.skipped() for loader in ranks] == [{"corrupt_image": 1}, {"corrupt_image": 2}]
    said = [r.getMessage() for r in caplog.records if "predates lanes" in r.getMessage()]
    assert len(said) == 1 and "restarts at step 2" in said[0]  # rank 0 says it, once
