"""``mmalign index``: FAISS inner-product indexes over an ``mmalign embed`` directory.

Two indexes, one per modality: ``image`` holds each image once (the rows with
``caption_index == 0``) and ``text`` every caption row.  The kind and its parameters come from a
memory budget (``index_plan``: Flat, HNSW, IVF-Flat, OPQ+IVF-PQ, IVF-PQ, the most accurate that
fits), or without one from the old rule (Flat up to ``exact_max`` vectors, else IVF-PQ).  The
search-time knob (``nprobe``/``efSearch``) is tuned on held-out queries against exact search
(``index_tune``).  The build reads the parts through mmap, trains on a sample and adds part by
part into one or N shards (``index_build``).

Output (contract C2)::

    OUT/image.index, OUT/image_rows.npy     one shard; with --shards N: image.00000.index, ...
    OUT/text.index,  OUT/text_rows.npy      (when the embeddings have captions)
    OUT/metadata.arrow                      every row of the embedding directory (Arrow IPC file)
    OUT/index.json                          dim, metric, rows, and per modality: kind, factory,
                                            count, search, shards, memory, recall, latency_ms

Vectors are re-normalised in float32 before they are added: the stored float16
values are only unit-norm to ~1e-3, and inner product should be the cosine.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from mmalign.errors import UsageError
from mmalign.extras import extra
from mmalign.search.embed_parts import EMBED_INFO
from mmalign.search.index_build import (
    Source,
    metadata_files,
    normalised,
    shard_names,
    shard_ranges,
    write_metadata,
)
from mmalign.search.index_build import caption_index as read_caption_index
from mmalign.search.index_plan import SMALL, choose_plan, format_size, opq_helps, parse_size, train_size
from mmalign.search.index_tune import TRUTH_K, exact_topk, holdout_size, tune

INDEX_INFO = "index.json"
_normalised = normalised  # the name older callers import
PQ_POINTS_PER_CENTROID = 100  # PQ (and OPQ) training points per codebook centroid
FLAT_PROBE = 20_000  # vectors a brute-force query is timed over (then scaled to the corpus)


def _parts(emb_dir: Path, kind: str, n_parts: int) -> list[Path]:
    files = [emb_dir / f"{kind}_emb" / f"{kind}_emb_{i}.npy" for i in range(n_parts)]
    missing = [f for f in files if not f.is_file()]
    if missing:
        raise UsageError(f"--emb: missing {missing[0]} ({len(missing)} part file(s) missing)")
    return files


def _faiss():
    """FAISS, or one line naming the ``[search]`` extra (build_index says it first, before any work)."""
    with extra("search", "mmalign index"):
        import faiss
    return faiss


def read_embeddings_info(emb_dir: str | Path) -> dict:
    emb_dir = Path(emb_dir)
    info_file = emb_dir / EMBED_INFO
    if not info_file.is_file():
        raise UsageError(
            f"--emb: {emb_dir} is not an embedding directory (no {EMBED_INFO}; run `mmalign embed`)"
        )
    return json.loads(info_file.read_text())


def _flat_ms(sample: np.ndarray, count: int) -> float:
    """ms of one exact query over ``count`` vectors, timed over (part of) the sample and scaled."""
    faiss = _faiss()

    base = sample[:FLAT_PROBE]
    flat = faiss.IndexFlatIP(base.shape[1])
    flat.add(base)
    t0 = time.perf_counter()
    for q in base[:20]:
        flat.search(q[None, :], 10)
    return (time.perf_counter() - t0) * 1000 / min(20, len(base)) * count / len(base)


def _write_shards(empty, source: Source, name: str, shards: int, out: Path) -> list[dict]:
    """Fill a copy of the trained ``empty`` index per shard, block by block, and write it with its
    rows file (shard position -> metadata row); one shard in memory at a time.  C2's ``shards``."""
    faiss = _faiss()

    entries = []
    for (a, b), (index_file, rows_file) in zip(shard_ranges(source.count, shards), shard_names(name, shards)):
        index = faiss.clone_index(empty)
        for block in source.blocks(a, b):
            index.add(block)
        faiss.write_index(index, str(out / index_file))
        del index
        np.save(out / rows_file, source.global_rows(a, b))
        entries.append({"index": index_file, "rows": rows_file, "count": b - a})
    return entries


