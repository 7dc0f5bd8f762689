"""``data.keep_keys: FILE``: train on the samples a key list names, skip the rest (counted).

The list is what ``mmalign curate --keys-only`` writes (one sample key per line, as the batch
carries it: the tar key without folders), so a curated pool trains without rewriting shards.
The shards, their counts and so the lanes of the global order (data/stream.py) stay those of
the whole pool; a sample that is not listed is dropped when its lane reads it, before the
shuffle buffer, and counted under ``not_in_keep_keys`` in the run's skip counts. Which samples
a batch holds is therefore still a function of the config alone, on any cluster.

Memory: the keys are held as a sorted array of their 64-bit hashes (8 bytes a key: 80 MB for
10M keys, against about 1 GB as a Python set of strings), which every loader worker receives
once. Two keys with one hash (probability about n^2 / 2^65: 3e-6 for 10M keys) would let one
unlisted sample through; nothing is ever dropped that the list names.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from mmalign.data.seeds import key_hash
from mmalign.errors import ConfigError

SKIP_REASON = "not_in_keep_keys"


class KeySet:
    """The hashes of the listed keys; ``key in keys`` for a sample key."""

    def __init__(self, keys) -> None:
        hashes = np.fromiter((key_hash(k) for k in keys), dtype=np.uint64)
        self._hashes = np.unique(hashes)  # (n,) sorted, each once

    def __len__(self) -> int:
        return int(self._hashes.size)

    def __contains__(self, key: str) -> bool:
        h = np.uint64(key_hash(key))
        i = int(np.searchsorted(self._hashes, h))
        return i < self._hashes.size and self._hashes[i] == h

    @classmethod
    def read(cls, path: str | Path, what: str = "data.keep_keys") -> "KeySet":
        """One key per line (blank lines and ``#`` comments ignored); a one-line error when the
        file cannot be read or names no key."""
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"config key '{what}': cannot read {path} ({getattr(e, 'strerror', None) or type(e).__name__})") \
                from None
        keys = [line.strip() for line in text.splitlines()]
        keys = [k for k in keys if k and not k.startswith("#")]
        if not keys:
            raise ConfigError(f"config key '{what}': {path} lists no sample key")
        bad = next((k for k in keys if "/" in k), None)
        if bad is not None:
            raise ConfigError(f"config key '{what}': {path} lists {bad!r}; keys are a sample's tar key without "
                              f"folders (the part after the last '/')")
        return cls(keys)
