"""``mmalign curate`` re-embeds a shard rewritten at the same path (its stored embeddings are
keyed on the input's size, mtime and sha256), and says which and why.

The pool and the model are test_curate_cli's; the reference for a changed sample is the
caption this test wrote, and the unchanged shards' files are compared byte for byte.
"""

from __future__ import annotations

import os
import shutil

import pandas as pd

from data_pipelines.curate.fingerprint import changed, fingerprint
from tests.data.test_data_loader import write_shard
from tests.pipelines.test_curate_cli import N_SHARDS, _curate, _one_thread, pool  # noqa: F401


def _shard(pool, s: int, edit=None) -> list:
    """Shard ``s``'s samples as test_curate_cli wrote them, each through ``edit(key, members)``."""
    out = []
    for key in pool.order:
        shard, tar_key, members = pool.samples[key]
        if shard == s:
            members = dict(members)
            if edit is not None:
                edit(key, members)
            out.append((tar_key, members))
    return out


def _stored(out, u: int) -> dict:
    return {p.name: p.read_bytes() for p in (out / "pool").glob(f"{u:05d}.*")}


def test_a_shard_rewritten_at_the_same_path_is_embedded_again(pool, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(pool.dir, data)
    out = tmp_path / "out"
    _curate(pool, out, data=data)
    before = {u: _stored(out, u) for u in range(N_SHARDS)}
    first = pd.read_parquet(out / "decisions.parquet").set_index("key")

    # 1. shard 1: one caption replaced by other words of the same length, and the old mtime put
    # back: the size and time agree, only the content tells
    target = next(k for k in pool.order if pool.samples[k][0] == 1 and "txt" in pool.samples[k][2])
    old_caption = pool.samples[target][2]["txt"].decode()
    new_caption = ("zebra " * 40)[: len(old_caption)].strip().ljust(len(old_caption), "z")
    path = data / "00001.tar"
    st = os.stat(path)
    write_shard(
        path, _shard(pool, 1, lambda k, m: m.update(txt=new_caption.encode()) if k == target else None)
    )
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(path).st_size == st.st_size and os.stat(path).st_mtime_ns == st.st_mtime_ns
    # 2. shard 3: other samples (its first two dropped): size and time differ
    write_shard(data / "00003.tar", _shard(pool, 3)[2:])

    run = _curate(pool, out, data=data)
    lines = run.stdout.splitlines()
    assert (
        f"mmalign: curate: {path}: its content changed since it was embedded (same size and time): "
        f"embedding it again" in lines
    )
    assert any(
        line.startswith(f"mmalign: curate: {data / '00003.tar'}: its ")  # its size or its modification time
        and line.endswith("changed since it was embedded: embedding it again")
        for line in lines
    ), lines
    assert sum(line.endswith("embedding it again") for line in lines) == 2  # shards 0 and 2 are as they were
    for u in (0, 2):
        assert _stored(out, u) == before[u], u
    second = pd.read_parquet(out / "decisions.parquet").set_index("key")
    frame = pd.read_parquet(out / "pool" / "00001.parquet").set_index("key")
    assert frame.loc[target, "caption"] == new_caption.strip()
    assert second.loc[target, "clip_score"] != first.loc[target, "clip_score"]  # scored anew
    dropped = [k for k, _ in _shard(pool, 3)[:2]]
    assert not set(dropped) & set(second.index) and set(dropped) <= set(first.index)
    assert len(second) == len(first) - 2

    # a third run: nothing changed, nothing embedded again
    run = _curate(pool, out, data=data)
    assert "embedding it again" not in run.stdout


def test_fingerprint_of_a_pipe_is_none_and_never_changes(tmp_path):
    assert fingerprint("pipe:cat x.tar") is None
    assert changed(None, "pipe:cat x.tar") is None
    f = tmp_path / "a.tar"
    f.write_bytes(b"abc")
    stored = fingerprint(str(f))
    assert changed(stored, str(f)) is None
    assert "no record of its input" in changed(None, str(f))
    f.unlink()
    assert "cannot be read" in changed(stored, str(f))
