"""Pass 3 of ``mmalign curate``: the kept samples as new shards, or as a key list.

New shards (:func:`write_shards`) hold the kept samples in one seeded random order over the
whole pool (as the builders shuffle), ``per_shard`` a shard, every member copied byte for byte
under its original key except the ``.json``, which keeps its fields and gains ``clip_score``
(none in a run without a model) (and, with ``--false-negative-groups FIELD``, the sample's group under FIELD). Beside them:
``NNNNN.parquet`` (key, clip_score, source shard and index) and ``sizes.json``, as the builders
write them, so training counts the shards without reading them.

The shuffle is external, so memory stays one shard's samples whatever the pool size: the input
shards are read once, in order (local or remote, sequentially), each kept sample appended to a
temporary bucket file of the output shard it goes to; then each bucket is sorted by position
and written as its tar. Disk: the kept samples twice, briefly.

``--keys-only`` (:func:`write_keys`) writes ``keep_keys.txt`` instead, for ``data.keep_keys``.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import shutil
import tarfile
from pathlib import Path

import numpy as np

log = logging.getLogger("mmalign.curate")

KEYS_FILE = "keep_keys.txt"
BUCKETS = ".buckets"


def write_keys(out: Path, pool, keep: np.ndarray) -> dict:
    """``OUT/keep_keys.txt``: the kept samples' keys, one a line, in pool order."""
    from mmalign.errors import UsageError

    keys = pool.frame["key"].to_numpy()
    unique, counts = np.unique(keys, return_counts=True)
    if (counts > 1).any():
        twice = unique[counts > 1]
        raise UsageError(
            f"--keys-only: {len(twice)} sample key(s) occur in more than one place of the pool (e.g. "
            f"{twice[0]!r}), so a key list cannot tell them apart; write new shards instead "
            f"(drop --keys-only)"
        )
    path = out / KEYS_FILE
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(f"{k}\n" for k in keys[keep]), encoding="utf-8")
    os.replace(tmp, path)
    return {"keys_file": str(path), "keys": int(keep.sum())}


def _json_member(members: dict, score: float, field: str | None, group: str | None) -> bytes:
    meta: dict = {}
    if "json" in members:
        try:
            meta = json.loads(members["json"].decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            # pass 1 read it (a bad .json is a skipped sample there): changed since
            raise ValueError("a .json that is not an object") from None
        if not isinstance(meta, dict):
            raise ValueError("a .json that is not an object")
    if score == score:  # a run without a model has no score (NaN): no field
        meta["clip_score"] = round(float(score), 6)
    if field is not None:
        meta[field] = group
    return json.dumps(meta, sort_keys=True).encode("utf-8")


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), 0o644, 0  # reproducible shards
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    urls: list[str], out: Path, pool, decisions, *, per_shard: int, seed: int, field: str | None, remote=None
) -> dict:
    """The kept samples as shuffled shards in ``out`` (module docstring); returns counts."""
    import pandas as pd

    from mmalign.data.tario import CorruptTar, TruncatedTar, iter_samples, open_shard

    frame = pool.frame
    kept = np.flatnonzero(decisions.keep)  # (K,) pool rows, pool order
    order = kept[np.random.default_rng(seed).permutation(kept.size)]  # (K,) the output order
    target = np.full(len(frame), -1, dtype=np.int64)  # pool row -> place in the output order
    target[order] = np.arange(order.size)
    n_out = -(-order.size // per_shard)
    buckets = out / BUCKETS
    shutil.rmtree(buckets, ignore_errors=True)
    buckets.mkdir(parents=True)
    shards = frame["shard"].to_numpy()
    indices = frame["index"].to_numpy()
    scores = frame["clip_score"].to_numpy()
    missing = 0
    for u, url in enumerate(urls):
        rows = np.flatnonzero((shards == u) & (target >= 0))
        if rows.size == 0:
            continue
        wanted = {int(indices[r]): int(r) for r in rows}
        by_bucket: dict[int, list] = {}
        try:
            with open_shard(url, remote) as f:
                for raw in iter_samples(f, keep=wanted.__contains__):
                    r = wanted.pop(raw.index, None)
                    if r is None:
                        continue
                    group = None if decisions.group_field is None else decisions.group_field[r]
                    members = dict(raw.members)
                    members["json"] = _json_member(members, scores[r], field, group)
                    place = int(target[r])
                    by_bucket.setdefault(place // per_shard, []).append((place, raw.key, members))
        except (TruncatedTar, CorruptTar, OSError, ValueError) as e:
            log.warning("curate: shard %s changed or ended early while writing: %s", url, e)
        missing += len(wanted)  # kept in pass 1, not found now: the shard changed since
        for j, records in by_bucket.items():
            with open(buckets / f"{j:05d}", "ab") as f:
                for record in records:
                    pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
    sizes: dict[str, int] = {}
    for j in range(n_out):
        records = []
        path = buckets / f"{j:05d}"
        if path.is_file():
            with open(path, "rb") as f:
                while True:
                    try:
                        records.append(pickle.load(f))  # our own temporary file, written just above
                    except EOFError:
                        break
        records.sort(key=lambda rec: rec[0])
        name = f"{j:05d}"
        with tarfile.open(out / f".{name}.tar.tmp", "w") as tar:
            for _, key, members in records:
                for ext, data in members.items():
                    _add(tar, f"{key}.{ext}", data)
        os.replace(out / f".{name}.tar.tmp", out / f"{name}.tar")
        table = pd.DataFrame(
            {
                "key": [key.rsplit("/", 1)[-1] for _, key, _ in records],
                "clip_score": [
                    float(scores[order[p]]) for p, _, _ in records
                ],  # order[p]: the pool row at place p
                "source_shard": [urls[int(shards[order[p]])] for p, _, _ in records],
                "source_index": [int(indices[order[p]]) for p, _, _ in records],
            }
        )
        table.to_parquet(out / f"{name}.parquet", index=False)
        sizes[f"{name}.tar"] = len(records)
        path.unlink(missing_ok=True)
    shutil.rmtree(buckets, ignore_errors=True)
    (out / "sizes.json").write_text(json.dumps(sizes, indent=2))
    return {"shards_written": n_out, "samples_written": int(sum(sizes.values())), "missing_at_write": missing}
