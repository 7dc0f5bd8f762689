"""Tuning an index's search-time knob on held-out queries, against exact search.

The held-out queries are a sample of the indexed vectors.  Their exact top-100 comes from a
brute-force scan over the parts, block by block (the corpus is never held whole).  ``nprobe``
(IVF kinds) or ``efSearch`` (HNSW) then grows until recall@10 reaches the target, while one query
(k=10, one at a time, as a server answers it) stays within the time limit; when both cannot hold,
the largest setting within the time wins and the record says why.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from mmalign.search.index_build import BLOCK_BYTES, Source

TRUTH_K = 100
LATENCY_QUERIES = 50  # single-query searches timed per setting
RECALL_KS = (1, 10, 100)
_SCHEDULE = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def holdout_size(count: int, dim: int, most: int = 1000) -> int:
    """Queries to tune on: ``most``, fewer for a huge corpus (the exact scan costs n*d per query)."""
    budget_flops = 5e11
    return int(min(count, most, max(100, budget_flops // max(1, count * dim))))


def exact_topk(source: Source, queries: np.ndarray, k: int) -> np.ndarray:
    """(q, k) positions of the exact top-k by inner product, merging each block's top-k."""
    k = min(k, source.count)
    best_s = np.full((len(queries), 0), -np.inf, np.float32)
    best_i = np.zeros((len(queries), 0), np.int64)
    offset = 0
    step = max(k + 1, BLOCK_BYTES // (16 * max(1, len(queries))))  # (q, b) scores, their order: ~BLOCK_BYTES
    for block in source.blocks(step=step):
        scores = queries @ block.T  # (q, b)
        if scores.shape[1] > k:  # the block's own top-k first (unordered), then a small sort
            part = np.argpartition(-scores, k - 1, axis=1)[:, :k]
            scores, ids = np.take_along_axis(scores, part, 1), part + offset
        else:
            ids = offset + np.broadcast_to(np.arange(block.shape[0]), scores.shape)
        s, i = np.concatenate([best_s, scores], axis=1), np.concatenate([best_i, ids], axis=1)
        top = _order(s, i)[:, :k]
        best_s, best_i = np.take_along_axis(s, top, 1), np.take_along_axis(i, top, 1)
        offset += block.shape[0]
    return best_i


def _order(s: np.ndarray, i: np.ndarray) -> np.ndarray:
    """Per row: indices sorting by score descending, ties by position ascending."""
    return np.stack([np.lexsort((ii, -ss)) for ss, ii in zip(s, i)])


def search_shards(shards: list[tuple[object, int]], queries: np.ndarray, k: int) -> np.ndarray:
    """(q, k) global positions: every (index, first position) shard searched, top-k merged."""
    all_s, all_i = [], []
    for index, start in shards:
        s, i = index.search(queries, k)  # type: ignore[attr-defined]
        all_s.append(s)
        all_i.append(np.where(i >= 0, i + start, -1))
    s, i = np.concatenate(all_s, 1), np.concatenate(all_i, 1)
    s = np.where(i >= 0, s, -np.inf)
    top = np.argsort(-s, axis=1, kind="stable")[:, :k]
    return np.take_along_axis(i, top, 1)


def recall_at(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean fraction of the exact top-k found in the returned top-k."""
    k = min(k, truth.shape[1])
    return float(np.mean([len(set(f[:k]) & set(t[:k])) / k for f, t in zip(found, truth)]))


def recalls(found: np.ndarray, truth: np.ndarray) -> dict:
    return {f"@{k}": round(recall_at(found, truth, k), 4) for k in RECALL_KS}


def latency_ms(shards, queries: np.ndarray, k: int = 10) -> dict:
    """p50/p99 of single-query searches over all shards (ms)."""
    times = []
    for q in queries[:LATENCY_QUERIES]:
        t0 = time.perf_counter()
        search_shards(shards, q[None, :], k)
        times.append((time.perf_counter() - t0) * 1000)
    return {
        "p50": round(float(np.percentile(times, 50)), 4),
        "p99": round(float(np.percentile(times, 99)), 4),
    }


def tune(
    shards,
    queries: np.ndarray,
    truth: np.ndarray,
    *,
    knob: str | None,
    limit: int,
    fixed: int | None,
    min_recall: float,
    max_query_ms: float,
    set_knob: Callable[[list, str, int], None],
) -> dict:
    """Choose ``knob``'s value (None: nothing to tune) and measure the result.

    ``limit``: the largest sensible value (nlist for nprobe); ``fixed``: a value the user set;
    ``set_knob(shards, knob, value)`` sets it on every shard (FAISS stays in ``index.py``).
    Returns {search, recall, latency_ms, target_met, note}.
    """
    k = min(TRUTH_K, truth.shape[1])

    def measure(value: int | None) -> tuple[dict, dict]:
        if knob is not None and value is not None:
            set_knob(shards, knob, value)
        return recalls(search_shards(shards, queries, k), truth), latency_ms(shards, queries)

    if knob is None or fixed is not None:
        value = None if knob is None else min(int(fixed), limit) if knob == "nprobe" else int(fixed)  # type: ignore[arg-type]
        rec, lat = measure(value)
        met = rec["@10"] >= min_recall and lat["p50"] <= max_query_ms
        note = "" if met else _why(rec, lat, min_recall, max_query_ms)
        return {
            "search": {} if value is None else {knob: value},
            "recall": rec,
            "latency_ms": lat,
            "target_met": met,
            "note": note,
        }

    values = [v for v in _SCHEDULE if v < limit] + [limit]
    tried: list[tuple[int, dict, dict]] = []
    for v in values:
        rec, lat = measure(v)
        if lat["p50"] > max_query_ms and tried:
            break  # slower than allowed: keep the best setting within the time
        tried.append((v, rec, lat))
        if rec["@10"] >= min_recall or lat["p50"] > max_query_ms:
            break
        if len(tried) >= 3 and tried[-1][1]["@10"] - tried[-3][1]["@10"] < 1e-3:
            break  # the codes' own error caps the recall: probing more does not help
    best = max(tried, key=lambda t: (t[1]["@10"] >= min_recall, t[1]["@10"], -t[0]))
    v, rec, lat = best
    if tried[-1][0] != v:
        set_knob(shards, knob, v)
    met = rec["@10"] >= min_recall and lat["p50"] <= max_query_ms
    note = "" if met else _why(rec, lat, min_recall, max_query_ms)
    return {"search": {knob: v}, "recall": rec, "latency_ms": lat, "target_met": met, "note": note}


def _why(rec: dict, lat: dict, min_recall: float, max_query_ms: float) -> str:
    if lat["p50"] > max_query_ms:
        return f"a query takes {lat['p50']:.2f} ms (p50), over --max-query-ms {max_query_ms:g}"
    return f"recall@10 {rec['@10']:.3f} is below --min-recall {min_recall:g} at the best setting within --max-query-ms"
