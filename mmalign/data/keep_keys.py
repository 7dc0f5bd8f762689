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

Reading is bounded: the list must be a regular file (not a pipe or a device, which could
stream forever) of at most ``MAX_FILE_BYTES``, read line by line with no line over
``MAX_LINE_BYTES``; only the hashes are kept, never the text.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mmalign.data.seeds import key_hash
from mmalign.errors import ConfigError

SKIP_REASON = "not_in_keep_keys"
MAX_FILE_BYTES = 4 << 30  # ~200M keys of 20 characters: far more than a curated pool's list
MAX_LINE_BYTES = 4096  # a key is a tar member's name without folders (tar names: <= 255 bytes)


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
    def read(cls, path: str | Path, what: str = "data.keep_keys") -> KeySet:
        """One key per line (blank lines and ``#`` comments ignored); a one-line error when the
        file cannot be read, is not a regular file, is too large, has a line too long or names no key."""
        keys = cls(_keys(Path(path), what))
        if not len(keys):
            raise ConfigError(f"config key '{what}': {path} lists no sample key")
        return keys


def _keys(path: Path, what: str) -> Iterator[str]:
    """The keys of ``path``, streamed within the bounds above."""

    def refuse(why: str) -> ConfigError:
        return ConfigError(f"config key '{what}': {path} {why}")

    try:
        mode = os.stat(path).st_mode  # before open(): opening a FIFO waits for a writer
        if not stat.S_ISREG(mode):
            raise refuse(
                "is not a regular file (a key list is a file, as `mmalign curate --keys-only` writes it)"
            )
        f = open(path, "rb")
    except OSError as e:
        raise refuse(f"cannot be read ({e.strerror or type(e).__name__})") from None
    with f:
        if os.fstat(f.fileno()).st_size > MAX_FILE_BYTES:
            raise refuse(f"is over {MAX_FILE_BYTES} bytes; a key list is at most that")
        total, number = 0, 0
        while True:
            line = f.readline(MAX_LINE_BYTES + 1)
            if not line:
                return
            number += 1
            total += len(line)
            if total > MAX_FILE_BYTES:  # it grew while read
                raise refuse(f"is over {MAX_FILE_BYTES} bytes; a key list is at most that")
            if len(line) > MAX_LINE_BYTES:
                raise refuse(
                    f"line {number} is over {MAX_LINE_BYTES} bytes; a key list has one sample key a line"
                )
            try:
                key = line.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise refuse(f"line {number} is not UTF-8 text") from None
            if not key or key.startswith("#"):
                continue
            if "/" in key:
                raise refuse(
                    f"lists {key!r}; keys are a sample's tar key without folders (the part after the last '/')"
                )
            yield key