def _set_knob(shards: list, knob: str, value: int) -> None:
    faiss = _faiss()

    for index, _ in shards:
        faiss.ParameterSpace().set_index_parameter(index, knob, int(value))


def _lighter_opq(index, params: dict):
    """OPQ's rotation trained against a PQ of the index's own code size and with 25 rounds,
    not its defaults (8-bit codes, 50 rounds): half the training, same kind of rotation."""
    faiss = _faiss()

    pre: Any = faiss.downcast_index(index)  # IndexPreTransform: the rotation, then the IVF-PQ
    opq: Any = faiss.downcast_VectorTransform(pre.chain.at(0))
    pq = faiss.ProductQuantizer(opq.d_out, int(params["m"]), int(params["nbits"]))
    pq.cp.max_points_per_centroid = PQ_POINTS_PER_CENTROID
    opq.pq, opq.niter = pq, 25
    opq.max_train_points = min(opq.max_train_points, PQ_POINTS_PER_CENTROID * 2 ** int(params["nbits"]))
    return pq


def _open_shards(out: Path, entries: list[dict]) -> list[tuple[Any, int]]:
    """The written shards, memory-mapped where FAISS can, each with its first position."""
    faiss = _faiss()

    shards, start = [], 0
    for e in entries:
        path = str(out / e["index"])
        try:
            index = faiss.read_index(path, faiss.IO_FLAG_MMAP | faiss.IO_FLAG_READ_ONLY)
        except RuntimeError:  # a kind FAISS cannot map
            index = faiss.read_index(path)
        shards.append((index, start))
        start += int(e["count"])
    return shards


def _build_one(
    source: Source,
    name: str,
    out: Path,
    *,
    budget: int | None,
    kind: str,
    shards: int,
    max_query_ms: float,
    min_recall: float,
    exact_max: int | None,
    nlist: int | None,
    pq_m: int | None,
    nbits: int | None,
    nprobe: int | None,
    holdout: int,
    seed: int,
) -> dict:
    """Choose, train, fill and tune one modality's index; returns its index.json entry."""
    faiss = _faiss()

    count, dim = source.count, source.dim
    train = source.take(source.sample(train_size(count), seed))  # (t, d), read through mmap
    flat_ms = 0.0
    if budget is not None and kind == "auto" and count >= SMALL and count * 4 * dim <= budget:
        flat_ms = _flat_ms(train, count)
    opts: dict[str, Any] = {"flat_ms": flat_ms, "max_query_ms": max_query_ms, "train_rows": len(train)}
    opts |= {"exact_max": exact_max, "nlist": nlist, "pq_m": pq_m, "nbits": nbits, "shards": shards}
    plan = choose_plan(count, dim, budget, kind=kind, **opts)
    if plan.kind == "opq-ivf-pq" and kind == "auto" and not opq_helps(train[:20_000], plan.params["m"]):
        plan = choose_plan(count, dim, budget, kind=kind, opq=False, **opts)
    p = plan.params
    if "nlist" in p and len(train) < p["nlist"] or "nbits" in p and len(train) < 2 ** p["nbits"]:
        raise UsageError(
            f"{plan.factory} needs at least max(nlist={p['nlist']}, 2^nbits={2 ** p.get('nbits', 0)}) "
            f"training vectors, have {len(train)}"
        )
    empty = faiss.index_factory(dim, plan.factory, faiss.METRIC_INNER_PRODUCT)
    if plan.kind in ("ivf-pq", "opq-ivf-pq"):  # no Hamming-distance filter at search: skip its training
        ivfpq: Any = faiss.downcast_index(faiss.extract_index_ivf(empty))
        ivfpq.do_polysemous_training = False
        # PQ training costs m k-means of 2^nbits centroids whatever the dim: 100 points a
        # centroid (FAISS's default samples 256) keeps a large m affordable
        ivfpq.pq.cp.max_points_per_centroid = PQ_POINTS_PER_CENTROID
    if plan.kind == "opq-ivf-pq":
        keep = _lighter_opq(empty, p)  # noqa: F841  (FAISS keeps a raw pointer to it while training)
    if not empty.is_trained:
        empty.train(train)  # once; every shard gets a copy of the trained, empty index
    train_rows = 0 if plan.kind in ("flat", "hnsw") else len(train)  # those two train nothing
    del train
    entries = _write_shards(empty, source, name, shards, out)
    measured = sum((out / e["index"]).stat().st_size for e in entries)
    estimated = plan.estimated_bytes  # all shards, each with its copy of the trained part

    opened = _open_shards(out, entries)
    queries = source.take(source.sample(holdout_size(count, dim, holdout), seed + 1))  # (q, d)
    truth = exact_topk(source, queries, TRUTH_K)
    knob = {"hnsw": "efSearch", "flat": None}.get(plan.kind, "nprobe")
    tuned = tune(
        opened,
        queries,
        truth,
        knob=knob,
        limit=int(p["nlist"]) if knob == "nprobe" else 2048,
        fixed=nprobe if knob == "nprobe" else None,
        min_recall=min_recall,
        max_query_ms=max_query_ms,
        set_knob=_set_knob,
    )
    del opened
    entry = {
        "kind": plan.kind,
        "factory": plan.factory,
        "count": count,
        **p,
        "search": tuned["search"],
        **tuned["search"],  # nprobe at this level too: the reader before `search` existed sets it
        "shards": entries,
        "memory": {
            "budget_bytes": budget,
            "estimated_bytes": int(estimated),
            "measured_bytes": int(measured),
        },
        "recall": tuned["recall"],
        "latency_ms": tuned["latency_ms"],
        "target": {
            "min_recall": min_recall,
            "max_query_ms": max_query_ms,
            "met": tuned["target_met"],
            "note": tuned["note"],
        },
        "choice": plan.note,
        "train_rows": int(train_rows),
        "tune_queries": int(len(queries)),
    }
    return entry


