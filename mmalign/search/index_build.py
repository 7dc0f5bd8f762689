"""The bounded-RAM part of ``mmalign index``: vectors read part by part, shards, ``metadata.arrow``.

Nothing here holds the corpus: the training sample and every block that is added are read from
the ``*_emb_N.npy`` parts through ``np.load(mmap_mode="r")``, one block of ``BLOCK_BYTES`` at a
time; each shard (``shard_ranges``, ``shard_names``) gets its own copy of the one trained
(empty) index, takes a contiguous range of the vectors, is written, and is freed before the next
(``index._write_shards``: FAISS is imported by ``index.py`` alone).  The metadata parts are streamed into one
Arrow IPC file (uncompressed, so a reader can memory-map it) with the union of their columns.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from mmalign.errors import UsageError

BLOCK_BYTES = 64 << 20  # float32 vectors handed to FAISS at once
METADATA_ARROW = "metadata.arrow"


def normalised(x: np.ndarray) -> np.ndarray:
    """float32 rows scaled to unit length (stored float16 vectors are unit-norm only to ~1e-3)."""
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


class Source:
    """The vectors of one modality: the selected rows of each part file, in order.

    ``files[p]`` is a (rows_p, d) .npy; ``rows[p]`` the rows of part p that belong to this index
    (sorted, int32), or None for all of them; ``first_row[p]`` the metadata row of part p's row 0.
    Positions 0..count-1 number the selected rows across parts.
    """

    def __init__(self, files: list[Path], rows: list[np.ndarray | None], dim: int, first_row: list[int]):
        self.files, self.dim, self.first_row = files, dim, first_row
        self.rows = list(rows)
        sizes = [len(r) if r is not None else int(self._part(p).shape[0]) for p, r in enumerate(rows)]
        self.starts = np.cumsum([0] + sizes)  # (parts + 1,)
        self.count = int(self.starts[-1])

    def _sel(self, p: int, a: int, b: int) -> np.ndarray | slice:
        """Part p's rows for its selected positions [a, b) (local numbering)."""
        r = self.rows[p]
        return slice(a, b) if r is None else r[a:b]

    def global_rows(self, start: int, stop: int) -> np.ndarray:
        """(stop - start,) int64 metadata rows of positions [start, stop)."""
        out = []
        for p in range(len(self.files)):
            a, b = max(start, int(self.starts[p])), min(stop, int(self.starts[p + 1]))
            if a < b:
                sel = self._sel(p, a - int(self.starts[p]), b - int(self.starts[p]))
                local = np.arange(sel.start, sel.stop) if isinstance(sel, slice) else sel
                out.append(local.astype(np.int64) + self.first_row[p])
        return np.concatenate(out) if out else np.zeros(0, np.int64)

    def _part(self, p: int) -> np.ndarray:
        return np.load(self.files[p], mmap_mode="r")

    def take(self, positions: np.ndarray) -> np.ndarray:
        """(len(positions), d) float32 unit rows at sorted ``positions``, part by part."""
        positions = np.asarray(positions, dtype=np.int64)
        out = []
        for p in range(len(self.files)):
            a, b = self.starts[p], self.starts[p + 1]
            mine = positions[(positions >= a) & (positions < b)] - a
            if len(mine):
                r = self.rows[p]
                out.append(normalised(self._part(p)[mine if r is None else r[mine]]))
        return np.concatenate(out) if out else np.zeros((0, self.dim), np.float32)

    def sample(self, n: int, seed: int = 0) -> np.ndarray:
        """Sorted positions of ``n`` distinct vectors drawn uniformly over all parts."""
        rng = np.random.default_rng(seed)
        n = min(n, self.count)
        return np.sort(rng.choice(self.count, size=n, replace=False)) if n < self.count else np.arange(n)

    def blocks(
        self, start: int = 0, stop: int | None = None, step: int | None = None
    ) -> Iterator[np.ndarray]:
        """float32 unit vectors of positions [start, stop), ``step`` rows (default: BLOCK_BYTES) at a time."""
        stop = self.count if stop is None else stop
        step = step or max(1024, BLOCK_BYTES // (4 * max(1, self.dim)))
        for p in range(len(self.files)):
            a, b = max(start, int(self.starts[p])), min(stop, int(self.starts[p + 1]))
            if a >= b:
                continue
            part, lo = self._part(p), int(self.starts[p])
            for i in range(a, b, step):
                yield normalised(part[self._sel(p, i - lo, min(b, i + step) - lo)])


def shard_ranges(count: int, shards: int) -> list[tuple[int, int]]:
    """``shards`` contiguous, near-equal ranges of ``range(count)``."""
    edges = np.linspace(0, count, shards + 1).round().astype(np.int64)
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:])]


def shard_names(name: str, shards: int) -> list[tuple[str, str]]:
    """(index file, rows file) per shard: ``image.index`` alone, else ``image.00000.index``, ..."""
    if shards == 1:
        return [(f"{name}.index", f"{name}_rows.npy")]
    return [(f"{name}.{s:05d}.index", f"{name}_rows.{s:05d}.npy") for s in range(shards)]


def metadata_files(emb_dir: Path, n_parts: int) -> list[Path]:
    files = [emb_dir / "metadata" / f"metadata_{i}.parquet" for i in range(n_parts)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UsageError(f"--emb: missing {missing[0]} ({len(missing)} metadata part(s) missing)")
    return files


def union_schema(files: list[Path]):
    """The union of the parts' columns (C1: parts may carry different extra columns).  A column
    whose types no promotion reconciles (whole numbers in one part, JSON text in another) is
    kept as text: every value survives, written as its string."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    schemas = [pq.read_schema(f).remove_metadata() for f in files]
    fields: dict[str, list] = {}
    for schema in schemas:
        for field in schema:
            fields.setdefault(field.name, []).append(field)
    unified = []
    for name, same in fields.items():
        try:
            unified.append(pa.unify_schemas([pa.schema([f]) for f in same], promote_options="permissive")[0])
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
            unified.append(pa.field(name, pa.string()))
    return pa.schema(unified)


def caption_index(files: list[Path]) -> list[np.ndarray]:
    """Per metadata part, its ``caption_index`` column (what picks an image's first row)."""
    import pyarrow.parquet as pq

    return [
        pq.read_table(f, columns=["caption_index"]).column(0).to_numpy(zero_copy_only=False) for f in files
    ]


def write_metadata(files: list[Path], out: Path) -> int:
    """Stream the parts into ``out/metadata.arrow``, one part in memory at a time."""
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    schema = union_schema(files)
    total = 0
    with pa.OSFile(str(out / METADATA_ARROW), "wb") as sink, ipc.new_file(sink, schema) as writer:
        for f in files:
            table = pq.read_table(f)
            cols = [
                table.column(field.name).cast(field.type)
                if field.name in table.column_names
                else pa.nulls(len(table), field.type)
                for field in schema
            ]
            table = pa.Table.from_arrays(cols, schema=schema)
            writer.write_table(table)
            total += len(table)
    return total
