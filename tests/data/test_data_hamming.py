"""mmalign.data.hamming: multi-index hashing against every pair compared by hand.

The reference loops over every (query hash, index hash) pair with Python's own bit count, so
an error in the substring tables, the probes, the block cuts or the de-duplication of pairs
found by several tables shows up as a missing or extra pair or a wrong distance.
"""

import numpy as np
import pytest

from mmalign.data import hamming


def _reference(query, index, radius, same):
    """{(a, b): d} by brute force: every pair of rows, every query hash against every index hash
    (Python's own bit count of the XOR), the smallest; both ways round when ``same``."""
    n, m = len(query), len(index)
    d = np.full((n, m), 10**9)
    for q in range(query.shape[1]):
        for v in range(index.shape[1]):
            x = query[:, None, q, :] ^ index[None, :, v, :]  # (n, m, W)
            bits = np.vectorize(lambda y: bin(int(y)).count("1"), otypes=[np.int64])(x).sum(axis=-1)
            d = np.minimum(d, bits)
    if same:
        d = np.minimum(d, d.T)
    return {
        (a, b): int(d[a, b]) for a in range(n) for b in range(m) if d[a, b] <= radius and (not same or a < b)
    }


def _flip(rng, h, k):
    h = h.copy()
    for bit in rng.choice(64 * h.size, size=k, replace=False):
        h[bit // 64] ^= np.uint64(1) << np.uint64(bit % 64)
    return h


def _pool(rng, n, q, v, w):
    """Random hashes with planted near copies: a query hash of one row set near an index hash of
    another (0..12 bits away), so every radius has pairs right at and just past its edge."""
    query = rng.integers(0, 2**64, (n, q, w), dtype=np.uint64, endpoint=False)
    index = rng.integers(0, 2**64, (n, v, w), dtype=np.uint64, endpoint=False)
    for t in range(n // 2):
        src, dst = rng.integers(n), rng.integers(n)
        query[dst, rng.integers(q)] = _flip(rng, index[src, rng.integers(v)], t % 13)
    return query, index


def _check(got, want):
    a, b, d = got
    assert a.dtype == b.dtype == d.dtype == np.int64
    pairs = list(zip(a.tolist(), b.tolist()))
    assert pairs == sorted(want), "pairs (sorted by a, b) differ from brute force"
    assert dict(zip(pairs, d.tolist())) == want


@pytest.mark.parametrize("radius", [0, 1, 3, 4, 8, 12, 40])
@pytest.mark.parametrize("same", [False, True])
def test_near_pairs_equals_brute_force(radius, same):
    rng = np.random.default_rng(radius)
    query, index = _pool(rng, 70, 2, 5, 1)
    if same:  # one pool: the whole view is also the first index hash, as phash stores it
        index[:, 0] = query[:, 0]
        query[5, 1] = query[4, 0]  # a pair at distance 0 both ways
    else:
        index = index[:50]
    want = _reference(query, index, radius, same)
    assert radius == 40 or len(want) < 70 * 50 // 4  # a real filter except at the large radius
    _check(hamming.near_pairs(query, index, radius, same=same), want)
    for parts in (
        (0, 3, 5, 9) if radius < 20 else (0, 64)
    ):  # every substring count is exact, not only the one chosen
        _check(hamming.near_pairs(query, index, radius, same=same, parts=parts), want)


def test_two_word_hashes_and_blocks(monkeypatch):
    """128-bit hashes (substrings across a word boundary) and blocks far smaller than the work, so
    candidate ranges cut buckets in the middle."""
    monkeypatch.setattr(hamming, "BLOCK", 37)
    rng = np.random.default_rng(1)
    query, index = _pool(rng, 40, 3, 4, 2)
    index[:, 2] = query[:, 1]
    index[7, 0] = index[3, 1]  # one pool: identical index hashes
    for radius in (0, 5, 11):
        want = _reference(query, index, radius, True)
        for parts in (None, 0, 6, 7, 20):
            _check(hamming.near_pairs(query, index, radius, same=True, parts=parts), want)


def test_plan_prefers_tables_on_a_large_pool_and_all_pairs_on_a_small_one():
    assert hamming.plan(2_000_000, 19_000_000, 4, 64) == 3  # 21-22 bit substrings: buckets of ~5-9
    assert hamming.plan(20, 100, 4, 64) == 0
    assert hamming.plan(2_000_000, 19_000_000, 63, 64) == 0  # everything is near: no filter helps


def test_bad_input_is_one_line():
    h = np.zeros((3, 2, 1), np.uint64)
    with pytest.raises(ValueError, match="radius"):
        hamming.near_pairs(h, h, -1)
    with pytest.raises(ValueError, match="uint64"):
        hamming.near_pairs(h.astype(np.int64), h, 2)
    with pytest.raises(ValueError, match="one pool"):
        hamming.near_pairs(h, h[:2], 2, same=True)
    with pytest.raises(ValueError, match="parts"):
        hamming.near_pairs(h, h, 2, parts=1)
    a, b, d = hamming.near_pairs(h[:0], h, 3)
    assert a.size == b.size == d.size == 0


def test_stats_count_the_work():
    rng = np.random.default_rng(5)
    query, index = _pool(rng, 30, 2, 3, 1)
    all_pairs, tables = {}, {}
    a, _, _ = hamming.near_pairs(query, index, 6, parts=0, stats=all_pairs)
    hamming.near_pairs(query, index, 6, parts=4, stats=tables)
    assert all_pairs == {"parts": 0, "probes": 0, "candidates": 60 * 90, "pairs": a.size}
    assert tables["parts"] == 4 and tables["pairs"] == a.size
    assert 0 < tables["candidates"] < 60 * 90 * 4 and tables["probes"] > 0
