"""The curation kernels (data_pipelines.curate) against by-hand references.

Every reference here is written the slow, obvious way (loops, dicts, SemDeDup's greedy rule over all pairs),
so that an error in the vectorised kernels shows up as a mismatch.
"""

import math

import numpy as np
import pytest

from data_pipelines.curate import (
    PoolQuantile,
    clip_scores,
    cluster_labels,
    exact_groups,
    group_report,
    keep_one_per_group,
    keep_threshold,
    select,
    semantic_groups,
)

# ---- scores ---------------------------------------------------------------------------------


def test_clip_scores_equal_a_per_sample_loop(seed):
    rng = np.random.default_rng(seed)
    n, d = 50, 24
    # Not unit norm, and of varied scale: the kernel must normalise itself.
    img = (rng.standard_normal((n, d)) * rng.uniform(0.1, 10.0, (n, 1))).astype(np.float32)
    txt = (rng.standard_normal((n, d)) * rng.uniform(0.1, 10.0, (n, 1))).astype(np.float32)
    txt[:5] = img[:5] * 3.0  # parallel pairs: a cosine of exactly 1
    got = clip_scores(img, txt)
    assert got.shape == (n,) and got.dtype == np.float32
    for i in range(n):
        a = [float(v) for v in img[i]]
        b = [float(v) for v in txt[i]]
        dot = sum(x * y for x, y in zip(a, b))
        want = dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)))
        assert abs(float(got[i]) - want) <= 1e-6, (i, float(got[i]), want)


