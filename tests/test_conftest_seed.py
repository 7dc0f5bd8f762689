"""The test seed helper: fixed by default, an integer or a fresh draw from MMALIGN_TEST_SEED, always
printed with the line that replays it; the global generators start from the test's seed."""

from __future__ import annotations

import os
import random
import zlib

import numpy as np
import pytest
import torch

from tests.conftest import SEED_ENV, pick_seed


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
