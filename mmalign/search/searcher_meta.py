"""An index directory's metadata rows, read by row number without loading the table.

``metadata.arrow`` (an uncompressed Arrow IPC file, written by ``mmalign index``) is opened
through a memory map: its record batches are views of the file, so opening a 100M-row
table costs the batch headers, and reading a row touches only that row's pages.  An old
index directory's ``metadata.parquet`` is read whole instead (it was small enough then).

Every access reads immutable Arrow arrays: safe from many threads without a lock.
"""

from __future__ import annotations

import datetime
import decimal
import math
from pathlib import Path
from typing import Any

import numpy as np

from mmalign.errors import UsageError

METADATA_ARROW = "metadata.arrow"
METADATA_PARQUET = "metadata.parquet"


def jsonable(value: Any) -> Any:
    """An Arrow scalar's Python value as something ``json.dumps`` writes as valid JSON."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None  # NaN is not JSON
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).decode("utf-8", "replace")
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, decimal.Decimal):
        return float(value)
    return str(value)


class MetadataTable:
    """Rows of an index directory's metadata, by row number (``metadata.arrow`` or ``metadata.parquet``)."""

    def __init__(self, index_dir: Path):
        import pyarrow as pa
        import pyarrow.ipc as ipc
        import pyarrow.parquet as pq

        arrow, parquet = index_dir / METADATA_ARROW, index_dir / METADATA_PARQUET
        if arrow.is_file():
            try:
                reader = ipc.open_file(pa.memory_map(str(arrow), "r"))
                batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]  # views
                schema = reader.schema
            except (pa.ArrowInvalid, OSError) as e:
                raise UsageError(f"--index: cannot read {arrow} ({e})") from None
            self.path = arrow
        elif parquet.is_file():
            table = pq.read_table(parquet)  # an old index: read whole
            batches, schema = table.to_batches(), table.schema
            self.path = parquet
        else:
            raise UsageError(f"--index: {index_dir} has no {METADATA_ARROW} (nor an old {METADATA_PARQUET})")
        self.columns = [n for n in schema.names if not n.startswith("__")]  # pandas' index columns left out
        self._batches = [b for b in batches if b.num_rows]
        self._starts = np.cumsum([0] + [b.num_rows for b in self._batches])  # (B+1,) first row of each batch
        self.num_rows = int(self._starts[-1])

    def __len__(self) -> int:
        return self.num_rows

    def _check(self, rows: np.ndarray) -> None:
        if len(rows) and (rows.min() < 0 or rows.max() >= self.num_rows):
            bad = rows[(rows < 0) | (rows >= self.num_rows)][0]
            raise UsageError(f"row {int(bad)} is outside the metadata's [0, {self.num_rows})")

    def _groups(self, rows) -> tuple[np.ndarray, list]:
        """``rows`` checked, and grouped by record batch: [(batch, positions in rows, Arrow indices)]."""
        import pyarrow as pa

        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        self._check(rows)
        batch_of = np.searchsorted(self._starts, rows, side="right") - 1  # (n,) batch of each row
        groups = []
        for b in np.unique(batch_of):
            where = np.flatnonzero(batch_of == b)
            groups.append((int(b), where, pa.array(rows[where] - self._starts[b])))
        return rows, groups

    def _take(self, column: str, n: int, groups: list) -> list:
        out: list = [None] * n
        if column not in self.columns:
            return out
        for b, where, local in groups:
            for i, v in zip(where, self._batches[b].column(column).take(local).to_pylist()):
                out[i] = v
        return out

    def values(self, column: str, rows) -> list:
        """The Python values of ``column`` at ``rows`` (in that order); None where absent."""
        rows, groups = self._groups(rows)
        return self._take(column, len(rows), groups)

    def rows(self, rows) -> list[dict]:
        """All columns of each of ``rows``, JSON-able (the rows grouped by batch once, not per column)."""
        rows, groups = self._groups(rows)
        columns = {c: self._take(c, len(rows), groups) for c in self.columns}
        return [{c: jsonable(columns[c][i]) for c in self.columns} for i in range(len(rows))]

    def column(self, column: str) -> np.ndarray:
        """A whole column as a numpy array (object dtype for strings): for per-corpus tables only."""
        if column not in self.columns:
            raise KeyError(column)
        parts = [b.column(column).to_numpy(zero_copy_only=False) for b in self._batches]
        return np.concatenate(parts) if parts else np.array([])
