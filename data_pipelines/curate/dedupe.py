"""De-duplication: exact (equal digests) and semantic (SemDeDup, Abbas et al. 2023).

SemDeDup ("SemDeDup: Data-efficient learning at web-scale through semantic deduplication",
Abbas et al. 2023) clusters the image embeddings with k-means, then calls two images of one
cluster duplicates when their cosine exceeds 1 - eps, and keeps one of each group. Clustering
is what makes it affordable: pairs are compared only inside a cluster, so the cost is the sum
of the squared cluster sizes, not N^2. The price: a duplicate pair split across two clusters
is missed (rare, since near-duplicates are near each other and so near one centroid).

Groups do not chain (SemDeDup's rule): within a cluster the samples are visited best CLIP score
first, and a sample is kept unless it is within eps of a sample already kept, whose group it
joins. So every member of a group is within eps of the group's kept member, and a chain a~b~c
with a and c further apart than eps keeps a and c (when b is visited after them). Transitive
groups (connected components) are what wiped out a pool: with a small model, chains of
pairs above the threshold joined thousands of visibly different images into one group.
A group's id is the pool index of its kept member.
"""

from collections.abc import Sequence

import numpy as np

from data_pipelines.curate.scores import _unit_rows
from mmalign.extras import extra


def exact_groups(digests: Sequence[bytes | str]) -> np.ndarray:
    """(N,) int64 group id per sample: the index of the first sample with the same digest.

    Digests are compared as given: a str and bytes spelling of one hash are different keys,
    so give one kind (e.g. all ``sha256().digest()``)."""
    first: dict = {}
    return np.fromiter(
        (first.setdefault(d, i) for i, d in enumerate(digests)), dtype=np.int64, count=len(digests)
    )


def cluster_labels(
    emb: np.ndarray,
    n_clusters: int,
    seed: int = 0,
    train_size: int | None = None,
    *,
    niter: int = 20,
    nredo: int = 1,
    block_size: int = 65536,
) -> np.ndarray:
    """(N, D) -> (N,) int64 k-means cluster of each (re-normalised) row; ``n_clusters=1``: all 0.

    Spherical k-means (FAISS, centroids kept unit norm, so the nearest centroid is the one of
    highest cosine) trained on at most ``train_size`` rows drawn with ``seed``: training memory
    is that sample, not the pool. Rows are then assigned ``block_size`` at a time, so only one
    block is ever held as normalised float32 besides the input. ``nredo`` > 1 trains that many
    times from different starts and keeps the lowest objective (a guard against bad starts)."""
    emb = np.asarray(emb)
    n, d = emb.shape
    if n_clusters < 1:
        raise ValueError(f"n_clusters must be >= 1, got {n_clusters}")
    if n_clusters == 1:
        return np.zeros(n, dtype=np.int64)
    rows = np.arange(n)
    if train_size is not None and train_size < n:
        rows = np.sort(np.random.default_rng(seed).choice(n, size=train_size, replace=False))
    if rows.size < n_clusters:
        raise ValueError(f"k-means needs at least n_clusters={n_clusters} training rows, got {rows.size}")
    train = np.ascontiguousarray(_unit_rows(emb[rows]), dtype=np.float32)  # (T, D): FAISS wants float32
    with extra("search", "curate's k-means"):  # heavy and optional: only where k-means runs
        import faiss

    km = faiss.Kmeans(d, n_clusters, niter=niter, nredo=nredo, seed=seed, spherical=True)
    km.train(train)
    del train
    labels = np.empty(n, dtype=np.int64)  # (N,)
    for s in range(0, n, block_size):
        chunk = np.ascontiguousarray(_unit_rows(emb[s : s + block_size]), dtype=np.float32)  # (b, D)
        _, nearest = km.index.search(chunk, 1)  # (b, 1): L2 on unit vectors ranks as cosine does
        labels[s : s + block_size] = nearest[:, 0]
    return labels


