"""The conftest helpers. The seed: fixed by default, an integer or a fresh draw from MMALIGN_TEST_SEED,
always printed with the line that replays it; the global generators start from the test's seed.
The ranks: run_ranks starts each rank as a launcher would and returns what each returned; a failing
rank fails the test at once. The pooled ranks: the same, on processes that serve task after task,
each task starting from a fresh rank's state; a failed or hung task replaces the pool."""

from __future__ import annotations

import os
import pickle
import random
import time
import zlib

import numpy as np
import pytest
import torch

from tests.harness import SEED_ENV, pick_seed, rank_pool, run_ranks


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
    with pytest.raises(
        pytest.UsageError, match="MMALIGN_TEST_SEED must be an integer or 'random', not 'yes'"
    ):
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
    from mmalign.dist import distributed as mdist

    env = tuple(os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR"))
    return (rank, world, tag, env, torch.get_num_threads(), mdist.all_gather_object(rank))


def _fail_on_rank_1(rank, world):
    from mmalign.dist import distributed as mdist

    if rank == 1:
        raise RuntimeError("rank 1 fails")
    mdist.barrier()  # rank 0 would wait here for the collective's default timeout


@pytest.mark.integration
@pytest.mark.parametrize("pooled", [False, True], ids=["fresh", "pooled"])
def test_run_ranks_starts_ranks_like_a_launcher_and_returns_their_results_in_order(pooled):
    got = run_ranks(_describe_rank, 2, "x", pooled=pooled)
    assert got == [(r, 2, "x", (str(r), "2", str(r), "127.0.0.1"), 1, [0, 1]) for r in (0, 1)]


@pytest.mark.integration
def test_run_ranks_fails_at_once_when_a_rank_fails_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank exit codes \[(None|1), 1\]"):
        run_ranks(_fail_on_rank_1, 2, timeout_s=120)
    assert time.monotonic() - start < 60  # not the 120 s limit, nor the barrier's timeout


def _pid_and_group(rank, world):
    from mmalign.dist import distributed as mdist

    return os.getpid(), mdist.is_initialized(), mdist.get_world_size()


@pytest.mark.integration
def test_the_pool_serves_tasks_on_the_same_processes_with_each_tasks_world_size():
    first = run_ranks(_pid_and_group, 2, pooled=True)
    one = run_ranks(_pid_and_group, 1, pooled=True)
    second = run_ranks(_pid_and_group, 2, pooled=True)
    pids = rank_pool.pids()
    assert len(pids) == 2 and os.getpid() not in pids
    assert first == second == [(pids[0], True, 2), (pids[1], True, 2)]
    assert one == [(pids[0], False, 1)]  # one rank gets no group, as run_ranks' fresh rank


def _sleep_on_rank_1(rank, world):
    if rank == 1:
        time.sleep(120)


@pytest.mark.integration
def test_a_failing_pooled_task_reports_its_traceback_and_the_next_task_gets_a_fresh_pool():
    before = [pid for pid, _, _ in run_ranks(_pid_and_group, 2, pooled=True)]
    start = time.monotonic()
    with pytest.raises(AssertionError) as failed:
        run_ranks(_fail_on_rank_1, 2, pooled=True, timeout_s=120)
    assert time.monotonic() - start < 60  # not the 120 s limit, nor the barrier's timeout
    message = str(failed.value)
    assert message.startswith("rank 1 raised:\nTraceback (most recent call last):")
    assert "in _fail_on_rank_1" in message and message.rstrip().endswith("RuntimeError: rank 1 fails")
    assert rank_pool.pids() == []  # not reused: rank 0 is stuck in the barrier
    after = [pid for pid, _, _ in run_ranks(_pid_and_group, 2, pooled=True)]
    assert set(after).isdisjoint(before)


@pytest.mark.integration
def test_a_hung_pooled_task_fails_within_its_timeout_and_the_pool_is_replaced():
    before = [pid for pid, _, _ in run_ranks(_pid_and_group, 2, pooled=True)]
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"^ranks \[0, 1\] still running the task after 2 s: stopped"):
        run_ranks(_sleep_on_rank_1, 2, pooled=True, timeout_s=2)
    assert time.monotonic() - start < 30
    assert rank_pool.pids() == []
    after = [pid for pid, _, _ in run_ranks(_pid_and_group, 2, pooled=True)]
    assert set(after).isdisjoint(before)


