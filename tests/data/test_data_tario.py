"""Bounded reads: a tar member over data.max_member_bytes is never read into memory
(a small .tar.gz can hold a huge member) and its sample is a counted skip."""

from __future__ import annotations

import gzip
import io
import tarfile
import tracemalloc

import pytest

from mmalign.config import ConfigError, load_config, validate
from mmalign.data.shards import read_samples
from mmalign.data.tario import iter_samples, open_shard
from tests.data.test_data_samples import good, loader

BIG = 24 << 20  # compresses to ~24 KB
CAP = 1 << 20


def _bomb_shard(path) -> list[str]:
    """good0, big (a BIG-byte .jpg), good1 as a .tar.gz; returns the good keys."""
    samples = [good("good0"), ("big", {"jpg": None, "txt": b"a caption"}), good("good1")]
    with gzip.open(path, "wb", compresslevel=1) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                if data is None:  # zeros streamed in, never built in memory here either
                    info.size = BIG
                    tar.addfile(info, _Zeros(BIG))
                else:
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return ["good0", "good1"]


class _Zeros(io.RawIOBase):
    def __init__(self, n):
        self.left = n

    def readinto(self, b):
        n = min(len(b), self.left)
        b[:n] = bytes(n)
        self.left -= n
        return n

    def readable(self):
        return True


def test_oversized_member_is_not_read(tmp_path):
    shard = tmp_path / "00000.tar.gz"
    _bomb_shard(shard)
    assert shard.stat().st_size < BIG // 100
    tracemalloc.start()
    try:
        with open_shard(str(shard)) as f:
            samples = list(iter_samples(f, max_member=CAP))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 * CAP, peak  # far below the member's 24 MiB
    assert [s.key for s in samples] == ["good0", "big", "good1"]
    assert samples[1].oversized == {"jpg": BIG} and set(samples[1].members) == {"txt"}
    assert not samples[0].oversized and set(samples[0].members) == {"jpg", "txt", "json"}


def test_oversized_member_is_a_counted_skip(tmp_path):
    shard = tmp_path / "00000.tar.gz"
    goods = _bomb_shard(shard)
    # one lane (a global batch of 1), no shuffling: the write order, the big one between the goods
    batches = [
        b
        for _, b in zip(
            range(2), iter(loader(str(shard), workers=0, shuffle_buffer=1, batch=1, max_member_bytes=CAP))
        )
    ]
    assert [b.keys[0] for b in batches] == goods and batches[1].skipped == {"member_too_large": 1}
    assert [
        s["key"] for s in read_samples([str(shard)], max_member=CAP)
    ] == goods  # evaluation / embed / mine


@pytest.mark.parametrize("value", [0, -1, 1.5])
def test_max_member_bytes_is_validated(value):
    with pytest.raises(ConfigError, match="data.max_member_bytes"):
        validate(load_config(None, [f"data.max_member_bytes={value}"]))
    assert load_config(None).data.max_member_bytes == 64 << 20
