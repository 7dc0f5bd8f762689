"""One modality's FAISS index as N shards searched together (``index.json``'s ``shards`` list).

A shard is a pair of files: the FAISS index and ``*_rows.npy`` (position in the shard ->
metadata row).  Positions are global across shards: shard ``s``'s position ``p`` is
``offsets[s] + p``.  :meth:`ShardedIndex.search` asks every shard for its top k and
merges them: score descending, ties by shard then position (i.e. by global position),
so a sharded Flat index answers exactly as one Flat index over the same vectors.

Memory-mapped loading (``mmap=True``) opens each file with ``faiss.IO_FLAG_MMAP_IFC``:
in FAISS 1.15 that maps the vectors of Flat indexes, the inverted lists of IVF indexes
(IVF-Flat, IVF-PQ, OPQ+IVF-PQ) and the stored vectors of HNSW (its graph is still read
into memory); ``*_rows.npy`` is mapped too.  Pages are read from disk as searches touch them.
The files must not be rewritten while a searcher maps them.

Searches only read the indexes (search parameters are set once, at load), so threads may
search at once; FAISS releases the GIL while it searches.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from mmalign.errors import UsageError


def shard_entries(name: str, entry: dict) -> list[dict]:
    """``index.json``'s shard list for one modality; an old index (no ``shards``) has one pair."""
    shards = entry.get("shards")
    if not shards:
        return [{"index": f"{name}.index", "rows": f"{name}_rows.npy"}]
    return list(shards)


def search_params(entry: dict) -> dict:
    """The search-time parameters (``search``; an old index's modality-level ``nprobe``)."""
    params = dict(entry.get("search") or {})
    if "nprobe" in entry and "nprobe" not in params:
        params["nprobe"] = entry["nprobe"]
    return params


def require_faiss():
    """FAISS, or one line naming the ``[search]`` extra when it is not installed."""
    from mmalign.extras import extra

    with extra("search", "searching an index (mmalign search, mmalign serve)"):
        import faiss
    return faiss


def _read(faiss, path: Path, mmap: bool):
    if not path.is_file():
        raise UsageError(f"--index: index shard {path} is missing")
    try:
        return faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC if mmap else 0)
    except RuntimeError as e:
        first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise UsageError(f"--index: cannot read {path} ({first})") from None


class ShardedIndex:
    """The shards of one modality; ``ntotal``, ``d``, ``search`` and ``reconstruct`` over them all."""

    def __init__(self, shards: list, rows: list[np.ndarray]):
        self.shards, self.shard_rows = shards, rows
        self.offsets = np.cumsum([0] + [int(s.ntotal) for s in shards])  # (S+1,) first position of each
        self.ntotal = int(self.offsets[-1])
        self.d = int(shards[0].d)
        self._rows: np.ndarray | None = None
        self._map_lock = threading.Lock()  # an IVF shard builds its id -> list map on its first reconstruct
        self._mapped: set[int] = set()  # shards whose reconstruct needs no lock any more

    @classmethod
    def load(cls, index_dir: Path, name: str, entry: dict, dim: int, *, mmap: bool = False) -> ShardedIndex:
        faiss = require_faiss()

        params = search_params(entry)
        shards, rows = [], []
        for s in shard_entries(name, entry):
            index = _read(faiss, index_dir / s["index"], mmap)
            rows_path = index_dir / s["rows"]
            if not rows_path.is_file():
                raise UsageError(f"--index: index shard {rows_path} is missing")
            positions = np.load(rows_path, mmap_mode="r" if mmap else None)
            if index.d != dim:
                raise UsageError(f"--index: {s['index']} has dim {index.d}, index.json says {dim}")
            if len(positions) != index.ntotal:
                raise UsageError(
                    f"--index: {s['rows']} has {len(positions)} rows but {s['index']} holds {index.ntotal} vectors"
                )
            for key, value in params.items():  # e.g. nprobe, efSearch: search-time settings
                try:
                    faiss.ParameterSpace().set_index_parameter(index, key, float(value))
                except RuntimeError:
                    raise UsageError(
                        f"--index: {name}'s search parameter {key}={value} does not apply to "
                        f"{s['index']} ({type(index).__name__})"
                    ) from None
            shards.append(index)
            rows.append(positions)
        return cls(shards, rows)

    @property
    def rows(self) -> np.ndarray:
        """(ntotal,) int64: global position -> metadata row (concatenated once, on first use)."""
        if self._rows is None:
            one = self.shard_rows[0] if len(self.shard_rows) == 1 else None
            self._rows = one if one is not None else np.concatenate(self.shard_rows)
        return self._rows

    def row_of(self, positions: np.ndarray) -> np.ndarray:
        """Metadata rows of global ``positions`` (any shape, all valid), without concatenating the shards."""
        positions = np.asarray(positions, dtype=np.int64)
        out = np.empty(positions.shape, dtype=np.int64)
        shard = np.searchsorted(self.offsets, positions, side="right") - 1
        for s in np.unique(shard):
            where = shard == s
            out[where] = np.asarray(self.shard_rows[s][positions[where] - self.offsets[s]])
        return out

    def search(self, vectors: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(n, D) float32 -> scores (n, k) descending and global positions (n, k); -1 = no result."""
        if len(self.shards) == 1:
            scores, ids = self.shards[0].search(vectors, k)
            return _ordered(scores, ids)
        scores_all, ids_all = [], []
        for index, offset in zip(self.shards, self.offsets[:-1]):
            kk = min(k, int(index.ntotal))
            if kk == 0:
                continue
            scores, ids = index.search(vectors, kk)  # (n, kk) each
            scores_all.append(scores)
            ids_all.append(np.where(ids >= 0, ids + offset, -1))
        scores, ids = _ordered(np.concatenate(scores_all, axis=1), np.concatenate(ids_all, axis=1))
        return scores[:, :k], ids[:, :k]

    def reconstruct(self, position: int) -> np.ndarray:
        """The stored (or, for PQ, decoded) vector at a global position; safe from many threads."""
        s = int(np.searchsorted(self.offsets, position, side="right") - 1)
        index, local = self.shards[s], int(position - self.offsets[s])
        if s in self._mapped:
            return index.reconstruct(local)
        with self._map_lock:  # until the shard has shown it can reconstruct, one thread at a time
            try:
                vector = index.reconstruct(local)
            except RuntimeError:  # an IVF index reconstructs by id only with its direct map
                make_map = getattr(index, "make_direct_map", None)
                if make_map is None:
                    raise UsageError(
                        f"this {type(index).__name__} index cannot give back a stored vector"
                    ) from None
                make_map()
                vector = index.reconstruct(local)
            self._mapped.add(s)
            return vector


def _ordered(scores: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row sorted by score descending, ties by position ascending; missing results (-1) last."""
    keyed = np.where(ids >= 0, scores, -np.inf)
    big = np.where(ids >= 0, ids, np.iinfo(np.int64).max)
    order = np.lexsort((big, -keyed), axis=-1)  # last key is primary
    return np.take_along_axis(scores, order, axis=1), np.take_along_axis(ids, order, axis=1)
