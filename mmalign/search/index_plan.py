"""Which FAISS index fits a memory budget: the candidates, their memory estimates, the choice.

The kinds, in the order ``auto`` tries them (every one inner product over unit vectors):

* ``flat``        exact; ``4 d`` bytes a vector.
* ``ivf-flat``    ``IVF{nlist},Flat``: full vectors in ``nlist`` lists; ``4 d + 8`` bytes a vector.
* ``hnsw``        a graph over the full vectors (``HNSW{M}``): ``4 d + ~8 M + 16`` bytes a vector;
  ``auto`` builds it only when IVF-Flat missed the recall target and it fits (``index.py``).
* ``opq-ivf-pq``  ``OPQ{m},IVF{nlist},PQ{m}x{nbits}``: a learnt rotation, then PQ codes.
* ``ivf-pq``      ``IVF{nlist},PQ{m}x{nbits}``: ``m nbits / 8 + 8`` bytes a vector.

``choose_plan`` takes the first kind whose estimate fits the budget (Flat only while its
brute-force query also fits the time limit, since an exact scan's cost grows with n), and for
PQ the largest code that fits.  The estimates count what FAISS writes: the vectors or codes, the
8-byte ids of the inverted lists, the coarse centroids, the PQ codebooks, the rotation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from mmalign.errors import UsageError

KINDS = ("flat", "hnsw", "ivf-flat", "ivf-pq", "opq-ivf-pq")
SMALL = 1000  # below this many vectors an exact scan is as fast as anything
HNSW_M = (32, 16)  # graph degrees tried, largest first (fewer than 16 links loses too much recall)
TRAIN_MAX = 262_144  # at most this many training vectors (k-means cost grows with it)
TRAIN_PER_LIST = 40  # FAISS warns under 39 training points per centroid
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_size(text: str | int, flag: str = "--max-index-memory") -> int:
    """``512M``, ``4G``, ``1.5G``, ``4GB``, ``1000`` -> bytes (binary units: 1K = 1024)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), flags=re.IGNORECASE)
    if m is None or float(m.group(1)) <= 0:
        raise UsageError(f"{flag}: {text!r} is not a size (say 512M, 4G or 1.5G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_size(n: float) -> str:
    for unit in ("T", "G", "M", "K"):
        if n >= _UNITS[unit]:
            return f"{n / _UNITS[unit]:.1f}{unit}"
    return f"{int(n)}B"


@dataclass
class Plan:
    kind: str
    factory: str
    params: dict = field(default_factory=dict)  # nlist, m, nbits, M
    estimated_bytes: int = 0
    quantizer_bytes: int = 0  # what every shard repeats (centroids, codebooks, rotation)
    note: str = ""  # why this kind (one phrase)


def default_nlist(count: int, train_rows: int | None = None) -> int:
    """~4 sqrt(n) lists, with at least ``TRAIN_PER_LIST`` training points each."""
    train_rows = train_rows if train_rows is not None else train_size(count)
    return max(1, min(int(4 * math.sqrt(count)), train_rows // TRAIN_PER_LIST))


def train_size(count: int) -> int:
    """Training vectors for a corpus of ``count``: enough for ~4 sqrt(n) lists and 256 PQ centroids."""
    lists = int(4 * math.sqrt(count))
    return min(count, max(TRAIN_PER_LIST * lists, TRAIN_PER_LIST * 256), TRAIN_MAX)


def default_nbits(train_rows: int) -> int:
    """8 bits, fewer when the sample cannot give each of the 2^nbits centroids ~39 points."""
    return max(4, min(8, int(math.log2(max(2, train_rows // 39)))))


def pq_choices(dim: int) -> list[int]:
    """Sub-quantizer counts, largest first: divisors of ``dim`` from dim/2 down to 4 (>= 2 dims each)."""
    found = [m for m in range(dim // 2, 0, -1) if dim % m == 0 and m >= min(4, dim // 2)]
    return found or [1]


def estimate_bytes(kind: str, count: int, dim: int, params: dict) -> tuple[int, int]:
    """(total bytes, bytes of the trained part every shard repeats) of the index as written."""
    n, d = count, dim
    if kind == "flat":
        return n * 4 * d, 0
    if kind == "hnsw":
        big_m = int(params["M"])
        # level 0 keeps 2M int32 links, each upper level M (a node climbs with probability 1/M):
        # 2M + M/(M-1) links on average, plus an 8-byte offset and a 4-byte level per node
        links = 2 * big_m + big_m / max(1, big_m - 1)
        return int(n * (4 * d + 4 * links + 12)), 0
    nlist = int(params["nlist"])
    coarse = nlist * (4 * d + 8)  # centroids + a size per list
    if kind == "ivf-flat":
        return n * (4 * d + 8) + coarse, coarse
    code = math.ceil(int(params["m"]) * int(params["nbits"]) / 8)
    trained = coarse + 4 * d * 2 ** int(params["nbits"])  # + the PQ codebooks
    if kind == "opq-ivf-pq":
        trained += 4 * d * d + 4 * d  # the rotation (and its bias)
    return n * (code + 8) + trained, trained


def factory_string(kind: str, params: dict) -> str:
    if kind == "flat":
        return "Flat"
    if kind == "hnsw":
        return f"HNSW{params['M']}"
    if kind == "ivf-flat":
        return f"IVF{params['nlist']},Flat"
    pq = f"IVF{params['nlist']},PQ{params['m']}x{params['nbits']}"
    return f"OPQ{params['m']},{pq}" if kind == "opq-ivf-pq" else pq


def _make_plan(kind: str, count: int, dim: int, params: dict, note: str = "", shards: int = 1) -> Plan:
    """``shards`` files each repeat the trained part (centroids, codebooks, rotation)."""
    total, trained = estimate_bytes(kind, count, dim, params)
    return Plan(
        kind, factory_string(kind, params), dict(params), total + (shards - 1) * trained, trained, note
    )


def _pq_kind(opq: bool) -> str:
    return "opq-ivf-pq" if opq else "ivf-pq"


def choose_plan(
    count: int,
    dim: int,
    budget: int | None,
    *,
    kind: str = "auto",
    flat_ms: float = 0.0,
    max_query_ms: float = 10.0,
    opq: bool = True,
    train_rows: int | None = None,
    exact_max: int | None = None,
    nlist: int | None = None,
    pq_m: int | None = None,
    nbits: int | None = None,
    shards: int = 1,
) -> Plan:
    """The index for ``count`` vectors of ``dim`` within ``budget`` bytes (None: no budget).

    ``flat_ms``: the measured time of one exact query over all ``count`` vectors; ``opq``: whether a
    rotation helps this data's PQ (see ``opq_helps``).  ``nlist``/``pq_m``/``nbits`` override the
    defaults; ``exact_max`` forces Flat up to that many vectors; ``shards`` files each repeat the
    trained part, and the budget holds them all.  Without a budget and with
    ``kind="auto"`` the rule is the old one: Flat up to ``exact_max`` (100k), else IVF-PQ.
    """
    if kind not in ("auto", *KINDS):
        raise UsageError(f"--kind: {kind!r} is not one of auto, {', '.join(KINDS)}")
    train_rows = train_size(count) if train_rows is None else train_rows
    lists = int(nlist) if nlist is not None else default_nlist(count, train_rows)
    bits = int(nbits) if nbits is not None else default_nbits(train_rows)
    if pq_m is not None and dim % int(pq_m):
        raise UsageError(f"--pq-m={pq_m} must divide the embedding dim {dim}")
    ivf = {"nlist": lists}

    def make_plan(kind_: str, count_: int, dim_: int, params: dict, note: str = "") -> Plan:
        return _make_plan(kind_, count_, dim_, params, note, shards)

    def pq_plans(kinds: list[str]) -> list[Plan]:
        ms = [int(pq_m)] if pq_m is not None else pq_choices(dim)
        return [make_plan(k, count, dim, {**ivf, "m": m, "nbits": bits}) for m in ms for k in kinds]

    if budget is None:
        if kind == "auto":
            if count <= (100_000 if exact_max is None else exact_max):
                return make_plan("flat", count, dim, {}, "at most --exact-max vectors")
            m = (
                int(pq_m)
                if pq_m is not None
                else max(x for x in range(1, max(1, dim // 4) + 1) if dim % x == 0)
            )
            return make_plan("ivf-pq", count, dim, {**ivf, "m": m, "nbits": bits}, "over --exact-max")
        if kind == "hnsw":
            return make_plan("hnsw", count, dim, {"M": HNSW_M[0]}, "--kind")
        if kind in ("ivf-pq", "opq-ivf-pq"):
            m = (
                int(pq_m)
                if pq_m is not None
                else max(x for x in range(1, max(1, dim // 4) + 1) if dim % x == 0)
            )
            return make_plan(kind, count, dim, {**ivf, "m": m, "nbits": bits}, "--kind")
        return make_plan(kind, count, dim, ivf if kind == "ivf-flat" else {}, "--kind")

    candidates: list[Plan]
    if kind == "auto":
        if exact_max is not None and count <= exact_max:
            candidates = [make_plan("flat", count, dim, {}, "at most --exact-max vectors")]
        elif count < SMALL or flat_ms <= max_query_ms:
            why = "few vectors" if count < SMALL else "an exact query fits --max-query-ms"
            candidates = [make_plan("flat", count, dim, {}, why)]
        else:
            candidates = []
        # IVF-Flat before HNSW: it scans exact distances in the probed lists, builds ~3x faster and
        # holds 8 bytes a vector instead of ~8M + 16; index.py falls back to HNSW (which then fits
        # too) when IVF-Flat misses the recall target (docs/benchmarks.md, search at scale)
        candidates += [make_plan("ivf-flat", count, dim, ivf)]
        candidates += pq_plans([_pq_kind(opq)])
    elif kind == "hnsw":
        candidates = [make_plan("hnsw", count, dim, {"M": M}) for M in HNSW_M]
    elif kind in ("ivf-pq", "opq-ivf-pq"):
        candidates = pq_plans([kind])
    else:
        candidates = [make_plan(kind, count, dim, ivf if kind == "ivf-flat" else {})]
    for plan in candidates:
        if plan.estimated_bytes <= budget:
            plan.note = plan.note or f"the most accurate kind within {format_size(budget)}"
            return plan
    smallest = min(candidates, key=lambda p: p.estimated_bytes)
    if kind == "auto":
        raise UsageError(
            f"--max-index-memory: {format_size(budget)} is too small for {count} vectors of dim {dim}; "
            f"the smallest index ({smallest.factory}) needs {format_size(smallest.estimated_bytes)} "
            f"({smallest.estimated_bytes} bytes)"
        )
    raise UsageError(
        f"--kind {kind}: {smallest.factory} needs {format_size(smallest.estimated_bytes)} for {count} "
        f"vectors of dim {dim}, over --max-index-memory {format_size(budget)}"
    )


def opq_helps(sample, m: int) -> bool:
    """Whether a learnt rotation should help PQ with ``m`` sub-quantizers on this data.

    PQ quantizes contiguous blocks of ``dim/m`` coordinates independently, so it loses most when
    the variance is spread unevenly over the blocks or when coordinates in different blocks are
    correlated; OPQ's rotation fixes both.  Either measured on the sample (float32, (n, d)):
    a block's share of the variance over 1.25x the mean, or over 10% of the covariance's energy
    off the block diagonal.
    """
    import numpy as np

    x = np.asarray(sample, dtype=np.float64)
    d = x.shape[1]
    if m >= d or len(x) < 2:
        return False
    cov = np.cov(x, rowvar=False)  # (d, d)
    block = d // m
    per_block = np.add.reduceat(np.diag(cov), np.arange(0, d, block))  # (m,)
    uneven = per_block.max() > 1.25 * max(per_block.mean(), 1e-30)
    ids = np.arange(d) // block
    same = ids[:, None] == ids[None, :]
    energy = float((cov**2).sum())
    off = float((cov[~same] ** 2).sum()) / max(energy, 1e-30)
    return bool(uneven or off > 0.10)
