"""Samples per shard, which epoch mode's global order is built from (mmalign/data/stream.py).

A shard's count comes from a ``sizes.json`` beside it (``{"00000.tar": 9871, ...}``: what
``mmalign shards`` / ``data_pipelines`` write and open_clip reads), else from reading its tar
headers once (members' data is skipped by seeking, so a local shard costs one pass over its
headers; a remote one is streamed).  A count that is wrong (a shard rewritten since its
``sizes.json``) changes no other shard's samples: the samples a lane misses are counted skips
(``shard_shorter_than_counted``), surplus ones are never read.
"""

from __future__ import annotations

import json
import logging
import os

from mmalign.data.remote import RemoteOptions, kind_of, local_path
from mmalign.data.tario import CorruptTar, TruncatedTar, iter_samples, open_shard

log = logging.getLogger("mmalign.data")

SIZES_FILE = "sizes.json"


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


def count_samples(url: str, remote: RemoteOptions | None = None, max_member: int | None = None) -> int:
    """Complete samples in one shard, read from its headers (0 for a shard that cannot be opened)."""
    n = 0
    try:
        with open_shard(url, remote) as f:
            for _ in iter_samples(f, keep=lambda i: False, max_member=max_member):
                n += 1
    except (TruncatedTar, CorruptTar, OSError, ValueError, EOFError):
        pass  # the samples before the damage count; the lane reading it counts the skip
    return n


def shard_sizes(urls: list[str], remote: RemoteOptions | None = None, max_member: int | None = None) -> list[int]:
    """Samples per shard, in ``urls`` order."""
    cache: dict = {}
    counts, scanned = [], 0
    for url in urls:
        listed = _listed(url, cache)
        if listed is None:
            listed = count_samples(url, remote, max_member)
            scanned += 1
        counts.append(listed)
    if scanned:
        log.info("data: counted the samples of %d shard(s) from their tar headers (a %s beside them skips this)",
                 scanned, SIZES_FILE)
    return counts


__all__ = ["SIZES_FILE", "count_samples", "shard_sizes"]
