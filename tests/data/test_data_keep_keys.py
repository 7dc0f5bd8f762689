"""``data.keep_keys``: only the listed samples train, the rest are counted skips, and the global
order stays a function of the config (1 rank = 2 ranks). References: the key list itself and
the shards' own keys, counted here."""

from __future__ import annotations

import random

import pytest

from mmalign.config import ConfigError
from mmalign.data.keep_keys import SKIP_REASON, KeySet
from tests.data.test_data_loader import loader_for, make_shards, take


def _epoch0(batches):
    return [k for b in batches for k, e in zip(b.keys, b.epochs.tolist()) if e == 0]


def test_keyset_membership_equals_a_python_set(seed):
    rng = random.Random(seed)
    listed = {f"{rng.randrange(10**9):09d}" for _ in range(500)}
    keys = KeySet(sorted(listed) + sorted(listed)[:50])  # repeats are one key
    assert len(keys) == len(listed)
    for probe in list(listed)[:100] + [f"x{rng.randrange(10**9)}" for _ in range(100)]:
        assert (probe in keys) == (probe in listed)


def test_epoch_trains_each_listed_sample_once_and_counts_the_rest(tmp_path, seed):
    rng = random.Random(seed)
    keys = make_shards(tmp_path, [9, 6, 11, 8], rng)
    listed = sorted(rng.sample(keys, 17))
    (tmp_path / "keep.txt").write_text("# curated\n" + "\n".join(listed) + "\n\n")
    spec = f"{tmp_path}/{{00000..00003}}.tar"
    one = loader_for(spec, mode="epoch", batch=4, keep_keys=str(tmp_path / "keep.txt"))
    batches = take(one, 10)  # 40 rows > the 17 listed samples of epoch 0
    seen = _epoch0(batches)
    assert sorted(seen) == listed  # each listed sample once in the epoch, nothing else
    # every unlisted sample of the epoch read so far is one counted skip, no other reason
    skipped = batches[-1].skipped
    assert set(skipped) == {SKIP_REASON} and skipped[SKIP_REASON] >= len(keys) - len(listed)
    # two ranks read the same global batches
    two = [
        loader_for(spec, mode="epoch", batch=2, rank=r, world_size=2, keep_keys=str(tmp_path / "keep.txt"))
        for r in range(2)
    ]
    halves = [take(loader, 10) for loader in two]
    for b, (left, right) in zip(batches, zip(*halves)):
        assert b.keys == left.keys + right.keys


def test_keep_keys_errors_are_one_line(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [6, 6], rng)
    spec = f"{tmp_path}/{{00000..00001}}.tar"
    cases = {
        "missing.txt": None,
        "empty.txt": "# nothing\n",
        "folders.txt": "a/0000000001\n",
        "few.txt": "000000000\n000000001\n",
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as e:
            loader_for(spec, mode="epoch", batch=4, keep_keys=str(tmp_path / name))
        assert "data.keep_keys" in str(e.value) and "\n" not in str(e.value), name


def test_a_list_naming_no_sample_of_the_shards_stops_with_a_reason(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [5, 5], rng)
    (tmp_path / "keep.txt").write_text("\n".join(f"other{i}" for i in range(8)))
    loader = loader_for(
        f"{tmp_path}/{{00000..00001}}.tar",
        mode="epoch",
        batch=4,
        workers=0,
        keep_keys=str(tmp_path / "keep.txt"),
    )
    with pytest.raises(ConfigError, match="no sample of them is in data.keep_keys") as e:
        take(loader, 1)
    assert "\n" not in str(e.value)


def _one_line_refusal(path, *words):
    with pytest.raises(ConfigError) as e:
        KeySet.read(path)
    message = str(e.value)
    assert "data.keep_keys" in message and "\n" not in message, message
    for word in words:
        assert word in message, message


def test_keep_keys_endless_or_huge_files_are_refused_at_once(tmp_path, monkeypatch):
    import os
    import time

    import mmalign.data.keep_keys as kk

    start = time.monotonic()
    if os.path.exists("/dev/zero"):  # an endless device: refused before a byte is read
        _one_line_refusal("/dev/zero", "not a regular file")
    fifo = tmp_path / "keys.fifo"  # nothing ever writes: open() would wait forever
    os.mkfifo(fifo)
    _one_line_refusal(fifo, "not a regular file")
    huge_line = tmp_path / "line.txt"
    huge_line.write_bytes(b"000000001\n" + b"\0" * (10 * kk.MAX_LINE_BYTES) + b"\n")
    _one_line_refusal(huge_line, "line 2", f"over {kk.MAX_LINE_BYTES} bytes")
    big = tmp_path / "big.txt"
    big.write_text("".join(f"{i:09d}\n" for i in range(1000)))  # 10,000 bytes
    monkeypatch.setattr(kk, "MAX_FILE_BYTES", 5000)
    _one_line_refusal(big, "over 5000 bytes")
    assert time.monotonic() - start < 5
    monkeypatch.setattr(kk, "MAX_FILE_BYTES", 10_000)  # at the bound: read whole
    assert len(KeySet.read(big)) == 1000


def test_keep_keys_file_that_grows_while_read_is_bounded(tmp_path, monkeypatch):
    import mmalign.data.keep_keys as kk

    path = tmp_path / "growing.txt"
    path.write_text("000000001\n")  # stat says 10 bytes; the reader then finds more
    monkeypatch.setattr(kk, "MAX_FILE_BYTES", 100)
    path.write_text("".join(f"{i:09d}\n" for i in range(50)))  # 500 bytes, as if appended after the stat
    monkeypatch.setattr(kk.os, "fstat", lambda fd: type("S", (), {"st_size": 10})())
    _one_line_refusal(path, "over 100 bytes")
