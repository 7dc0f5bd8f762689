"""bench/search_scale.py's corpus: a clustered synthetic distribution written as an ``mmalign embed``
directory (float16 parts, metadata parquet, embed.json) with held-out queries, and the queries' exact
top-100 by inner product. Both cached in the bench's work folder and remade when the recipe changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

GEN_VERSION = 1  # bump when the generator changes: the cached corpus is remade
BLOCK = 65_536  # rows generated (and searched exactly) at a time: the bench's own peak stays small
N_BASES, BASIS_DIM = 16, 64


class Mixture:
    """The clustered distribution: ``draw(rows, stream)`` gives (rows, dim) float16 unit vectors."""

    def __init__(self, dim: int, clusters: int, seed: int):
        rng = np.random.default_rng([seed, 0])
        self.dim = dim
        weights = rng.lognormal(0.0, 1.0, clusters)
        self.cdf = np.cumsum(weights / weights.sum())
        mean = rng.standard_normal(dim)
        centres = 0.6 * mean / np.linalg.norm(mean) + rng.standard_normal((clusters, dim)) / np.sqrt(dim)
        self.centres = (centres / np.linalg.norm(centres, axis=1, keepdims=True)).astype(np.float32)  # (C, D)
        self.spread = np.exp(rng.uniform(np.log(0.5), np.log(1.5), clusters)).astype(np.float32)  # (C,)
        r = min(BASIS_DIM, dim)
        self.bases = np.stack(  # (16, r, D): orthonormal rows, a cluster varies along basis c % 16
            [np.linalg.qr(rng.standard_normal((dim, r)))[0].T for _ in range(N_BASES)]
        ).astype(np.float32)

    def draw(self, rows: int, stream: list[int]) -> np.ndarray:
        rng = np.random.default_rng(stream)
        label = np.minimum(np.searchsorted(self.cdf, rng.random(rows)), len(self.cdf) - 1)
        r = self.bases.shape[1]
        noise = np.sqrt(0.2 / self.dim) * rng.standard_normal((rows, self.dim), dtype=np.float32)  # (B, D)
        low = rng.standard_normal((rows, r), dtype=np.float32) * np.sqrt(0.8 / r)  # (B, r)
        for b in range(N_BASES):
            sel = np.flatnonzero(label % N_BASES == b)
            noise[sel] += low[sel] @ self.bases[b]
        x = self.centres[label] + self.spread[label, None] * noise
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float16)


def make_corpus(work: Path, n: int, dim: int, nq: int, clusters: int, seed: int, part_size: int) -> Path:
    """The ``mmalign embed`` directory (C1) and ``queries.npy``; reused when its recipe matches."""
    import pandas as pd

    emb = work / "emb"
    recipe = {
        "version": GEN_VERSION,
        "n": n,
        "dim": dim,
        "queries": nq,
        "clusters": clusters,
        "seed": seed,
        "part_size": part_size,
    }
    info_file = emb / "embed.json"
    if info_file.is_file() and json.loads(info_file.read_text()).get("bench") == recipe:
        return emb
    shutil.rmtree(emb, ignore_errors=True)
    for sub in ("img_emb", "metadata"):
        (emb / sub).mkdir(parents=True)
    mix = Mixture(dim, clusters, seed)
    parts = 0
    for start in range(0, n, part_size):
        rows = min(part_size, n - start)
        vecs = np.concatenate(
            [mix.draw(min(BLOCK, rows - s), [seed, 1, start + s]) for s in range(0, rows, BLOCK)]
        )
        np.save(emb / "img_emb" / f"img_emb_{parts}.npy", vecs)
        ids = np.arange(start, start + rows)
        meta = pd.DataFrame(
            {
                "key": [f"{i:09d}" for i in ids],
                "caption": pd.Series([None] * rows, dtype=object),
                "caption_index": np.zeros(rows, np.int32),
                "json": pd.Series([None] * rows, dtype=object),
                "source_path": pd.Series([None] * rows, dtype=object),
                "file": pd.Series([None] * rows, dtype=object),
                "offset": np.full(rows, -1, np.int64),
            }
        )
        meta.to_parquet(emb / "metadata" / f"metadata_{parts}.parquet", index=False)
        parts += 1
    queries = mix.draw(nq, [seed, 2])  # held out: a stream of its own
    np.save(work / "queries.npy", queries)
    info = {
        "model": None,
        "dim": dim,
        "rows": n,
        "images": n,
        "parts": parts,
        "part_size": part_size,
        "dtype": "float16",
        "normalised": True,
        "text": False,
        "layout": "one row per (image, caption); caption_index 0 = an image's first row",
        "bench": recipe,
    }
    info_file.write_text(json.dumps(info, indent=2))  # last: a half-written corpus is remade
    (work / "truth.npy").unlink(missing_ok=True)
    return emb


def part_files(emb: Path) -> list[Path]:
    parts = json.loads((emb / "embed.json").read_text())["parts"]
    return [emb / "img_emb" / f"img_emb_{i}.npy" for i in range(parts)]


def exact_truth(work: Path, emb: Path, k: int = 100) -> np.ndarray:
    """(nq, k) corpus ids of each query's exact top-k by inner product, cached as truth.npy."""
    import faiss

    cache = work / "truth.npy"
    if cache.is_file():
        return np.load(cache)
    queries = np.load(work / "queries.npy").astype(np.float32)  # (Q, D)
    heap = faiss.ResultHeap(len(queries), k, keep_max=True)
    start = 0
    for f in part_files(emb):
        part = np.load(f, mmap_mode="r")
        for s in range(0, len(part), BLOCK):
            block = np.asarray(part[s : s + BLOCK], dtype=np.float32)  # (B, D)
            flat = faiss.IndexFlatIP(block.shape[1])
            flat.add(block)
            d, i = flat.search(queries, min(k, len(block)))
            heap.add_result(d, i + start + s)
        start += len(part)
    heap.finalize()
    np.save(cache, heap.I)
    return heap.I


def scale_note(n: int, dim: int, nq: int, ram_gb: float) -> str:
    """The arithmetic of a corpus this size: what it takes on disk, in this script and in an exact index."""
    f16, f32 = n * dim * 2, n * dim * 4
    own = (2 * BLOCK * dim * 4 + nq * dim * 4 + nq * 100 * 12) / 1e9  # a block twice, the queries, the heap
    return (
        f"{n:,} x {dim}: {f16 / 1e9:.1f} GB as float16 on disk, {f32 / 1e9:.1f} GB as float32 (an exact Flat "
        f"index); this script streams it in {BLOCK:,}-row blocks and holds ~{own:.2f} GB itself; the exact "
        f"top-100 costs {2 * nq * n * dim / 1e12:.3g} TFLOP; RAM {ram_gb:.0f} GB."
    )
