"""Perceptual de-duplication, and its union with semantic de-duplication, as groups on a sparse graph.

A pair of samples is an edge when it is near: within ``radius`` bits of perceptual hash
(:func:`perceptual_pairs`: ``mmalign.data.hamming.near_pairs`` over the pool's pHashes, the
pair distance of ``mmalign.data.phash.distance``) or, for the semantic detector, of cosine
above 1 - eps inside one k-means cluster (:func:`semantic_pairs`). Only the edges are held,
never a (N, N) matrix, so a 1M-sample pool costs its near pairs.

The groups do not chain, as SemDeDup's (``dedupe._greedy_in``): the samples are visited best
score first (ties by pool index; no scores: pool order) and each is kept unless a sample
*already kept* is its neighbour, and then it joins the first such kept sample in visiting order
(:func:`greedy_groups`). Every member of a group is therefore within the threshold of the
group's kept member, and a chain a~b~c with a !~ c keeps a and c. A group's id is the pool
index of its kept member. The union of the two detectors (:func:`combined_groups`) is the same
rule over both edge sets: a sample joins a kept sample that is near by either.

Recipe for ``--dedupe perceptual,semantic`` (decide.py): ``p = perceptual_pairs(q, i, r,
rows)``, ``s = semantic_pairs(emb, eps, labels, rows)``; ``groups["perceptual"] =
greedy_groups(N, *p[:2], order)``, ``groups["combined"] = combined_groups(N, [p[:2], s],
order)`` with ``order = visit_order(N, scores, rows)``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from data_pipelines.curate.dedupe import _clusters, _visit_order
from data_pipelines.curate.scores import _unit_rows
from mmalign.data import phash
from mmalign.data.hamming import near_pairs

_SEQUENTIAL_AFTER = 64  # rounds of the vectorised sweep before the last, deep chains are walked one by one


def visit_order(n: int, scores: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
    """(k,) the samples that take part (``rows``; None: all n), best score first, ties by pool
    index, a NaN score last; no scores: pool order."""
    idx = np.arange(n) if rows is None else np.unique(np.asarray(rows, dtype=np.int64))
    return idx[_visit_order(idx, scores)]


def greedy_groups(n: int, a: np.ndarray, b: np.ndarray, order: np.ndarray) -> np.ndarray:
    """(n,) int64 group ids of the non-chaining rule on the sparse graph of edges (a[i], b[i]).

    Samples are visited in ``order``; a sample is kept unless a sample already kept is its
    neighbour, and then it joins the first such kept one in visiting order. Samples not in
    ``order`` take no part (each its own group; their edges are ignored). Group id = the pool
    index of the kept member.

    Vectorised in rounds: a sample is decided once its earliest earlier neighbour that is not
    removed is kept (it joins it) or it has none left (kept); removed samples' edges are
    dropped. Rounds are as many as the longest such dependency chain; after
    ``_SEQUENTIAL_AFTER`` rounds the rest is walked in visiting order."""
    order = np.asarray(order, dtype=np.int64)
    rank = np.full(n, -1, dtype=np.int64)  # (n,) place in the visiting order; -1: not taking part
    rank[order] = np.arange(order.size)
    groups = np.arange(n, dtype=np.int64)
    a, b = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    take = (rank[a] >= 0) & (rank[b] >= 0) & (a != b)
    a, b = a[take], b[take]
    early = np.where(rank[a] < rank[b], a, b)  # each edge from its earlier to its later end
    late = np.where(rank[a] < rank[b], b, a)
    by = np.lexsort((rank[early], rank[late]))  # by the later end, then its neighbours in order
    u, v = early[by], late[by]  # (E,)
    state = np.zeros(n, dtype=np.int8)  # 0 undecided, 1 kept, 2 removed
    rounds = 0
    while u.size and rounds < _SEQUENTIAL_AFTER:
        rounds += 1
        first = np.ones(v.size, dtype=bool)
        first[1:] = v[1:] != v[:-1]  # each undecided sample's earliest earlier neighbour left
        fu, fv = u[first], v[first]
        joins = state[fu] == 1
        state[fv[joins]] = 2
        groups[fv[joins]] = fu[joins]
        # kept: the undecided samples no remaining edge reaches (their earlier ones all removed)
        live = np.zeros(n, dtype=bool)
        live[v] = True
        state[(state == 0) & ~live & (rank >= 0)] = 1
        keep = (state[u] != 2) & (state[v] == 0)
        u, v = u[keep], v[keep]
    live = np.zeros(n, dtype=bool)
    live[v] = True
    state[(state == 0) & (rank >= 0) & ~live] = 1
    if u.size:  # deep chains: one by one in visiting order; every earlier sample is decided by then
        starts = np.flatnonzero(np.r_[True, v[1:] != v[:-1]])
        ends = np.r_[starts[1:], v.size]
        for s in np.argsort(rank[v[starts]], kind="stable"):
            w = int(v[starts[s]])
            for x in u[starts[s] : ends[s]].tolist():
                if state[x] == 1:
                    state[w], groups[w] = 2, x
                    break
            else:
                state[w] = 1
    return groups


def perceptual_pairs(
    query: np.ndarray, index: np.ndarray, radius: int, rows: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pool pHashes (N, QUERIES, W), (N, VIEWS, W) -> (a, b, d): every pair of pool indices a < b
    within ``radius`` bits (``phash.distance``), d its distance; ``rows``: only among these."""
    radius = phash.check_distance(radius)
    if rows is None:
        return near_pairs(query, index, radius, same=True)
    rows = np.unique(np.asarray(rows, dtype=np.int64))
    a, b, d = near_pairs(query[rows], index[rows], radius, same=True)
    return rows[a], rows[b], d


