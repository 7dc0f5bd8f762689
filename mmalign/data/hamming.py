"""Exact range search over the Hamming space: every pair of hashes within a radius, without all pairs.

Multi-index hashing (Norouzi, Punjani and Fleet 2012, "Fast search in Hamming space with
multi-index hashing"): the BITS bits of a hash are cut into ``s`` substrings. Two hashes within
``r = s * r' + a`` bits (``0 <= a < s``) have, by pigeonhole, one of their first ``a + 1``
substrings within ``r'`` bits or one of the others within ``r' - 1`` (if every substring were
further, the whole would be at least ``r + 1`` apart). So each index hash is put into ``s``
bucket tables, one per substring, addressed directly by the substring's value (a counting sort:
the bucket offsets are a cumulative count of the values); a query hash probes, in each table,
every value within that substring's radius of its own; the hashes in those buckets are the
candidates, and their full distance (a popcount of the XOR) decides. Exact: no pair within
``r`` is missed, none further is reported. A candidate found in several tables is reported by
the first one that can find it only.

Choosing ``s``: a table's buckets hold on average ``N / 2^L`` of the ``N`` index hashes (``L``
its substring's bits), and a query probes ``sum_{i <= r_k} C(L, i)`` buckets of it. The cost of
each ``s`` whose substrings fit a direct-address table (``L <= MAX_TABLE_BITS``) is estimated
as probes plus expected candidates (uniform hashes) plus building the tables, beside the cost
of comparing every pair; the cheapest is run (:func:`plan`). On 64 bits and 2M query against
20-40M index hashes (a 1M-sample pool) that is ``s = 3`` (21-22 bit substrings) for radii up to
12, and a query hash meets ~N * 3 * C(21, <= r/3) / 2^21 candidates: a few hundred at 4 bits,
a few thousand at 8 (the candidates, not the pairs, are the cost). On a few thousand hashes
or a large radius, comparing every pair in blocks wins. Real hashes are not uniform
(correlated bits fill some buckets more), which costs time, never exactness.

Memory (what is held at once, besides the inputs and the pairs found): one table, i.e. the
index hashes sorted by one substring (N x WORDS uint64), their rows (N int32; int64 past 2^31)
and the bucket offsets (2^L + 1, at most 2^24 + 1); while a table is built, its keys (N int32)
and their argsort (N int64). Then one block of probes (at most ``BLOCK`` bucket ids, their
offsets and query rows) and one block of candidates (at most ``BLOCK`` positions, their hashes
and distances). For a 1M-sample pool of 35 index hashes: ~0.45 GB of table, ~0.4 GB more while
building it, ~0.2 GB of blocks. Comparing every pair holds one (b, N) block of distances with
``b * N <= BLOCK``.
"""

from __future__ import annotations

import math

import numpy as np

from mmalign.data.phash import popcount

MAX_TABLE_BITS = 24  # a direct-address table has 2^L + 1 offsets: 128 MiB of int64 at most
BLOCK = 1 << 22  # probes, candidates or pair distances held at once (~4M; tens of MiB each)
_COST_PROBE = 2.0  # one probe (bucket lookup) against one candidate check (gather, XOR, popcount)
_COST_BUILD = 3.0  # per index hash and table: the substring, its sort and the sorted copy
_COST_SCAN = 0.5  # one pair in the all-pairs blocks (contiguous, no gather)