def _or_hnsw(ivf: dict, source: Source, name: str, out: Path, opts: dict, log) -> dict:
    """IVF-Flat missed the target: build HNSW beside it (when it fits the budget) and keep the one
    that meets the target, else the one with the higher recall@10 (its files replace the other's)."""
    import shutil

    trial = out / f".{name}.hnsw-trial"
    trial.mkdir(parents=True, exist_ok=True)
    try:
        hnsw = _build_one(source, name, trial, kind="hnsw", **{**opts, "nprobe": None})
    except UsageError:  # HNSW does not fit the budget: IVF-Flat stays
        shutil.rmtree(trial, ignore_errors=True)
        return ivf
    better = hnsw["target"]["met"] or hnsw["recall"]["@10"] > ivf["recall"]["@10"]
    if better:
        for shard in hnsw["shards"]:
            for key in ("index", "rows"):
                (trial / shard[key]).replace(out / shard[key])
    shutil.rmtree(trial, ignore_errors=True)
    kept, other = (hnsw, ivf) if better else (ivf, hnsw)
    kept["choice"] = (
        f"{ivf['factory']} missed the target (recall@10 {ivf['recall']['@10']}); {hnsw['factory']} "
        f"tried beside it (recall@10 {hnsw['recall']['@10']}): kept {kept['factory']}"
    )
    kept["tried"] = {"factory": other["factory"], "search": other["search"], "recall": other["recall"]}
    if log is not None:
        log(f"{name}: {kept['choice']}")
    return kept


