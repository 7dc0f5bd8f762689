"""``mmalign index``'s choice by memory budget: sizes, the kind per budget (hand-computed), the
smallest-budget error, and the OPQ rule."""

from __future__ import annotations

import numpy as np
import pytest

from mmalign.errors import UsageError
from mmalign.search.index_plan import choose_plan, opq_helps, parse_size

N, D = 100_000, 64  # Flat needs N * D * 4 = 25_600_000 bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512M", 512 * 2**20),
        ("4G", 4 * 2**30),
        ("1.5G", int(1.5 * 2**30)),
        ("4GB", 4 * 2**30),
        ("1000", 1000),
    ],
)
def test_sizes_parse(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4X", "-1G", "G", "1.2.3M", "0"])
def test_bad_size_is_one_line(text):
    with pytest.raises(UsageError, match="is not a size"):
        parse_size(text)


def test_budget_above_flat_gives_flat_while_queries_are_fast():
    assert choose_plan(N, D, N * D * 4, flat_ms=1.0).kind == "flat"
    # an exact scan over the limit: HNSW32 needs N * (4D + 4 * (64 + 32/31) + 12) = 52_412_903 bytes
    # neither HNSW nor IVF-Flat (8 more bytes a vector for its ids) fits Flat's own bytes
    assert choose_plan(N, D, N * D * 4, flat_ms=50.0).kind == "opq-ivf-pq"
    # IVF-Flat, N * (4D + 8) + 1264 lists * (4D + 8) = 26_733_696 bytes, comes before HNSW (auto
    # builds HNSW only as the fallback of an IVF-Flat that misses the recall target: index.py)
    assert choose_plan(N, D, 53_000_000, flat_ms=50.0).factory == "IVF1264,Flat"
    hnsw = choose_plan(N, D, 53_000_000, kind="hnsw")
    assert (hnsw.kind, hnsw.factory) == ("hnsw", "HNSW32")
    assert choose_plan(N, D, 41_000_000, kind="hnsw").factory == "HNSW16"  # 4D + 4 * 33.07 + 12 = 400.3 B


def test_smaller_budgets_give_compressed_kinds():
    # IVF-Flat: N * (4D + 8) + nlist * (4D + 8); nlist = 4 sqrt(N) = 1264 (train 50_560 >= 40 per list)
    ivf_flat = N * (4 * D + 8) + 1264 * (4 * D + 8)
    plan = choose_plan(N, D, ivf_flat, flat_ms=50.0)
    assert (plan.kind, plan.factory, plan.estimated_bytes) == ("ivf-flat", "IVF1264,Flat", ivf_flat)
    # below it: OPQ+IVF-PQ with the largest code that fits; m divides D, m <= D/2
    trained = 1264 * (4 * D + 8) + 4 * D * 256 + 4 * D * D + 4 * D
    for m in (32, 16, 8, 4):
        plan = choose_plan(N, D, N * (m + 8) + trained, flat_ms=50.0)
        assert plan.factory == f"OPQ{m},IVF1264,PQ{m}x8" and plan.estimated_bytes == N * (m + 8) + trained
    assert choose_plan(N, D, N * (32 + 8) + trained - 1, flat_ms=50.0).params["m"] == 16
    # no rotation wanted: plain IVF-PQ, without the rotation's bytes
    plain = choose_plan(N, D, N * 24 + trained, flat_ms=50.0, opq=False)
    assert plain.factory == "IVF1264,PQ16x8" and plain.estimated_bytes == N * 24 + trained - 4 * D * D - 4 * D


def test_too_small_budget_names_the_smallest():
    smallest = N * (4 + 8) + 1264 * (4 * D + 8) + 4 * D * 256 + 4 * D * D + 4 * D  # OPQ4: 1_615_872 B
    match = r"too small for 100000 vectors of dim 64.*\(OPQ4,IVF1264,PQ4x8\) needs 1\.5M \(1615872 bytes\)"
    with pytest.raises(UsageError, match=match):
        choose_plan(N, D, smallest - 1, flat_ms=50.0)
    assert choose_plan(N, D, smallest, flat_ms=50.0).params["m"] == 4


def test_forced_kind_and_overrides():
    with pytest.raises(UsageError, match="--kind flat: Flat needs 24.4M"):
        choose_plan(N, D, 10 * 2**20, kind="flat")
    assert choose_plan(N, D, 10 * 2**20, kind="ivf-pq").factory == "IVF1264,PQ32x8"
    plan = choose_plan(N, D, 2**30, kind="ivf-pq", nlist=100, pq_m=8, nbits=6)
    assert plan.factory == "IVF100,PQ8x6"
    with pytest.raises(UsageError, match="--pq-m=7 must divide"):
        choose_plan(N, D, None, pq_m=7)
    assert choose_plan(N, D, 2**30, exact_max=N, flat_ms=99.0).kind == "flat"  # --exact-max forces Flat


def test_without_a_budget_the_old_rule():
    assert choose_plan(1000, D, None).kind == "flat"
    old = choose_plan(200_000, D, None)
    assert old.factory == f"IVF{int(4 * np.sqrt(200_000))},PQ16x8"  # ~4 sqrt(n) lists, dim/4 codes
    assert choose_plan(500, D, None, exact_max=100).kind == "ivf-pq"


def test_opq_rule_sees_correlated_blocks():
    rng = np.random.default_rng(0)
    iid = rng.standard_normal((4000, 32))
    assert not opq_helps(iid, 8)  # independent, equal-variance coordinates: nothing to rotate
    mixed = iid @ rng.standard_normal((32, 32))  # every coordinate a mix of all others
    assert opq_helps(mixed, 8)
    uneven = iid * np.r_[np.full(4, 10.0), np.ones(28)]  # one block holds most of the variance
    assert opq_helps(uneven, 8)


def test_shards_repeat_the_trained_part():
    trained = 1264 * (4 * D + 8) + 4 * D * 256 + 4 * D * D + 4 * D  # centroids, codebooks, rotation
    one = choose_plan(N, D, N * (32 + 8) + trained, flat_ms=50.0)
    assert one.params["m"] == 32
    four = choose_plan(N, D, N * (32 + 8) + trained, flat_ms=50.0, shards=4)
    assert four.params["m"] == 16 and four.estimated_bytes == N * (16 + 8) + 4 * trained
    assert choose_plan(N, D, 2**30, kind="flat", shards=4).estimated_bytes == N * D * 4  # nothing trained