def _layout(bits: int, s: int, radius: int) -> list[tuple[int, int, int]]:
    """(start bit, length, probe radius) of each of ``s`` substrings; a radius < 0 is never probed."""
    lengths = [bits // s + (k < bits % s) for k in range(s)]  # longer first: they get the larger radius
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    rp, a = divmod(radius, s)
    return [(starts[k], lengths[k], rp if k <= a else rp - 1) for k in range(s)]


def _probes(length: int, radius: int) -> int:
    return sum(math.comb(length, i) for i in range(min(radius, length) + 1)) if radius >= 0 else 0


def plan(n_query: int, n_index: int, radius: int, bits: int) -> int:
    """The number of substrings to search ``n_query`` against ``n_index`` hashes with; 0: all pairs.

    Estimated cost per ``s`` (uniform hashes): for each probed substring of L bits and radius
    r_k, ``n_query * (P * _COST_PROBE + n_index * P / 2^L)`` with P the values within r_k, plus
    building ``s`` tables of ``n_index`` hashes; all pairs: ``n_query * n_index * _COST_SCAN``."""
    best, best_cost = 0, n_query * n_index * _COST_SCAN
    for s in range(math.ceil(bits / MAX_TABLE_BITS), bits + 1):
        cost = s * n_index * _COST_BUILD
        for _, length, r in _layout(bits, s, radius):
            p = _probes(length, r)
            cost += n_query * (p * _COST_PROBE + n_index * p / 2.0**length)
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def _masks(length: int, radius: int) -> np.ndarray:
    """(P,) int64: every value of ``length`` bits with at most ``radius`` bits set, fewest first."""
    layer, top = np.zeros(1, np.int64), np.full(1, -1)  # values with d bits set and their highest bit
    out = [layer]
    for _ in range(min(radius, length)):
        bit = np.arange(length)
        ok = bit[None, :] > top[:, None]  # (p, L): add a bit above the highest, so each set once
        layer = (layer[:, None] | (np.int64(1) << bit)[None, :])[ok]
        top = np.broadcast_to(bit, ok.shape)[ok]
        out.append(layer)
    return np.concatenate(out)


def _substring(h: np.ndarray, start: int, length: int) -> np.ndarray:
    """(k, W) uint64 hashes -> (k,) int64: bits start .. start+length-1 (length <= 63)."""
    word, off = divmod(start, 64)
    v = h[:, word] >> np.uint64(off)
    if off + length > 64:  # the substring runs into the next word
        v = v | (h[:, word + 1] << np.uint64(64 - off))
    return (v & np.uint64((1 << length) - 1)).astype(np.int64)


class _Hits:
    """Verified (query row, index row, distance) found so far, reduced to (a, b, min d) per block."""

    def __init__(self, q_per: int, v_per: int, n_index: int, same: bool):
        self.q_per, self.v_per, self.n_index, self.same = q_per, v_per, n_index, same
        self.keys: list[np.ndarray] = []
        self.dist: list[np.ndarray] = []

    def add(self, qrow: np.ndarray, irow: np.ndarray, d: np.ndarray) -> None:
        a, b = qrow // self.q_per, irow // self.v_per
        if self.same:  # one unordered pair, the smaller distance of both directions
            keep = a != b
            a, b, d = a[keep], b[keep], d[keep]
            a, b = np.minimum(a, b), np.maximum(a, b)
        self._push(a * self.n_index + b, d)

    def _push(self, key: np.ndarray, d: np.ndarray) -> None:
        if key.size:
            order = np.lexsort((d, key))  # by pair, the smallest distance first
            key, d = key[order], d[order]
            first = np.ones(key.size, bool)
            first[1:] = key[1:] != key[:-1]
            self.keys.append(key[first])
            self.dist.append(d[first])

    def result(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        key = np.concatenate(self.keys) if self.keys else np.zeros(0, np.int64)
        d = np.concatenate(self.dist) if self.dist else np.zeros(0, np.int64)
        self.keys, self.dist = [], []
        self._push(key, d)
        key = self.keys[0] if self.keys else key
        d = self.dist[0] if self.dist else d
        return key // self.n_index, key % self.n_index, d


def _all_pairs(qh: np.ndarray, ih: np.ndarray, radius: int, hits: _Hits, stats: dict) -> None:
    """Every (query hash, index hash) pair compared, in (b, N) blocks."""
    stats["candidates"] += len(qh) * len(ih)
    step = max(1, BLOCK // max(1, len(ih)))
    for s in range(0, len(qh), step):
        d = popcount(qh[s : s + step, None, :] ^ ih[None, :, :])  # (b, N)
        qi, ii = np.nonzero(d <= radius)
        hits.add(qi + s, ii, d[qi, ii])


def _search_table(qh, ih, radius, layout, k, hits: _Hits, stats: dict) -> None:
    """Probe table ``k`` with every query hash; verify the candidates; keep those no earlier
    table finds."""
    start, length, r_k = layout[k]
    key = _substring(ih, start, length).astype(np.int32)  # (N,) length <= MAX_TABLE_BITS < 31
    small = np.int32 if len(ih) < 2**31 else np.int64  # positions and offsets: half the bytes to move
    offsets = np.zeros((1 << length) + 1, small)
    np.cumsum(np.bincount(key, minlength=1 << length), out=offsets[1:])  # direct-address buckets
    rows = np.argsort(key).astype(small)  # (N,) index rows bucket by bucket (any order inside one)
    del key
    cols = [np.ascontiguousarray(ih[rows, w]) for w in range(ih.shape[1])]  # W x (N,): sorted by bucket
    masks = _masks(length, r_k)  # (P,)
    qstep = max(1, BLOCK // masks.size)
    for s in range(0, len(qh), qstep):
        qblock = qh[s : s + qstep]  # (b, W)
        probe = (_substring(qblock, start, length)[:, None] ^ masks[None, :]).ravel()  # (b * P,)
        lo = offsets[probe]
        count = offsets[probe + 1] - lo
        stats["probes"] += probe.size
        owner = np.repeat(np.arange(len(qblock), dtype=small), masks.size)  # (b * P,) row in the block
        if np.count_nonzero(count) < count.size // 2:  # mostly empty buckets: drop them first
            nz = np.flatnonzero(count)
            lo, count, owner = lo[nz], count[nz], owner[nz]
        del probe
        ends = np.cumsum(count, dtype=np.int64)  # (p,)
        total, c0 = int(ends[-1]) if ends.size else 0, 0
        stats["candidates"] += total
        while c0 < total:  # candidates in ranges of at most BLOCK, cutting a bucket where need be
            c1 = min(total, c0 + BLOCK)
            j0, j1 = np.searchsorted(ends, [c0, c1 - 1], side="right")  # probes holding c0 .. c1-1
            j1 += 1
            first = ends[j0:j1] - count[j0:j1]  # each probe's first candidate number
            n = (np.minimum(ends[j0:j1], c1) - np.maximum(first, c0)).astype(small)
            shift = (lo[j0:j1] + np.maximum(c0 - first, 0) - (np.cumsum(n) - n)).astype(small)
            pos = np.repeat(shift, n) + np.arange(c1 - c0, dtype=small)  # (c,) into the sorted table
            probe_q = owner[j0:j1]  # (p',) each probe's query row in the block
            d = np.bitwise_count(cols[0][pos] ^ np.repeat(qblock[probe_q, 0], n))  # (c,) uint8
            for w in range(1, len(cols)):
                d += np.bitwise_count(cols[w][pos] ^ np.repeat(qblock[probe_q, w], n))
            ok = np.flatnonzero(d <= radius)  # the full distance decides; few pass
            qrow = probe_q[np.searchsorted(np.cumsum(n), ok, side="right")].astype(np.int64) + s
            pos, d = pos[ok], d[ok].astype(np.int64)
            del ok
            for st, ln, r_j in layout[:k]:  # found by an earlier table already: not again
                if r_j >= 0:
                    ih_pos = np.stack([c[pos] for c in cols], axis=1)  # (h, W)
                    dj = np.bitwise_count(_substring(qh[qrow], st, ln) ^ _substring(ih_pos, st, ln))
                    fresh = dj > r_j
                    qrow, pos, d = qrow[fresh], pos[fresh], d[fresh]
            hits.add(qrow, rows[pos].astype(np.int64), d)
            c0 = c1


def near_pairs(
    query: np.ndarray,
    index: np.ndarray,
    radius: int,
    *,
    same: bool = False,
    parts: int | None = None,
    stats: dict | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (a, b) with ``min_{q, v} popcount(query[a, q] ^ index[b, v]) <= radius``.

    query (n, Q, W), index (m, V, W) uint64 -> (a, b, d) int64 arrays, d that minimum, each pair
    once, sorted by (a, b). ``same``: query and index describe one pool (n == m): pairs a < b
    only, d the smaller of both directions (``mmalign.data.phash.distance``). ``parts``: the
    number of substrings (0: compare all pairs; None: :func:`plan` chooses). ``stats``: a dict
    that receives the work done (``parts``, ``probes``, ``candidates`` checked, ``pairs``)."""
    query, index = np.asarray(query), np.asarray(index)
    if query.ndim != 3 or index.ndim != 3 or query.shape[2] != index.shape[2]:
        raise ValueError(
            f"query (n, Q, W) and index (m, V, W) of one W expected, got {query.shape}, {index.shape}"
        )
    if query.dtype != np.uint64 or index.dtype != np.uint64:
        raise ValueError(f"hashes must be uint64, got {query.dtype} and {index.dtype}")
    if same and query.shape[0] != index.shape[0]:
        raise ValueError(
            f"same=True needs one pool: {query.shape[0]} query rows, {index.shape[0]} index rows"
        )
    if int(radius) != radius or radius < 0:
        raise ValueError(f"radius must be a whole number of bits >= 0, got {radius!r}")
    radius, (n, q_per, w), (m, v_per, _) = int(radius), query.shape, index.shape
    bits = 64 * w
    qh = np.ascontiguousarray(query.reshape(n * q_per, w))  # (n*Q, W): row a*Q + q
    ih = np.ascontiguousarray(index.reshape(m * v_per, w))  # (m*V, W): row b*V + v
    hits = _Hits(q_per, v_per, m, same)
    work = {"parts": 0, "probes": 0, "candidates": 0}
    if len(qh) and len(ih):
        s = plan(len(qh), len(ih), min(radius, bits), bits) if parts is None else int(parts)
        work["parts"] = 0 if radius >= bits else s
        if s == 0 or radius >= bits:
            _all_pairs(qh, ih, radius, hits, work)
        else:
            if not math.ceil(bits / MAX_TABLE_BITS) <= s <= bits:
                raise ValueError(f"parts must be 0 or in {math.ceil(bits / MAX_TABLE_BITS)}..{bits}, got {s}")
            layout = _layout(bits, s, radius)
            for k in range(s):
                if layout[k][2] >= 0:
                    _search_table(qh, ih, radius, layout, k, hits, work)
    a, b, d = hits.result()
    if stats is not None:
        stats.update(work, pairs=int(a.size))
    return a, b, d