def test_clip_scores_zero_vectors_score_zero():
    img = np.array([[0.0, 0.0, 0.0], [1.0, 2.0, 3.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    txt = np.array([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=np.float32)
    got = clip_scores(img, txt)
    assert not np.isnan(got).any()
    assert got.tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("shapes", [((4, 8), (4, 9)), ((4, 8), (5, 8)), ((8,), (8,))])
def test_clip_scores_shape_mismatch_is_one_line(shapes):
    a, b = (np.zeros(s, dtype=np.float32) for s in shapes)
    with pytest.raises(ValueError) as err:
        clip_scores(a, b)
    msg = str(err.value)
    assert "\n" not in msg and str(shapes[0]) in msg and str(shapes[1]) in msg


# ---- threshold ------------------------------------------------------------------------------

FRACTIONS = [1.0, 0.9, 0.5, 0.3, 0.01, 1e-6]


@pytest.mark.parametrize("n", [1, 2, 7, 100, 1001])
def test_keep_threshold_is_numpy_quantile(seed, n):
    rng = np.random.default_rng(seed)
    scores = rng.uniform(-0.2, 0.5, n).astype(np.float32)
    for f in FRACTIONS:
        t = keep_threshold(scores, f)
        assert t == np.quantile(scores, 1 - f), (n, f)
        # The contract in words: the top fraction (at least one sample) is kept.
        assert (scores >= t).sum() >= max(1, math.floor(f * n) - 1)
    assert keep_threshold(scores, 1.0) == scores.min()  # keep all


def test_pool_quantile_over_random_splits_equals_the_whole(seed):
    rng = np.random.default_rng(seed)
    scores = rng.normal(0.25, 0.05, 997).astype(np.float32)
    for _ in range(5):
        cuts = np.sort(rng.choice(np.arange(1, scores.size), size=rng.integers(1, 12), replace=False))
        pool = PoolQuantile()
        for part in np.split(scores, cuts):
            pool.add(part)
        assert len(pool) == scores.size
        for f in FRACTIONS:
            assert pool.threshold(f) == keep_threshold(scores, f), (cuts.tolist(), f)
    with pytest.raises(ValueError, match="empty"):
        PoolQuantile().threshold(0.3)


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan")])
def test_bad_keep_fraction_names_the_flag(bad):
    scores = np.linspace(0, 1, 10, dtype=np.float32)
    for call in (lambda: keep_threshold(scores, bad), lambda: select(scores, keep_fraction=bad)):
        with pytest.raises(ValueError, match=r"--keep-fraction.*\(0, 1\]"):
            call()


def test_empty_pool_raises():
    with pytest.raises(ValueError, match="empty"):
        keep_threshold(np.zeros(0, dtype=np.float32), 0.5)


def test_select_combinations_against_a_hand_mask(seed):
    rng = np.random.default_rng(seed)
    # Few distinct values: ties at the floor and at the threshold, so ">=" is tested, not ">".
    # 201 scores and q = 0.75: the quantile's index 150 is exact, so t is one of the scores.
    scores = (rng.integers(0, 20, 201) / 40).astype(np.float32)
    floor, f = float(np.sort(scores)[60]), 0.25
    t = float(np.quantile(scores, 1 - f))
    assert (scores == floor).any() and (scores == t).any()
    by_floor = [bool(s >= floor) for s in scores]
    by_fraction = [bool(s >= t) for s in scores]
    assert select(scores).tolist() == [True] * scores.size
    assert select(scores, clip_score_min=floor).tolist() == by_floor
    assert select(scores, keep_fraction=f).tolist() == by_fraction
    assert select(scores, threshold=t).tolist() == by_fraction
    both = [a and b for a, b in zip(by_floor, by_fraction)]
    assert select(scores, clip_score_min=floor, keep_fraction=f).tolist() == both
    assert select(scores, clip_score_min=floor, threshold=t).tolist() == both
    with pytest.raises(ValueError, match="not both"):
        select(scores, keep_fraction=f, threshold=t)


# ---- exact groups ---------------------------------------------------------------------------


def test_exact_groups_against_a_dict(seed):
    rng = np.random.default_rng(seed)
    for kind in (bytes, str):
        pool = [bytes([v]) * 4 if kind is bytes else f"h{v}" for v in rng.integers(0, 40, 150)]
        seen, want = {}, []
        for i, digest in enumerate(pool):
            if digest not in seen:
                seen[digest] = i
            want.append(seen[digest])
        got = exact_groups(pool)
        assert got.dtype == np.int64 and got.tolist() == want
    assert exact_groups([]).tolist() == []
    assert exact_groups([b"a", b"b", b"a"]).tolist() == [0, 1, 0]


# ---- semantic groups ------------------------------------------------------------------------

EPS = 0.01  # duplicates: cosine > 0.99


def brute_groups(emb, eps, scores=None, labels=None):
    """SemDeDup's greedy rule by hand, over all pairs of each cluster: visit the samples best
    score first (ties: lower index; no scores: by index), keep one unless its cosine with an
    already kept sample of its cluster exceeds 1 - eps, else join the first such kept sample.
    Returns each sample's group: the index of its kept sample."""
    x = emb.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    n = len(x)
    scores = [0.0] * n if scores is None else [float(v) for v in scores]
    labels = [0] * n if labels is None else [int(v) for v in labels]
    order = sorted(range(n), key=lambda i: (-scores[i], i))
    kept_in = {}  # cluster -> kept indices, in visiting order
    group = [None] * n
    for i in order:
        kept = kept_in.setdefault(labels[i], [])
        near = [k for k in kept if float(x[i] @ x[k]) > 1 - eps]
        if near:
            group[i] = near[0]
        else:
            kept.append(i)
            group[i] = i
    return group


def with_duplicates(rng, base, n_dup, noise):
    """``base`` (n, D) unit rows plus ``n_dup`` noisy copies of random rows (copies of copies
    too, so that chains occur), shuffled."""
    rows = list(base)
    for _ in range(n_dup):
        src = rows[rng.integers(len(rows))]
        v = src + noise * rng.standard_normal(src.shape)
        rows.append(v / np.linalg.norm(v))
    emb = np.array(rows)[rng.permutation(len(rows))]
    return emb.astype(np.float32)


def assert_clear_of_threshold(emb, eps, margin=1e-3):
    """The data has no pair within ``margin`` of the threshold, so float rounding in either
    implementation cannot decide a pair (a failure here is bad test data, not a bad kernel)."""
    x = emb.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cos = x @ x.T
    assert not (np.abs(cos - (1 - eps)) < margin).any()


def test_semantic_groups_no_clustering_equal_all_pairs(seed):
    rng = np.random.default_rng(seed)
    n, d = 300, 16
    base = rng.standard_normal((220, d))
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    emb = with_duplicates(rng, base, n - 220, noise=0.01)  # copies: cosine ~ 0.999
    assert_clear_of_threshold(emb, EPS)
    scores = rng.integers(0, 8, n) / 8  # few values: ties
    want = brute_groups(emb, EPS, scores)
    report = group_report(np.array(want))
    assert report["duplicate_groups"] >= 20  # the planted duplicates are there to be found
    got = semantic_groups(emb, EPS, n_clusters=1, scores=scores)
    assert got.dtype == np.int64 and got.tolist() == want
    # Blocks: a tiny tile (many tiles, pairs across tiles) gives the same groups.
    for block in (1, 7, 64):
        assert semantic_groups(emb, EPS, n_clusters=1, scores=scores, block_size=block).tolist() == want
    assert semantic_groups(emb, EPS, n_clusters=1).tolist() == brute_groups(emb, EPS)  # no scores: pool order
    assert report == {
        "samples": n,
        "duplicate_groups": len({g for g in want if want.count(g) > 1}),
        "samples_in_duplicate_groups": sum(1 for g in want if want.count(g) > 1),
    }


def test_semantic_groups_in_clusters_equal_all_pairs_on_blobs(seed):
    rng = np.random.default_rng(seed)
    d, per = 32, 60
    blob = np.repeat(np.arange(4), per)
    base = np.eye(d)[blob] + 0.05 * rng.standard_normal((4 * per, d))  # 4 orthogonal blobs
    base /= np.linalg.norm(base, axis=1, keepdims=True)
    emb = with_duplicates(rng, base, 80, noise=0.003)  # copies: cosine ~ 0.9999, in their blob
    assert_clear_of_threshold(emb, EPS)
    scores = rng.uniform(0, 1, len(emb))
    labels = cluster_labels(emb, 4, seed=seed, nredo=8)
    want = brute_groups(emb, EPS, scores, labels)  # greedy inside each cluster
    assert group_report(np.array(want))["duplicate_groups"] >= 20
    got = semantic_groups(emb, EPS, n_clusters=4, seed=seed, nredo=8, scores=scores)
    assert got.tolist() == want
    assert (
        semantic_groups(emb, EPS, n_clusters=4, seed=seed, nredo=8, scores=scores, block_size=5).tolist()
        == want
    )
    # Why clustering changes nothing here: every duplicate pair lies in one blob, the blobs are
    # orthogonal, and k-means finds the blobs (nredo: restarts guard a bad start), so no
    # duplicate pair straddles two clusters; then the clusters' groups are those of all pairs.
    assert len(set(labels.tolist())) == 4
    x = emb.astype(np.float64) / np.linalg.norm(emb.astype(np.float64), axis=1, keepdims=True)
    i, j = np.nonzero(np.triu(x @ x.T > 1 - EPS, k=1))
    assert (labels[i] == labels[j]).all(), "a duplicate pair straddles clusters: the test's premise failed"
    assert got.tolist() == brute_groups(emb, EPS, scores)
    # A training sample (bounded memory) finds the same blobs, so the same groups.
    got = semantic_groups(emb, EPS, n_clusters=4, seed=seed, nredo=8, train_size=120, scores=scores)
    assert got.tolist() == want


def arc(n, theta=0.1):
    """n points on an arc, theta apart: neighbours are duplicates at EPS_ARC, next-but-one not."""
    return np.array([[math.cos(k * theta), math.sin(k * theta)] for k in range(n)], dtype=np.float32)


EPS_ARC = 1 - math.cos(0.1) + 1e-4  # just above one step's angle, below two steps'


def test_semantic_groups_chain_does_not_chain():
    """a~b and b~c, a and c further apart than eps (a, b, c = rows 0, 1, 2)."""
    emb = arc(3)
    assert float(emb[0] @ emb[2]) < 1 - EPS_ARC < float(emb[0] @ emb[1])
    # b visited last (a and c score higher): a and c are both kept, b joins a (the better of the two)
    got = semantic_groups(emb, EPS_ARC, n_clusters=1, scores=np.array([0.5, 0.1, 0.4]))
    assert got.tolist() == [0, 0, 2] == brute_groups(emb, EPS_ARC, [0.5, 0.1, 0.4])
    got = semantic_groups(emb, EPS_ARC, n_clusters=1, scores=np.array([0.4, 0.1, 0.5]))
    assert got.tolist() == [0, 2, 2] == brute_groups(emb, EPS_ARC, [0.4, 0.1, 0.5])
    # b visited first: a and c are within eps of the kept b, so both join it; nothing is kept but b
    got = semantic_groups(emb, EPS_ARC, n_clusters=1, scores=np.array([0.1, 0.9, 0.2]))
    assert got.tolist() == [1, 1, 1] == brute_groups(emb, EPS_ARC, [0.1, 0.9, 0.2])
    # no scores: pool order; a kept, b joins a, c is not within eps of a: kept (a union-find said [0, 0, 0])
    assert semantic_groups(emb, EPS_ARC, n_clusters=1).tolist() == [0, 0, 2]
    assert semantic_groups(emb, EPS_ARC / 10, n_clusters=1).tolist() == [0, 1, 2]
    # equal scores: ties go to the lower index, so this is pool order too
    assert semantic_groups(emb, EPS_ARC, n_clusters=1, scores=np.zeros(3)).tolist() == [0, 0, 2]


@pytest.mark.parametrize("block", [1, 2, 3, 5, 1024])
def test_semantic_groups_long_chain_against_brute_force(seed, block):
    """A chain of 12 along an arc at scattered indices, with random scores: every tiling gives the
    greedy reference's groups, and every member is within eps of its group's kept member."""
    rng = np.random.default_rng(seed)
    for _ in range(5):
        n = 12
        emb = arc(n)[rng.permutation(n)]
        scores = rng.integers(0, 4, n).astype(np.float64)  # ties on purpose
        want = brute_groups(emb, EPS_ARC, scores)
        got = semantic_groups(emb, EPS_ARC, n_clusters=1, scores=scores, block_size=block).tolist()
        assert got == want
        for i, k in enumerate(got):
            assert float(emb[i].astype(np.float64) @ emb[k]) > 1 - EPS_ARC - 1e-6
            assert got[k] == k  # a group's id is a kept member
        assert len(set(got)) >= n // 3  # a union-find would make one group


def test_semantic_groups_with_clusters_keep_clusters_apart():
    """Given labels: a duplicate across two clusters is not compared."""
    emb = arc(3)
    got = semantic_groups(
        emb, EPS_ARC, n_clusters=2, labels=np.array([0, 1, 1]), scores=np.array([0.9, 0.8, 0.7])
    )
    assert got.tolist() == [0, 1, 1] == brute_groups(emb, EPS_ARC, [0.9, 0.8, 0.7], [0, 1, 1])


def test_semantic_groups_nan_scores_come_last():
    emb = arc(2)
    assert semantic_groups(emb, EPS_ARC, n_clusters=1, scores=np.array([np.nan, 0.1])).tolist() == [1, 1]


def test_nearest_similarity_against_a_loop(seed):
    from data_pipelines.curate.dedupe import nearest_similarity

    rng = np.random.default_rng(seed)
    emb = rng.standard_normal((40, 6)).astype(np.float32)
    labels = rng.integers(0, 4, 40)
    labels[7] = 9  # alone in its cluster
    x = emb.astype(np.float64) / np.linalg.norm(emb.astype(np.float64), axis=1, keepdims=True)
    rows = rng.choice(40, 15, replace=False)
    for block in (3, 1024):
        part = nearest_similarity(emb, labels, rows=rows, block_size=block)
        assert np.isnan(np.delete(part, rows)).all()
        got = nearest_similarity(emb, labels, block_size=block)
        np.testing.assert_array_equal(part[rows], got[rows])
        for i in range(40):
            others = [float(x[i] @ x[j]) for j in range(40) if j != i and labels[j] == labels[i]]
            if others:
                assert got[i] == pytest.approx(max(others), abs=1e-12)
            else:
                assert np.isnan(got[i])


# ---- keep one per group ---------------------------------------------------------------------


def test_keep_one_per_group_against_a_loop(seed):
    rng = np.random.default_rng(seed)
    n = 400
    groups = rng.integers(0, 120, n)
    scores = rng.integers(0, 5, n).astype(np.float32) / 4  # few values: many ties
    best = {}
    for i in range(n):
        g = int(groups[i])
        if g not in best or scores[i] > scores[best[g]]:  # strict >: a tie keeps the earlier
            best[g] = i
    want = [best[int(groups[i])] == i for i in range(n)]
    assert keep_one_per_group(groups, scores).tolist() == want
    # Explicit ties, and singletons kept.
    assert keep_one_per_group(np.array([3, 3, 3, 7, 9]), np.array([0.5, 0.9, 0.9, 0.1, 0.0])).tolist() == [
        False,
        True,
        False,
        True,
        True,
    ]