@pytest.mark.integration
def test_the_pool_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="group=False needs fresh ranks"):
        run_ranks(_pid_and_group, 2, group=False, pooled=True)
    with pytest.raises(ValueError, match="the rank pool has 2 ranks, not enough for world size 3"):
        run_ranks(_pid_and_group, 3, pooled=True)
    with pytest.raises((pickle.PicklingError, AttributeError, TypeError)):
        run_ranks(lambda rank, world: rank, 2, pooled=True)  # refused before any rank starts it


LEAK_ENV = "MMALIGN_TEST_POOL_LEAK"


def _leak(rank, world, where):
    """Everything a test could leave behind in its process."""
    import logging
    import warnings

    import torch.nn.functional as F

    from mmalign.dist import distributed as mdist

    os.environ[LEAK_ENV] = "1"
    os.chdir(where)
    torch.manual_seed(12345)
    random.seed(1)
    np.random.seed(1)
    torch.set_num_threads(2)
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    torch.autocast("cpu", dtype=torch.bfloat16).__enter__()  # never left
    torch.use_deterministic_algorithms(True)
    torch.set_float32_matmul_precision("medium")
    F.linear = lambda *a, **k: None  # as ZeRO-3 does, for the rest of the process
    logging.getLogger("mmalign").addHandler(logging.NullHandler())
    logging.getLogger("mmalign").setLevel(logging.ERROR)
    logging.getLogger("mmalign.pool_test_new").setLevel(logging.ERROR)
    warnings.simplefilter("error")
    mdist.prepare_slow_barrier()  # a module-level group of the world that is about to end
    assert mdist._slow_group is not None


def _state(rank, world):
    """What a fresh rank starts with, as the leaked-into names read it."""
    import logging
    import warnings

    import torch.nn.functional as F

    from mmalign.dist import distributed as mdist

    mdist.slow_barrier(30)  # works only with this task's group: a leaked group would fail it
    return {
        "env": os.environ.get(LEAK_ENV),
        "cwd": os.getcwd(),
        # a fresh rank's generators start from the OS's entropy: not the stream a task seeded
        "reseeded": (
            random.random() != random.Random(1).random(),
            np.random.random() != np.random.RandomState(1).random_sample(),
            not torch.equal(torch.rand(2), torch.rand(2, generator=torch.Generator().manual_seed(12345))),
        ),
        "threads": torch.get_num_threads(),
        "dtype": str(torch.get_default_dtype()),
        "grad": torch.is_grad_enabled(),
        "autocast": torch.is_autocast_enabled("cpu"),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
        "linear": F.linear is torch._C._nn.linear,
        "loggers": [
            (len(logging.getLogger(n).handlers), logging.getLogger(n).level)
            for n in ("mmalign", "mmalign.pool_test_new")
        ],
        "warnings": warnings.filters[:1] != [("error", None, Warning, None, 0)],
        "linear_works": F.linear(torch.ones(1, 2), torch.ones(3, 2)).tolist(),
    }


@pytest.mark.integration
def test_a_pooled_task_starts_from_a_fresh_ranks_state_whatever_the_last_one_left(tmp_path):
    fresh = run_ranks(_state, 2)
    run_ranks(_leak, 2, str(tmp_path), pooled=True)
    pids = rank_pool.pids()
    assert run_ranks(_state, 2, pooled=True) == fresh
    assert rank_pool.pids() == pids  # reset, not replaced
    assert fresh[0]["cwd"] == os.getcwd() and fresh[0]["env"] is None and fresh[0]["linear"]
