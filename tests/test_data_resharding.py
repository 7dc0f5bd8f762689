"""The loader position across a change of world size (mmalign.data.resharding).

Epoch mode: the samples consumed before the change and the epoch's samples read
after it are, together, every sample of the epoch exactly once.  Resampled mode:
the new streams are a deterministic function of (seed, step, layout) and are not
a replay of the run's first batches.  The ranks' loaders run in this process
(``data.workers=0``: one slot per rank), so no process group is needed.
"""

from __future__ import annotations

import json
import random

import pytest

from mmalign.data.resharding import convert
from tests.test_data_loader import loader_for, make_shards, take

GLOBAL_BATCH = 6


def _loaders(spec, world, mode, seed, states=None, step=0):
    loaders = [loader_for(spec, mode=mode, workers=0, batch=GLOBAL_BATCH // world, seed=seed, rank=r,
                          world_size=world) for r in range(world)]
    if states is not None:
        for r, loader in enumerate(loaders):
            state, how = convert(json.loads(json.dumps(states)), loader.spec, r, step)
            assert "data order changed" in how
            loader.load_state_dict(state)
    return loaders


@pytest.mark.parametrize("old_world,new_world", [(2, 1), (1, 2)])
@pytest.mark.parametrize("n_shards", [5, 1])  # 1: fewer shards than slots (slots split a shard by sample)
def test_epoch_mode_does_not_repeat_the_consumed_samples(tmp_path, old_world, new_world, n_shards, seed):
    rng = random.Random(seed)
    keys = make_shards(tmp_path, [rng.randint(5, 13) if n_shards > 1 else rng.randint(14, 24) for _ in range(n_shards)],
                       rng)
    spec = f"{tmp_path}/{{00000..{n_shards - 1:05d}}}.tar"
    seed, steps = rng.randrange(1000), rng.randint(1, len(keys) // GLOBAL_BATCH - 1)

    old = _loaders(spec, old_world, "epoch", seed)
    consumed = [k for loader in old for b in take(loader, steps) for k, e in zip(b.keys, b.epochs.tolist())
                if e == 0]
    states = [loader.state_dict() for loader in old]

    new = _loaders(spec, new_world, "epoch", seed, states, steps)
    per_rank = len(keys) // (GLOBAL_BATCH // new_world) + 2  # more than the rest of the epoch on any slot
    after = [k for loader in new for b in take(loader, per_rank) for k, e in zip(b.keys, b.epochs.tolist())
             if e == 0]
    assert not set(consumed) & set(after), "a consumed sample came again in the same epoch"
    assert sorted(consumed + after) == sorted(keys), "the epoch lost or repeated samples"

    # the converted position is itself resumable (the explicit plans travel in the state)
    again = _loaders(spec, new_world, "epoch", seed, states, steps)[0]
    head = take(again, 2)
    resumed = loader_for(spec, mode="epoch", workers=0, batch=GLOBAL_BATCH // new_world, seed=seed, rank=0,
                         world_size=new_world)
    resumed.load_state_dict(json.loads(json.dumps(again.state_dict())))
    reference = take(_loaders(spec, new_world, "epoch", seed, states, steps)[0], 5)
    assert [b.keys for b in head + take(resumed, 3)] == [b.keys for b in reference]


def test_resampled_mode_restarts_from_seed_step_and_layout(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [rng.randint(6, 12) for _ in range(3)], rng)
    spec = f"{tmp_path}/{{00000..00002}}.tar"
    old = _loaders(spec, 2, "resampled", 5)
    for loader in old:
        take(loader, 3)
    states = [loader.state_dict() for loader in old]

    def first(step):
        return [b.keys for b in take(_loaders(spec, 1, "resampled", 5, states, step)[0], 4)]

    assert first(3) == first(3)  # deterministic in (seed, step, layout)
    assert first(3) != first(4)
    fresh = [b.keys for b in take(_loaders(spec, 1, "resampled", 5)[0], 4)]
    assert first(3) != fresh  # not a replay of the run's start