def _greedy_in(x: np.ndarray, order: np.ndarray, eps: float, block_size: int) -> np.ndarray:
    """(m, D) unit rows, (m,) visiting order -> (m,) local index of the kept row each row belongs to.

    SemDeDup's rule: rows are visited in ``order`` (best first); a row is kept unless its cosine
    with a row *already kept* exceeds 1 - eps, and then it joins the first such kept row (the
    best). A removed row never keeps anything, so groups do not chain: every member is within
    eps of its group's kept row. Candidates are compared against the kept set in
    (block_size, block_size) tiles, so memory is a tile, not (m, m)."""
    m = x.shape[0]
    owner = np.full(m, -1, dtype=np.int64)  # (m,)
    kept = np.zeros(0, dtype=np.int64)  # local rows kept so far, in visiting order
    for s in range(0, m, block_size):
        cand = order[s : s + block_size]  # (b,) the next candidates, best first
        xc = x[cand]  # (b, D)
        match = np.full(
            cand.size, -1, dtype=np.int64
        )  # (b,) place in ``kept`` of the first kept row within eps
        for t in range(0, kept.size, block_size):
            dup = xc @ x[kept[t : t + block_size]].T > 1.0 - eps  # (b, b')
            new = dup.any(axis=1) & (match < 0)
            match[new] = t + dup[new].argmax(axis=1)  # argmax: the first True, so the best kept row
        inner = xc @ xc.T > 1.0 - eps  # (b, b): the candidates among themselves
        kept_here = np.zeros(cand.size, dtype=bool)  # (b,)
        for i in range(cand.size):  # in visiting order: an earlier candidate kept here counts for later ones
            if match[i] >= 0:
                owner[cand[i]] = kept[match[i]]
                continue
            hit = np.flatnonzero(inner[i, :i] & kept_here[:i])
            if hit.size:
                owner[cand[i]] = cand[hit[0]]
            else:
                kept_here[i] = True
                owner[cand[i]] = cand[i]
        kept = np.concatenate([kept, cand[kept_here]])
    return owner


