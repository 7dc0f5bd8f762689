"""The perceptual policy of :mod:`.decide`: its groups (alone, and unioned with semantic's), each
sample's distance to its kept member, and which detector named a dropped duplicate.

The kernels are :mod:`.perceptual` (the pairs within a distance, by the multi-index hashing of
:mod:`mmalign.data.hamming`, and the greedy, non-chaining grouping); here they are applied to
the pool: over exact de-duplication's kept copies, best CLIP score first (pool order without a
model).
"""

from __future__ import annotations

import numpy as np

from data_pipelines.curate.embed_pass import split_hashes
from mmalign.data import phash


def pool_groups(
    pool, p, scores: np.ndarray, reps: np.ndarray, labels: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray | None]:
    """Perceptual groups over ``reps`` (the others alone), and with semantic too the union's: one
    greedy pass over the perceptual pairs and the semantic pairs, best score first."""
    from data_pipelines.curate.perceptual import (
        combined_groups,
        greedy_groups,
        perceptual_groups,
        perceptual_pairs,
        semantic_pairs,
        visit_order,
    )

    if pool.phash is None:
        raise RuntimeError("perceptual de-duplication without the pool's hashes (hash_pass.ensure_hashes)")
    query, index = split_hashes(pool.phash)  # (N, Q, W), (N, V, W)
    n = len(pool)
    if "semantic" not in p.dedupe:
        return perceptual_groups(query, index, p.perceptual_distance, scores=scores, rows=reps), None
    a, b, _ = perceptual_pairs(query, index, p.perceptual_distance, reps)  # (P,) pool indices
    assert labels is not None  # semantic's k-means ran first
    semantic = semantic_pairs(pool.image, p.dedupe_eps, labels, rows=reps)
    order = visit_order(n, scores, reps)  # best score first
    return greedy_groups(n, a, b, order), combined_groups(n, [(a, b), semantic], order)


DISTANCE_BLOCK = 65536  # samples a block: (b, QUERIES, VIEWS, WORDS) uint64 XORs, ~20 MB


def distance_to_kept(hashes: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """(N, Q + V, W) hashes, (N,) each sample's kept member -> (N,) int64 their distance in bits
    (:func:`phash.distance`, a block at a time; 0 for a kept one)."""

    query, index = split_hashes(hashes)
    out = np.zeros(len(kept), np.int64)
    for s in range(0, len(kept), DISTANCE_BLOCK):
        qa, ia = query[s : s + DISTANCE_BLOCK], index[s : s + DISTANCE_BLOCK]  # (b, Q, W), (b, V, W)
        k = kept[s : s + DISTANCE_BLOCK]
        out[s : s + DISTANCE_BLOCK] = phash.distances(qa, ia, query[k], index[k])  # (b,)
    return out


def detector(d, i: int, k: int, sha: list[str]) -> str:
    """Which detector put sample ``i`` in kept sample ``k``'s group: "exact", "perceptual",
    "semantic", or "perceptual and semantic" when both would have."""
    if sha[i] == sha[k]:
        return "exact"
    limits = d.info.get("detectors", {})
    if "perceptual_bits" not in limits:
        return "semantic"
    near = d.distance is not None and d.distance[i] <= limits["perceptual_bits"]
    if "semantic_eps" not in limits:
        return "perceptual"
    close = d.similarity is not None and d.similarity[i] > 1.0 - limits["semantic_eps"]
    return "perceptual and semantic" if near and close else ("perceptual" if near else "semantic")
