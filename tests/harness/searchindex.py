"""Index directories written by hand (contract C2: FAISS files, ``*_rows.npy``, ``index.json``,
``metadata.arrow``), for the query-side tests: no model, embed or index run needed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np


def read_index_metadata(index_dir):
    """An index directory's ``metadata.arrow`` as a pandas frame, read by pyarrow's own reader."""
    import pyarrow as pa

    with pa.memory_map(str(Path(index_dir) / "metadata.arrow")) as f:
        return pa.ipc.open_file(f).read_pandas()


def unit_vectors(rng, n: int, d: int) -> np.ndarray:
    x = rng.standard_normal((n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def metadata_table(n: int, urls: bool = True):
    import pyarrow as pa

    cols = {
        "key": [f"s{i:05d}" for i in range(n)],
        "caption": [f"caption {i}" for i in range(n)],
        "caption_index": [0] * n,
        "json": ["{}"] * n,
        "url": [f"https://example.org/{i}.jpg" if urls and i % 3 else None for i in range(n)],
        "width": list(range(n)),
    }
    return pa.table(cols)


def write_index_dir(
    out: Path,
    vectors: np.ndarray,
    shards: int,
    factory: str = "Flat",
    search: dict | None = None,
    meta=None,
    seed: int = 0,
    names: tuple[str, ...] = ("image",),
) -> np.ndarray:
    """For each of ``names``, an index over ``vectors`` (in a shuffled row order) split into
    ``shards`` file pairs; ``metadata.arrow`` (``meta`` or :func:`metadata_table`).  Returns
    (count,) position -> metadata row over all shards (the same order for every name)."""
    import faiss
    import pyarrow.ipc as ipc

    out.mkdir(parents=True)
    n, dim = vectors.shape
    rows = np.random.default_rng(seed).permutation(n).astype(np.int64)  # position -> row
    info: dict = {"dim": dim, "metric": "inner_product", "emb_dir": str(out), "model": None, "rows": n}
    for name in names:
        entries = []
        for s, part in enumerate(np.array_split(np.arange(n), shards)):
            index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
            if not index.is_trained:
                index.train(vectors)
            index.add(vectors[rows[part]])
            files = (
                (f"{name}.index", f"{name}_rows.npy")
                if shards == 1
                else (f"{name}.{s:05d}.index", f"{name}_rows.{s:05d}.npy")
            )
            faiss.write_index(index, str(out / files[0]))
            np.save(out / files[1], rows[part])
            entries.append({"index": files[0], "rows": files[1], "count": len(part)})
        kind = {"Flat": "flat"}.get(factory, factory)
        info[name] = {"kind": kind, "factory": factory, "count": n, "search": search or {}, "shards": entries}
    (out / "index.json").write_text(json.dumps(info))
    table = meta if meta is not None else metadata_table(n)
    with ipc.new_file(str(out / "metadata.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=97)  # several record batches
    return rows
