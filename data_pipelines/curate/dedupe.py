"""De-duplication: exact (equal digests) and semantic (SemDeDup, Abbas et al. 2023).

SemDeDup ("SemDeDup: Data-efficient learning at web-scale through semantic deduplication",
Abbas et al. 2023) clusters the image embeddings with k-means, then calls two images of one
cluster duplicates when their cosine exceeds 1 - eps, and keeps one of each group. Clustering
is what makes it affordable: pairs are compared only inside a cluster, so the cost is the sum
of the squared cluster sizes, not N^2. The price: a duplicate pair split across two clusters
is missed (rare, since near-duplicates are near each other and so near one centroid).

A group is a connected component of the "duplicate of" relation (so a chain a~b~c is one group
even when a and c are further apart than eps); its id is its smallest sample index.
"""

from collections.abc import Sequence

import numpy as np

from data_pipelines.curate.scores import _unit_rows


def exact_groups(digests: Sequence[bytes | str]) -> np.ndarray:
    """(N,) int64 group id per sample: the index of the first sample with the same digest.

    Digests are compared as given: a str and bytes spelling of one hash are different keys,
    so give one kind (e.g. all ``sha256().digest()``)."""
    first: dict = {}
    return np.fromiter((first.setdefault(d, i) for i, d in enumerate(digests)), dtype=np.int64, count=len(digests))


def cluster_labels(emb: np.ndarray, n_clusters: int, seed: int = 0, train_size: int | None = None, *,
                   niter: int = 20, nredo: int = 1, block_size: int = 65536) -> np.ndarray:
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
    import faiss  # heavy and optional: only where k-means runs

    km = faiss.Kmeans(d, n_clusters, niter=niter, nredo=nredo, seed=seed, spherical=True)
    km.train(train)
    del train
    labels = np.empty(n, dtype=np.int64)  # (N,)
    for s in range(0, n, block_size):
        chunk = np.ascontiguousarray(_unit_rows(emb[s:s + block_size]), dtype=np.float32)  # (b, D)
        _, nearest = km.index.search(chunk, 1)  # (b, 1): L2 on unit vectors ranks as cosine does
        labels[s:s + block_size] = nearest[:, 0]
    return labels


def _join(lab: np.ndarray, a: np.ndarray, b: np.ndarray) -> None:
    """Union the pairs (a[i], b[i]) into ``lab`` in place: a vectorised union-find.

    ``lab[x]`` points to a smaller-or-equal node of x's group; on entry and exit every
    pointer has been followed to its end, so ``lab[x]`` is the group's root = smallest node.
    Each round points the larger root of every still-split pair at the smaller (roots only,
    so earlier unions stay joined), then jumps pointers until they reach roots again."""
    while True:
        ra, rb = lab[a], lab[b]
        split = ra != rb
        if not split.any():
            return
        ra, rb = ra[split], rb[split]
        low = np.minimum(ra, rb)
        np.minimum.at(lab, ra, low)
        np.minimum.at(lab, rb, low)
        while True:
            nxt = lab[lab]
            if np.array_equal(nxt, lab):
                break
            lab[:] = nxt


def _groups_in(x: np.ndarray, eps: float, block_size: int) -> np.ndarray:
    """(m, D) unit rows -> (m,) local group root: pairs with cosine > 1 - eps joined.

    Cosines are taken in (block_size, block_size) tiles of the upper triangle, so memory is a
    tile, not (m, m); each tile's duplicate pairs are joined before the next tile."""
    m = x.shape[0]
    lab = np.arange(m, dtype=np.int64)  # (m,)
    for s in range(0, m, block_size):
        rows = x[s:s + block_size]  # (b, D)
        for t in range(s, m, block_size):
            cos = rows @ x[t:t + block_size].T  # (b, b')
            dup = cos > 1.0 - eps  # (b, b')
            if t == s:
                dup = np.triu(dup, k=1)  # each pair once, and no sample with itself
            i, j = np.nonzero(dup)
            if i.size:
                _join(lab, i + s, j + t)
    return lab


def semantic_groups(emb: np.ndarray, eps: float, n_clusters: int, seed: int = 0, train_size: int | None = None,
                    *, niter: int = 20, nredo: int = 1, block_size: int = 1024) -> np.ndarray:
    """SemDeDup groups: (N, D) image embeddings -> (N,) int64 group id (its smallest index).

    Rows are re-normalised; k-means as in :func:`cluster_labels` (``n_clusters=1``: no
    clustering, every pair compared); inside each cluster every pair with cosine > 1 - eps is
    joined, by brute force in tiles (cluster sizes are bounded by the choice of n_clusters).
    Cosines are float64, so which side of 1 - eps a pair falls is not float32 rounding noise."""
    if not 0.0 <= eps <= 2.0:
        raise ValueError(f"eps must be in [0, 2] (duplicates: cosine > 1 - eps), got {eps!r}")
    emb = np.asarray(emb)
    if emb.ndim != 2:
        raise ValueError(f"emb must be (N, D), got {emb.shape}")
    labels = cluster_labels(emb, n_clusters, seed, train_size, niter=niter, nredo=nredo)  # (N,)
    groups = np.arange(emb.shape[0], dtype=np.int64)  # (N,)
    # A stable sort keeps each cluster's members in ascending index, so the smallest local
    # root maps to the smallest global index.
    order = np.argsort(labels, kind="stable")  # (N,)
    bounds = np.flatnonzero(np.diff(labels[order])) + 1
    for idx in np.split(order, bounds):  # idx: (m,) one cluster's sample indices, ascending
        if idx.size > 1:
            x = _unit_rows(emb[idx])  # (m, D) float64: one cluster at a time, not the pool
            groups[idx] = idx[_groups_in(x, eps, block_size)]
    return groups


def keep_one_per_group(groups: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(N,) groups, (N,) scores -> (N,) bool: each group's highest-scoring member kept.

    Ties go to the lowest index (deterministic, whatever the input order of equal scores); a
    NaN score loses to any number. Singletons are their own group's best, so they are kept."""
    groups = np.asarray(groups)
    scores = np.asarray(scores, dtype=np.float64)
    if groups.shape != scores.shape or groups.ndim != 1:
        raise ValueError(f"groups and scores must be (N,) of one length, got {groups.shape} and {scores.shape}")
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
    return {"samples": int(counts.sum()), "duplicate_groups": int(multi.sum()),
            "samples_in_duplicate_groups": int(counts[multi].sum())}
