"""Where the checkout is, and the seed of a test's random data."""

import os
import random
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/harness/ is two levels down

SEED_ENV = "MMALIGN_TEST_SEED"


def pick_seed(default: int) -> int:
    """The seed of a test's random data: ``default`` (fixed, so that a run replays), the integer in
    MMALIGN_TEST_SEED, or a fresh draw with MMALIGN_TEST_SEED=random. Printed either way with the
    line that replays it (pytest shows a test's output when it fails)."""
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        seed = default
    elif value == "random":
        seed = random.SystemRandom().randrange(2**31)
    else:
        try:
            seed = int(value)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV} must be an integer or 'random', not {value!r}") from None
    print(f"seed: {seed} (replay: {SEED_ENV}={seed})")
    return seed
