"""Seeds that belong to a sample, not to the process that reads it (issue 30).

Every random draw of the data pipeline is keyed by what it is about: a shard order by
(seed, epoch), a lane's shard draws and shuffle choices by (seed, lane, counter), a sample's
augmentation by (seed, epoch, sample key, purpose).  None is taken from a rank's or a
worker's generator, so the batches of a run do not depend on how many ranks and workers
read them (mmalign/data/stream.py).  Counter-based (a hash of the key, not a generator's
state), so nothing here has a state to save.
"""

from __future__ import annotations

import hashlib
import random

# the purposes a sample's seed is split into (each its own generator: adding one leaves the others)
CAPTION, VIEW, VIEW2 = 1, 2, 3
_MASK = (1 << 64) - 1


def mix(*parts: int) -> int:
    """A 64-bit value from integers (the splitmix64 finaliser over a running combination)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & _MASK
        x ^= x >> 29
    return x


def key_hash(key: str) -> int:
    """A stable 64-bit hash of a sample key (its name as the batch carries it)."""
    return int.from_bytes(
        hashlib.blake2b(key.encode("utf-8", "surrogateescape"), digest_size=8).digest(), "big"
    )


def sample_seed(seed: int, epoch: int, key: str) -> int:
    """The one seed of a sample in an epoch: a function of (run seed, epoch, key) only; 63 bits,
    so that it fits an int64 tensor (``Batch.seeds``)."""
    return mix(seed, 0x5A4F, epoch, key_hash(key)) >> 1


def draws(seed: int, purpose: int) -> random.Random:
    """The generator of one purpose of one sample."""
    return random.Random(mix(seed, purpose))


__all__ = ["CAPTION", "VIEW", "VIEW2", "draws", "key_hash", "mix", "sample_seed"]
