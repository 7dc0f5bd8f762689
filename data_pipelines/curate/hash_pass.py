"""Curate's perceptual hashes outside pass 1: runs without a model, and pools embedded before.

A run whose policies need no model (``--dedupe exact/perceptual``, ``--false-negative-groups``)
takes no ``--model``: pass 1 then only hashes (:mod:`.embed_pass` with no model), and its
``OUT/pool/stamp.json`` names no model (:func:`check_model`, :func:`check_stamp`).

Pass 1 (:mod:`.embed_pass`) writes each shard's ``OUT/pool/NNNNN.phash.npy`` beside its
embeddings and records ``phash_version`` in ``NNNNN.json``. A pool embedded by an older mmalign
has neither, and one hashed by another :data:`mmalign.data.phash.VERSION` has hashes that no
longer compare with new ones. :func:`ensure_hashes` hashes those shards again, reading the
shard and no model: the rows of the shard's parquet (by their place in the shard), each image
decoded as pass 1 decodes it. The stats file is rewritten last, so a kill leaves the shard
marked unhashed and the next run hashes it again.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from data_pipelines.curate.embed_pass import HASH_WIDTH, _atomic, _save, hash_rows, shard_files
from mmalign.data import phash
from mmalign.errors import UsageError


def check_model(opts) -> None:
    """The perceptual distance in range, and a model when a policy needs one (one line each)."""
    p = opts.policies
    try:
        phash.check_distance(p.perceptual_distance)
    except ValueError as e:
        raise UsageError(f"--perceptual-distance: {e}") from None
    if opts.model is None and (need := p.model_needed_by()):
        raise UsageError(
            f"{need[0]} needs a filter model: give --model (without one, curate takes --dedupe exact, "
            f"perceptual, --decontaminate and --false-negative-groups)"
        )


def check_stamp(opts, have: dict, want: dict, out: Path) -> None:
    """``OUT/pool/stamp.json`` when this run or the one that wrote it had no model: a run without a
    model reuses any pool of the same shards (it reads only the hashes; :func:`check_unembedded`
    for shards still to do); a run with one refuses a pool that was only hashed."""
    path = out / "pool" / "stamp.json"
    if have.get("urls") != want["urls"]:
        raise UsageError(
            f"--out: {out} holds the pool of other shards ({path}); use another --out, or delete "
            f"{out / 'pool'} to start again"
        )
    if opts.model is not None:
        raise UsageError(
            f"--out: {out} holds a pool hashed without a model ({path}); use another --out, or delete "
            f"{out / 'pool'} to embed it with --model"
        )


def check_unembedded(out: Path, todo: list[int], urls: list[str]) -> None:
    """A run without a model may not add hash-only shards to a pool embedded with one (a shard
    whose input changed, or never finished): one line naming the model to embed them with."""
    path = out / "pool" / "stamp.json"
    model = json.loads(path.read_text()).get("model") if path.is_file() else None
    if todo and model is not None:
        raise UsageError(
            f"--out: {out} holds a pool embedded with {model}, and {len(todo)} shard(s) need embedding "
            f"again (e.g. {urls[todo[0]]}); run with --model {model}, or use another --out"
        )


def hashed(out: Path, u: int) -> bool:
    """Whether shard ``u``'s stored hashes are of this hash version."""
    files = shard_files(out, u)
    stats = json.loads(files["stats"].read_text())
    return stats.get("phash_version") == phash.VERSION and files["phash"].is_file()


def hash_shard(url: str, u: int, out: Path, max_pixels: int | None = None) -> int:
    """Hash the rows of shard ``u``'s parquet from the shard itself; returns how many were hashed.

    A row whose sample cannot be read now (the shard changed or ended early) gets an all-zero
    hash row and is counted in the stats' ``phash_missing``."""
    import pandas as pd

    from mmalign.data.shards import BadSample, decode_sample, iter_tar_groups
    from mmalign.data.tario import CorruptTar, TruncatedTar

    files = shard_files(out, u)
    frame = pd.read_parquet(files["parquet"], columns=["index"])
    place = {int(i): r for r, i in enumerate(frame["index"].tolist())}  # shard index -> parquet row
    hashes = np.zeros((len(frame), HASH_WIDTH, phash.WORDS), np.uint64)  # (n, Q + V, W)
    found = 0
    try:
        for index, raw in enumerate(iter_tar_groups(url)):
            row = place.get(index)
            if row is None:
                continue
            try:
                image = decode_sample(raw, max_pixels)["image"].convert("RGB")
            except BadSample:
                continue
            hashes[row] = hash_rows([image])[0]  # (Q + V, W)
            found += 1
    except (TruncatedTar, CorruptTar, OSError):
        pass  # what was read is hashed; the rest are counted below
    _atomic(files["phash"], lambda p: _save(p, hashes))
    stats = json.loads(files["stats"].read_text())
    stats["phash_version"] = phash.VERSION
    stats["phash_missing"] = len(frame) - found
    _atomic(files["stats"], lambda p: p.write_text(json.dumps(stats, indent=1)))
    return found


def ensure_hashes(out: Path, urls: list[str], progress: bool = True) -> list[int]:
    """Hash every shard of the pool whose hashes are missing or of another version (a line
    first, naming how many); returns their numbers."""
    todo = [u for u in range(len(urls)) if not hashed(out, u)]
    if not todo:
        return todo
    print(
        f"mmalign: curate: {len(todo)} of {len(urls)} embedded shard(s) in {out / 'pool'} have no perceptual "
        f"hashes of version {phash.VERSION} (embedded before them): hashing their images (no model)",
        flush=True,
    )
    start, count = time.time(), 0
    for u in todo:
        count += hash_shard(urls[u], u, out)
    if progress:
        print(f"mmalign: curate: hashed {count} images in {time.time() - start:.1f} s", flush=True)
    return todo


def load_hashes(out: Path, n_shards: int) -> np.ndarray | None:
    """(N, Q + V, W) uint64: every shard's hashes in pool order, or None when a shard has none
    of this version."""
    if not all(hashed(out, u) for u in range(n_shards)):
        return None
    parts = [np.load(shard_files(out, u)["phash"]) for u in range(n_shards)]
    return np.concatenate(parts) if parts else np.zeros((0, HASH_WIDTH, phash.WORDS), np.uint64)