def _visit_order(idx: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
    """(m,) ascending pool indices -> (m,) positions in ``idx``: best score first, ties by pool
    index; a NaN score comes last. No scores: pool order."""
    if scores is None:
        return np.arange(idx.size)
    s = np.asarray(scores, dtype=np.float64)[idx]
    key = np.where(np.isnan(s), np.inf, -s)  # lexsort's last key is the primary one
    return np.lexsort((idx, key))


def semantic_groups(
    emb: np.ndarray,
    eps: float,
    n_clusters: int,
    seed: int = 0,
    train_size: int | None = None,
    *,
    scores: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    niter: int = 20,
    nredo: int = 1,
    block_size: int = 1024,
) -> np.ndarray:
    """SemDeDup groups: (N, D) image embeddings -> (N,) int64 group id = the pool index of the
    group's kept member.

    Rows are re-normalised; k-means as in :func:`cluster_labels` (``n_clusters=1``: no
    clustering; ``labels``: clusters given). Inside each cluster the samples are visited by
    ``scores`` (best first, ties by index; none: by index) and each is kept unless it is within
    eps (cosine > 1 - eps) of a sample already kept, whose group it then joins
    (:func:`_greedy_in`). Cosines are float64, so which side of 1 - eps a pair falls is not
    float32 rounding noise."""
    if not 0.0 <= eps <= 2.0:
        raise ValueError(f"eps must be in [0, 2] (duplicates: cosine > 1 - eps), got {eps!r}")
    emb = np.asarray(emb)
    if emb.ndim != 2:
        raise ValueError(f"emb must be (N, D), got {emb.shape}")
    if labels is None:
        labels = cluster_labels(emb, n_clusters, seed, train_size, niter=niter, nredo=nredo)  # (N,)
    groups = np.arange(emb.shape[0], dtype=np.int64)  # (N,)
    for idx in _clusters(labels):  # idx: (m,) one cluster's sample indices, ascending
        if idx.size > 1:
            x = _unit_rows(emb[idx])  # (m, D) float64: one cluster at a time, not the pool
            groups[idx] = idx[_greedy_in(x, _visit_order(idx, scores), eps, block_size)]
    return groups


def _clusters(labels: np.ndarray) -> list[np.ndarray]:
    """(N,) cluster labels -> each cluster's sample indices, ascending."""
    labels = np.asarray(labels)
    order = np.argsort(labels, kind="stable")  # (N,) stable: each cluster's members stay ascending
    return np.split(order, np.flatnonzero(np.diff(labels[order])) + 1) if labels.size else []


def nearest_similarity(
    emb: np.ndarray, labels: np.ndarray, rows: np.ndarray | None = None, block_size: int = 1024
) -> np.ndarray:
    """(N, D), (N,) clusters -> (N,) float64 each sample's highest cosine with another sample of
    its cluster (NaN when alone): the distribution an eps is read from. ``rows``: only these
    samples' (the others NaN), so a histogram of a large pool costs a sample's comparisons,
    not every pair's. Tiled like the groups."""
    emb = np.asarray(emb)
    best = np.full(emb.shape[0], np.nan)  # (N,)
    wanted = None if rows is None else np.zeros(emb.shape[0], dtype=bool)
    if wanted is not None:
        wanted[np.asarray(rows, dtype=np.int64)] = True
    for idx in _clusters(labels):
        q = (
            np.arange(idx.size) if wanted is None else np.flatnonzero(wanted[idx])
        )  # (q,) places in the cluster
        if idx.size < 2 or q.size == 0:
            continue
        x = _unit_rows(emb[idx])  # (m, D)
        near = np.full(q.size, -np.inf)  # (q,)
        for s in range(0, q.size, block_size):
            qs = q[s : s + block_size]
            for t in range(0, idx.size, block_size):
                cos = x[qs] @ x[t : t + block_size].T  # (b, b')
                cos[
                    qs[:, None] == np.arange(t, min(t + block_size, idx.size))[None, :]
                ] = -np.inf  # not itself
                near[s : s + block_size] = np.maximum(near[s : s + block_size], cos.max(axis=1))
        best[idx[q]] = np.minimum(near, 1.0)  # rounding can put a copy a few ulps past 1
    return best


def keep_one_per_group(groups: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(N,) groups, (N,) scores -> (N,) bool: each group's highest-scoring member kept.

    Ties go to the lowest index (deterministic, whatever the input order of equal scores); a
    NaN score loses to any number. Singletons are their own group's best, so they are kept."""
    groups = np.asarray(groups)
    scores = np.asarray(scores, dtype=np.float64)
    if groups.shape != scores.shape or groups.ndim != 1:
        raise ValueError(
            f"groups and scores must be (N,) of one length, got {groups.shape} and {scores.shape}"
        )
    index = np.arange(groups.size)
    # lexsort's last key is the primary one: by group, then best score first, then index.
    order = np.lexsort((index, -scores, groups))  # (N,)
    g = groups[order]
    first = np.ones(g.size, dtype=bool)
    first[1:] = g[1:] != g[:-1]  # the first row of each group's run is its best member
    keep = np.zeros(groups.size, dtype=bool)
    keep[order[first]] = True
    return keep


def group_report(groups: np.ndarray) -> dict:
    """Counts of a grouping: samples, groups of more than one member, and samples in them.

    ``samples_in_duplicate_groups - duplicate_groups`` is what :func:`keep_one_per_group` drops."""
    _, counts = np.unique(np.asarray(groups), return_counts=True)
    multi = counts > 1
    return {
        "samples": int(counts.sum()),
        "duplicate_groups": int(multi.sum()),
        "samples_in_duplicate_groups": int(counts[multi].sum()),
    }