def build_index(
    emb_dir: str | Path,
    out: str | Path,
    *,
    exact_max: int | None = None,
    nlist: int | None = None,
    pq_m: int | None = None,
    nbits: int | None = None,
    nprobe: int | None = None,
    max_index_memory: int | str | None = None,
    max_query_ms: float = 10.0,
    min_recall: float = 0.9,
    shards: int = 1,
    kind: str = "auto",
    holdout: int = 1000,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Build the image (and text) indexes of ``emb_dir`` into ``out``; returns ``index.json``'s content.

    ``max_index_memory`` (bytes or "4G") is shared by the modalities in proportion to their vector
    counts.  ``nprobe`` fixes the probe count instead of tuning it.
    """
    _faiss()  # a missing [search] extra is the first thing said

    budget = None if max_index_memory is None else parse_size(max_index_memory)
    if int(shards) < 1:
        raise UsageError(f"--shards: {shards} must be at least 1")
    if not 0 < min_recall <= 1:
        raise UsageError(f"--min-recall: {min_recall} must be in (0, 1]")
    if max_query_ms <= 0:
        raise UsageError(f"--max-query-ms: {max_query_ms} must be positive")
    emb_dir, out = Path(emb_dir), Path(out)
    info = read_embeddings_info(emb_dir)
    dim, n_parts = int(info["dim"]), int(info["parts"])
    kinds = ["img"] + (["text"] if info.get("text") else [])
    files = {k: _parts(emb_dir, k, n_parts) for k in kinds}
    meta_files = metadata_files(emb_dir, n_parts)
    caption_index = read_caption_index(meta_files)  # per part: (rows_p,)
    sizes = []
    for kind_ in kinds:
        for f in files[kind_]:
            shape = np.load(f, mmap_mode="r").shape
            if len(shape) != 2 or shape[1] != dim:
                raise UsageError(f"--emb: {f} has shape {shape}, expected (rows, {dim})")
            if kind_ == "img":
                sizes.append(shape[0])
    if sum(sizes) != sum(len(c) for c in caption_index) or any(
        a != len(c) for a, c in zip(sizes, caption_index)
    ):
        raise UsageError(
            f"--emb: {sum(sizes)} embedding rows but {sum(len(c) for c in caption_index)} metadata rows in {emb_dir}"
        )
    offsets = np.cumsum([0] + sizes)
    first_row = [int(o) for o in offsets[:-1]]
    # Per part: which of its rows go into each index (image: an image's first row only; text: all).
    sources = {
        "img": Source(
            files["img"], [np.flatnonzero(ci == 0).astype(np.int32) for ci in caption_index], dim, first_row
        )
    }
    del caption_index
    if "text" in kinds:
        sources["text"] = Source(files["text"], [None] * n_parts, dim, first_row)
    fewest = min(s.count for s in sources.values())
    if int(shards) > fewest:
        raise UsageError(f"--shards: {shards} shards but only {fewest} vectors to index")
    total = sum(s.count for s in sources.values())

    out.mkdir(parents=True, exist_ok=True)
    record: dict = {
        "dim": dim,
        "metric": "inner_product",
        "emb_dir": str(emb_dir.resolve()),
        "model": info.get("model"),
        "rows": int(offsets[-1]),
    }
    for kind_, name in (("img", "image"), ("text", "text")):
        if kind_ not in kinds:
            continue
        source = sources[kind_]
        share = None if budget is None else int(budget * source.count / total)  # modalities split the budget
        opts: dict[str, Any] = {"budget": share, "shards": int(shards), "max_query_ms": max_query_ms}
        opts |= {"min_recall": min_recall, "exact_max": exact_max, "nlist": nlist, "pq_m": pq_m}
        opts |= {"nbits": nbits, "nprobe": nprobe, "holdout": holdout, "seed": seed}
        entry = _build_one(source, name, out, kind=kind, **opts)
        if kind == "auto" and entry["kind"] == "ivf-flat" and not entry["target"]["met"]:
            entry = _or_hnsw(entry, source, name, out, opts, log)
        record[name] = entry
        if log is not None and not entry["target"]["met"]:
            log(f"{name}: target not met: {entry['target']['note']} ({entry['factory']}, {entry['search']})")
        if log is not None and share is not None:
            log(
                f"{name}: {entry['factory']} ({entry['choice']}), "
                f"{format_size(entry['memory']['measured_bytes'])} of {format_size(share)}"
            )
    write_metadata(meta_files, out)
    (out / INDEX_INFO).write_text(json.dumps(record, indent=2))
    return record
