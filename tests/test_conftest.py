"""The conftest helpers. The seed: fixed by default, an integer or a fresh draw from MMALIGN_TEST_SEED,
always printed with the line that replays it; the global generators start from the test's seed.
The ranks: run_ranks starts each rank as a launcher would and returns what each returned; a failing
rank fails the test at once."""

from __future__ import annotations

import os
import random
import time
import zlib

import numpy as np
import pytest
import torch

from tests.conftest import SEED_ENV, pick_seed, run_ranks


def test_the_default_is_fixed_and_printed(monkeypatch, capsys):
    monkeypatch.delenv(SEED_ENV, raising=False)
    assert [pick_seed(17), pick_seed(17)] == [17, 17]
    assert capsys.readouterr().out.splitlines() == [f"seed: 17 (replay: {SEED_ENV}=17)"] * 2


def test_an_integer_in_the_environment_replaces_the_default(monkeypatch, capsys):
    monkeypatch.setenv(SEED_ENV, " 507426779 ")
    assert pick_seed(17) == 507426779
    assert capsys.readouterr().out == f"seed: 507426779 (replay: {SEED_ENV}=507426779)\n"


def test_random_draws_a_fresh_seed_and_prints_its_replay_line(monkeypatch, capsys):
    monkeypatch.setenv(SEED_ENV, "random")
    seeds = [pick_seed(17) for _ in range(3)]
    assert len(set(seeds)) == 3  # three equal draws out of 2**31: never in practice
    assert capsys.readouterr().out.splitlines() == [f"seed: {s} (replay: {SEED_ENV}={s})" for s in seeds]


def test_anything_else_is_refused(monkeypatch):
    monkeypatch.setenv(SEED_ENV, "yes")
    with pytest.raises(pytest.UsageError, match="MMALIGN_TEST_SEED must be an integer or 'random', not 'yes'"):
        pick_seed(17)


def test_the_fixture_seeds_the_global_generators(seed, gen):
    # runs under any MMALIGN_TEST_SEED: the fixture's value is what the generators started from
    assert random.random() == random.Random(seed).random()
    assert np.random.random() == np.random.RandomState(seed % 2**32).random_sample()
    want = torch.rand(3, generator=torch.Generator().manual_seed(seed))
    assert torch.equal(torch.rand(3), want) and torch.equal(torch.rand(3, generator=gen), want)


def test_the_default_seed_comes_from_the_test_name(seed):
    if os.environ.get(SEED_ENV):
        pytest.skip(f"{SEED_ENV} is set: the fixture took it instead of the default")
    assert seed == zlib.crc32(b"test_the_default_seed_comes_from_the_test_name") % 2**31


def _describe_rank(rank, world, tag):
    from mmalign import distributed as mdist

    env = tuple(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
    return (rank, world, tag, env, torch.get_num_threads(), mdist.all_gather_object(rank))


def _fail_on_rank_1(rank, world):
    from mmalign import distributed as mdist

    if rank == 1:
        raise RuntimeError("rank 1 fails")
    mdist.barrier()  # rank 0 would wait here for the collective's default timeout


@pytest.mark.integration
def test_run_ranks_starts_ranks_like_a_launcher_and_returns_their_results_in_order():
    got = run_ranks(_describe_rank, 2, "x")
    assert got == [(r, 2, "x", (str(r), "2", str(r), "127.0.0.1"), 1, [0, 1]) for r in (0, 1)]


@pytest.mark.integration
def test_run_ranks_fails_at_once_when_a_rank_fails_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank exit codes \[(None|1), 1\]"):
        run_ranks(_fail_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the 120 s limit, nor the barrier's timeout