def perceptual_groups(
    query: np.ndarray,
    index: np.ndarray,
    radius: int,
    *,
    scores: np.ndarray | None = None,
    rows: np.ndarray | None = None,
) -> np.ndarray:
    """(N,) int64 groups of perceptual near-duplicates: the non-chaining rule over the pairs
    within ``radius`` bits, visited by ``scores`` (best first; None: pool order). ``rows``: only
    these samples take part (e.g. one kept copy per exact group); the others stay alone."""
    a, b, _ = perceptual_pairs(query, index, radius, rows)
    return greedy_groups(len(query), a, b, visit_order(len(query), scores, rows))


def semantic_pairs(
    emb: np.ndarray, eps: float, labels: np.ndarray, rows: np.ndarray | None = None, block_size: int = 1024
) -> tuple[np.ndarray, np.ndarray]:
    """(N, D) embeddings -> (a, b) pool indices a < b of one cluster with cosine > 1 - eps.

    Row-normalised float64 as ``dedupe.semantic_groups``, compared in (block_size, block_size)
    tiles inside each cluster of ``labels``; ``rows``: only these samples take part."""
    if not 0.0 <= eps <= 2.0:
        raise ValueError(f"eps must be in [0, 2] (duplicates: cosine > 1 - eps), got {eps!r}")
    emb, labels = np.asarray(emb), np.asarray(labels)
    if rows is not None:
        take = np.zeros(len(emb), dtype=bool)
        take[np.asarray(rows, dtype=np.int64)] = True
        labels = np.where(take, labels, -1)  # -1: a cluster of its own, skipped below
    out_a, out_b = [], []
    for idx in _clusters(labels):  # (m,) one cluster's pool indices, ascending
        if idx.size < 2 or (rows is not None and labels[idx[0]] == -1):
            continue
        x = _unit_rows(emb[idx])  # (m, D) float64
        for s in range(0, idx.size, block_size):
            for t in range(s, idx.size, block_size):
                near = x[s : s + block_size] @ x[t : t + block_size].T > 1.0 - eps  # (b, b')
                i, j = np.nonzero(near)
                i, j = i + s, j + t
                up = i < j
                out_a.append(idx[i[up]])
                out_b.append(idx[j[up]])
    if not out_a:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    a, b = np.concatenate(out_a), np.concatenate(out_b)
    order = np.lexsort((b, a))
    return a[order], b[order]


def combined_groups(n: int, pairs: Sequence[tuple[np.ndarray, np.ndarray]], order: np.ndarray) -> np.ndarray:
    """(n,) groups of the union of detectors: the non-chaining rule over every edge set in
    ``pairs`` together (a sample joins the first kept sample near it by any of them)."""
    a = np.concatenate([np.asarray(p[0], dtype=np.int64) for p in pairs]) if pairs else np.zeros(0, np.int64)
    b = np.concatenate([np.asarray(p[1], dtype=np.int64) for p in pairs]) if pairs else np.zeros(0, np.int64)
    return greedy_groups(n, a, b, order)
