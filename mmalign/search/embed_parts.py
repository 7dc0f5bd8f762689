"""The files of one embedding part: ``img_emb_N.npy``, ``text_emb_N.npy``, ``metadata_N.parquet``.

Metadata columns: the fixed ones (:data:`METADATA_COLUMNS`), then one column per top-level field
of the samples' ``.json`` that is not a fixed name, under the json's own name, in the order the
fields first appear in the part (img2dataset's ``url``, ``status``, ``error_message``, ``width``,
``height``, ``original_width``, ``original_height``, ``exif``, ``sha256``, ...; its ``key`` and
``caption`` are fixed names, and the fixed column wins). A sample without the field has null.

Types: a field whose values in the part are all str, all bool, all int (int64), or int and float
(float64) keeps that type; an object or a list becomes its JSON string (keys sorted), and so does
every value of a field whose values mix other types (``1`` and ``"1"``). So two parts can differ in
their extra columns, and in an extra column's type: a reader unions them (missing = null).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

EMBED_INFO = (
    "embed.json"  # the embedding directory's record (here, not in embed.py: index reads it without torch)
)

METADATA_COLUMNS = ["key", "caption", "caption_index", "json", "source_path", "file", "offset"]


def _json_text(value) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _column(values: list):
    """One extra column as a pyarrow array (module docstring: types)."""
    import pyarrow as pa

    kinds = {type(v) for v in values if v is not None}
    if not kinds:
        return pa.nulls(len(values))
    if kinds <= {dict, list}:
        return pa.array([None if v is None else _json_text(v) for v in values], pa.string())
    typed = {str: pa.string(), bool: pa.bool_(), int: pa.int64(), float: pa.float64()}
    if kinds == {int, float}:
        kinds = {float}
        values = [None if v is None else float(v) for v in values]
    if len(kinds) == 1 and (kind := next(iter(kinds))) in typed:
        try:
            return pa.array(values, typed[kind])
        except (OverflowError, pa.ArrowException):  # an int past int64
            pass
    return pa.array([None if v is None else _json_text(v) for v in values], pa.string())


def metadata_table(rows: list[dict], fields: list[dict]):
    """``rows`` (the fixed columns) and each row's ``.json`` fields -> a pyarrow table."""
    import pyarrow as pa

    columns = {
        "key": pa.array([r["key"] for r in rows], pa.string()),
        "caption": pa.array([r["caption"] for r in rows], pa.string()),
        "caption_index": pa.array([r["caption_index"] for r in rows], pa.int32()),
        "json": pa.array([r["json"] for r in rows], pa.string()),
        "source_path": pa.array([r["source_path"] for r in rows], pa.string()),
        "file": pa.array([r["file"] for r in rows], pa.string()),
        "offset": pa.array([r["offset"] for r in rows], pa.int64()),
    }
    names: dict[str, None] = {}  # first appearance order
    for f in fields:
        names.update((k, None) for k in f if k not in columns and isinstance(k, str))
    for name in names:
        columns[name] = _column([f.get(name) for f in fields])
    return pa.table(columns)


class PartWriter:
    """Buffers rows and writes ``DIR/img_emb_N.npy`` (and ``text_emb_N``, ``metadata_N``) every
    ``part_size`` rows, N counting from 0 in this writer's folder."""

    def __init__(self, folder: Path, part_size: int, with_text: bool):
        self.folder, self.part_size, self.with_text = folder, int(part_size), with_text
        self.img: list[np.ndarray] = []
        self.txt: list[np.ndarray] = []
        self.meta: list[dict] = []
        self.fields: list[dict] = []
        self.parts = 0
        self.rows = 0
        folder.mkdir(parents=True, exist_ok=True)

    def add(self, img: np.ndarray, txt: np.ndarray | None, meta: list[dict], fields: list[dict]) -> None:
        self.img.append(img)
        if txt is not None:
            self.txt.append(txt)
        self.meta.extend(meta)
        self.fields.extend(fields)
        while len(self.meta) >= self.part_size:
            self._flush(self.part_size)

    def _flush(self, n: int) -> None:
        import pyarrow.parquet as pq

        img = np.concatenate(self.img)
        np.save(self.folder / f"img_emb_{self.parts}.npy", img[:n])
        self.img = [img[n:]]
        if self.with_text:
            txt = np.concatenate(self.txt)
            np.save(self.folder / f"text_emb_{self.parts}.npy", txt[:n])
            self.txt = [txt[n:]]
        pq.write_table(
            metadata_table(self.meta[:n], self.fields[:n]), self.folder / f"metadata_{self.parts}.parquet"
        )
        self.meta, self.fields = self.meta[n:], self.fields[n:]
        self.parts += 1
        self.rows += n

    def close(self) -> None:
        if self.meta:
            self._flush(len(self.meta))
