"""``mmalign index``: FAISS inner-product indexes over an ``mmalign embed`` directory.

Two indexes, one per modality: ``image.index`` holds each image once (the rows with
``caption_index == 0``) and ``text.index`` every caption row.  A corpus of at most
``exact_max`` vectors gets an exact ``IndexFlatIP``; a larger one an ``IVF{nlist},PQ{m}x{nbits}``
index (inner product), trained on a sample and then filled part by part.

Output::

    OUT/image.index, OUT/text.index     FAISS indexes
    OUT/image_rows.npy, text_rows.npy   (n,) int64: index position -> metadata row
    OUT/metadata.parquet                every row of the embedding directory, in order
    OUT/index.json                      dim, metric, and per index: kind, count, nlist, m, nbits, nprobe

Vectors are re-normalised in float32 before they are added: the stored float16
values are only unit-norm to ~1e-3, and inner product should be the cosine.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, cast

import numpy as np

from mmalign.errors import UsageError
from mmalign.extras import extra
from mmalign.search.embed import EMBED_INFO

INDEX_INFO = "index.json"
METADATA = "metadata.parquet"


def _parts(emb_dir: Path, kind: str, n_parts: int) -> list[Path]:
    files = [emb_dir / f"{kind}_emb" / f"{kind}_emb_{i}.npy" for i in range(n_parts)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UsageError(f"--emb: missing {missing[0]} ({len(missing)} part file(s) missing)")
    return files


def read_embeddings_info(emb_dir: str | Path) -> dict:
    emb_dir = Path(emb_dir)
    info_file = emb_dir / EMBED_INFO
    if not info_file.is_file():
        raise UsageError(
            f"--emb: {emb_dir} is not an embedding directory (no {EMBED_INFO}; run `mmalign embed`)"
        )
    return json.loads(info_file.read_text())


def load_metadata(emb_dir: Path, n_parts: int):
    import pandas as pd

    files = [emb_dir / "metadata" / f"metadata_{i}.parquet" for i in range(n_parts)]
    for f in files:
        if not f.is_file():
            raise UsageError(f"--emb: missing {f}")
    return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)


def _normalised(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norms, 1e-12)


def ivf_params(
    count: int, dim: int, nlist: int | None, pq_m: int | None, nbits: int | None, train_rows: int
) -> dict:
    """Defaults: nlist ~ 4 sqrt(n) (with >= 39 training points per list, FAISS's own
    minimum), PQ with about dim/4 sub-quantizers (a divisor of dim), 8 bits or fewer
    when the training sample cannot fill 2^nbits centroids."""
    if nlist is None:
        nlist = max(1, min(int(4 * math.sqrt(count)), train_rows // 39))
    if pq_m is None:
        pq_m = max(m for m in range(1, max(1, dim // 4) + 1) if dim % m == 0)
    if dim % pq_m:
        raise UsageError(f"--pq-m={pq_m} must divide the embedding dim {dim}")
    if nbits is None:
        nbits = max(1, min(8, int(math.log2(max(2, train_rows)))))
    if train_rows < nlist or train_rows < 2**nbits:
        raise UsageError(
            f"IVF-PQ needs at least max(nlist={nlist}, 2^nbits={2**nbits}) training vectors, "
            f"have {train_rows}"
        )
    return {"nlist": int(nlist), "m": int(pq_m), "nbits": int(nbits)}


def _build_one(
    parts: list[Path],
    rows: list[np.ndarray],
    dim: int,
    *,
    exact_max: int,
    nlist,
    pq_m,
    nbits,
    nprobe: int,
    train_max: int = 100_000,
):
    """One index over the selected rows of each part file; returns (index, params)."""
    with extra("search", "mmalign index"):
        import faiss

    count = int(sum(len(r) for r in rows))
    index: faiss.Index
    params: dict[str, Any]
    if count <= exact_max:
        index, params = faiss.IndexFlatIP(dim), {"kind": "flat", "factory": "Flat"}
    else:
        sample, have = [], 0  # a training sample from the first parts, read through mmap
        for f, r in zip(parts, rows):
            if have >= train_max:
                break
            take = r[: train_max - have]
            sample.append(_normalised(np.load(f, mmap_mode="r")[take]))
            have += len(take)
        train = np.concatenate(sample)
        p = ivf_params(count, dim, nlist, pq_m, nbits, len(train))
        factory = f"IVF{p['nlist']},PQ{p['m']}x{p['nbits']}"
        # the factory's index comes back as its own class (IndexIVFPQ), which has nprobe
        ivf = cast("faiss.IndexIVF", faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT))
        ivf.train(train)
        ivf.nprobe = min(int(nprobe), p["nlist"])
        index = ivf
        params = {
            "kind": "ivfpq",
            "factory": factory,
            **p,
            "nprobe": int(ivf.nprobe),
            "train_rows": len(train),
        }
    for f, r in zip(parts, rows):
        if len(r):
            index.add(_normalised(np.load(f, mmap_mode="r")[r]))
    return index, {**params, "count": count}


def build_index(
    emb_dir: str | Path,
    out: str | Path,
    *,
    exact_max: int = 100_000,
    nlist: int | None = None,
    pq_m: int | None = None,
    nbits: int | None = None,
    nprobe: int = 16,
) -> dict:
    """Build ``image.index`` (and ``text.index``) from ``emb_dir``; returns ``index.json``'s content."""
    with extra("search", "mmalign index"):
        import faiss

    emb_dir, out = Path(emb_dir), Path(out)
    info = read_embeddings_info(emb_dir)
    dim, n_parts = int(info["dim"]), int(info["parts"])
    meta = load_metadata(emb_dir, n_parts)
    kinds = ["img"] + (["text"] if info.get("text") else [])
    files = {k: _parts(emb_dir, k, n_parts) for k in kinds}
    # Per part: which of its rows go into each index (image: an image's first row only).
    offsets = np.cumsum([0] + [int(np.load(f, mmap_mode="r").shape[0]) for f in files["img"]])
    if offsets[-1] != len(meta):
        raise UsageError(f"--emb: {offsets[-1]} embedding rows but {len(meta)} metadata rows in {emb_dir}")
    first = meta["caption_index"].to_numpy() == 0
    selected = {"img": [np.flatnonzero(first[a:b]) for a, b in zip(offsets[:-1], offsets[1:])]}
    if "text" in kinds:
        selected["text"] = [np.arange(b - a) for a, b in zip(offsets[:-1], offsets[1:])]
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "dim": dim,
        "metric": "inner_product",
        "emb_dir": str(emb_dir.resolve()),
        "model": info.get("model"),
        "rows": int(len(meta)),
    }
    for kind, name in (("img", "image"), ("text", "text")):
        if kind not in kinds:
            continue
        for f in files[kind]:
            shape = np.load(f, mmap_mode="r").shape
            if len(shape) != 2 or shape[1] != dim:
                raise UsageError(f"--emb: {f} has shape {shape}, expected (rows, {dim})")
        index, params = _build_one(
            files[kind],
            selected[kind],
            dim,
            exact_max=exact_max,
            nlist=nlist,
            pq_m=pq_m,
            nbits=nbits,
            nprobe=nprobe,
        )
        faiss.write_index(index, str(out / f"{name}.index"))
        rows = np.concatenate([s + a for s, a in zip(selected[kind], offsets[:-1])]).astype(np.int64)
        np.save(out / f"{name}_rows.npy", rows)  # index position -> metadata row
        record[name] = params
    meta.to_parquet(out / METADATA, index=False)
    (out / INDEX_INFO).write_text(json.dumps(record, indent=2))
    return record
