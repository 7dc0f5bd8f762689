"""Samples per shard, which the global order is built from (mmalign/data/stream.py), and
where every :data:`STRIDE`-th sample starts.

A shard's count comes from a ``sizes.json`` beside it (``{"00000.tar": 9871, ...}``: what
``mmalign shards`` / ``data_pipelines`` write and open_clip reads), else from reading its tar
headers once (members' data is skipped by seeking, so a local shard costs one pass over its
headers; a remote one is streamed).  The header pass also notes the byte offset of every
16th sample (:func:`stride_for`: fewer for huge data), so a lane whose range starts inside a shard seeks close to its first
sample instead of reading every header before it (over HTTP: every byte before it); with a
``sizes.json`` there are no offsets and the lane reads the headers from the shard's start.
A count that is wrong (a shard rewritten since its ``sizes.json``) changes no other shard's
samples: the samples a lane misses are counted skips (``shard_shorter_than_counted``), surplus
ones are never read.  A shard whose header pass ends early (cut, unreadable) is logged here
with its name; its readable samples are counted, and the lane that reads its end meets the
damage again and counts the skip.

Counting a remote shard is bounded: a stream that has not ended after ``MAX_COUNT_BYTES`` or
``MAX_COUNT_SECONDS`` (an endless or runaway shard) is one ``ConfigError`` line, not a hang.
"""

from __future__ import annotations

import json
import logging
import os
import time
from array import array
from dataclasses import dataclass

from mmalign.data.remote import RemoteOptions, kind_of, local_path
from mmalign.data.tario import CorruptTar, TruncatedTar, iter_samples, open_shard

log = logging.getLogger("mmalign.data")

SIZES_FILE = "sizes.json"
STRIDE = 16  # an offset is kept for every STRIDE-th sample at least ...
MAX_OFFSETS = 1 << 21  # ... and at most about this many in all (400M samples: every 256th)
MAX_COUNT_BYTES = 16 << 30  # a remote shard counted past this does not end (shards are ~0.1-2 GB)
MAX_COUNT_SECONDS = 900.0  # nor one still streaming after this (15 min)


class _CountLimit(Exception):
    """A remote shard's header pass ran past its bounds (not an OSError: never taken for damage)."""


class _Bounded:
    """A remote shard file whose header pass stops at ``MAX_COUNT_BYTES`` / ``MAX_COUNT_SECONDS``."""

    def __init__(self, f, url: str):
        self.f, self.url, self.start = f, url, time.monotonic()
        self.needs_end_marker = getattr(f, "needs_end_marker", False)

    def _check(self) -> None:
        at, took = self.f.tell(), time.monotonic() - self.start
        if at > MAX_COUNT_BYTES or took > MAX_COUNT_SECONDS:
            raise _CountLimit(
                f"config key 'data.train': remote shard {self.url} has not ended after {at} bytes "
                f"and {took:.0f} s of counting its samples (at most {MAX_COUNT_BYTES} bytes, "
                f"{MAX_COUNT_SECONDS:g} s): an endless stream? split it or fix its server"
            )

    def read(self, n: int = -1) -> bytes:
        self._check()
        return self.f.read(n)

    def seek(self, offset: int, whence: int = 0) -> int:
        position = self.f.seek(offset, whence)
        self._check()
        return position

    def tell(self) -> int:
        return self.f.tell()


def stride_for(samples: int) -> int:
    """The offset stride for about ``samples`` samples: a power of two >= STRIDE, keeping the
    offsets under MAX_OFFSETS (8 bytes each, in every loader worker)."""
    stride = STRIDE
    while samples // stride > MAX_OFFSETS:
        stride *= 2
    return stride


@dataclass(frozen=True)
class ShardIndex:
    """Per shard (``urls`` order): its sample count, and the byte offsets of its samples
    0, stride, 2 stride, ... (empty where the count came from ``sizes.json``)."""

    counts: tuple[int, ...]
    offsets: tuple[array, ...] = ()  # array("q") per shard
    stride: int = STRIDE

    def start(self, url: int, first: int) -> tuple[int, int]:
        """``(byte offset, sample index)`` to start reading at to reach sample ``first``."""
        known = self.offsets[url] if url < len(self.offsets) else ()
        k = min(first // self.stride, len(known) - 1)
        return (known[k], k * self.stride) if k >= 0 else (0, 0)


def _listed(url: str, cache: dict) -> int | None:
    """The count ``sizes.json`` beside a local shard gives it, if any."""
    if kind_of(url) != "local":
        return None
    path = local_path(url)
    folder, name = os.path.split(path)
    if folder not in cache:
        try:
            with open(os.path.join(folder or ".", SIZES_FILE), encoding="utf-8") as f:
                table = json.load(f)
            cache[folder] = table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            cache[folder] = {}
    value = cache[folder].get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def count_samples(
    url: str, remote: RemoteOptions | None = None, max_member: int | None = None, stride: int = STRIDE
) -> tuple[int, array]:
    """Complete samples in one shard, read from its headers (0 for a shard that cannot be
    opened), and the byte offsets of every ``stride``-th of them."""
    n, offsets = 0, array("q")
    try:
        with open_shard(url, remote) as f:
            reader = f if kind_of(url) == "local" else _Bounded(f, url)
            for raw in iter_samples(reader, keep=lambda i: False, max_member=max_member):
                if n % stride == 0:
                    offsets.append(raw.offset)
                n += 1
    except _CountLimit as e:
        from mmalign.config import ConfigError

        raise ConfigError(str(e)) from None
    except (TruncatedTar, CorruptTar, OSError, ValueError, EOFError) as e:
        # the samples before the damage count; the lane that reads the shard's end counts the skip
        log.warning(
            "data: shard %s ends early after %d sample(s) (%s: %s): the rest of it is lost, "
            "a counted skip each time it is read",
            url,
            n,
            type(e).__name__,
            e,
        )
    return n, offsets


def shard_sizes(
    urls: list[str], remote: RemoteOptions | None = None, max_member: int | None = None
) -> ShardIndex:
    """Samples per shard (and offsets where the headers were read), in ``urls`` order."""
    cache: dict = {}
    counts, offsets, scanned, stride = [], [], 0, None
    streamed = sum(kind_of(u) != "local" for u in urls)
    if streamed:  # this may take a while: said first
        log.info(
            "data: counting the samples of %d remote shard(s) from their tar headers (each is streamed once)",
            streamed,
        )
    for url in urls:
        listed = _listed(url, cache)
        known = array("q")
        if listed is None:
            if stride is None:  # from the first shard read: the data holds about len(urls) of it
                listed, known = count_samples(url, remote, max_member, STRIDE)
                stride = stride_for(listed * len(urls))
                known = known[:: stride // STRIDE]  # the same shard at the chosen stride: read once
            else:
                listed, known = count_samples(url, remote, max_member, stride)
            scanned += 1
        counts.append(listed)
        offsets.append(known)
    if scanned:
        log.info(
            "data: counted the samples of %d shard(s) from their tar headers (a %s beside them skips this)",
            scanned,
            SIZES_FILE,
        )
    return ShardIndex(tuple(counts), tuple(offsets), stride or STRIDE)


__all__ = ["SIZES_FILE", "STRIDE", "ShardIndex", "count_samples", "shard_sizes", "stride_for"]
