"""data_pipelines.curate.perceptual: the non-chaining groups on a sparse graph against the greedy
rule written the slow way (every sample against every kept one, ``phash.distance`` per pair)."""

import io

import numpy as np
import pytest

from data_pipelines.curate import perceptual
from data_pipelines.curate.perceptual_policy import distance_to_kept
from mmalign.data import phash

R = phash.DEFAULT_DISTANCE


def _naive_greedy(n, order, near):
    """The rule as stated: visit ``order``; join the first kept sample ``near`` (in visiting
    order), else be kept. Samples not visited stay alone."""
    groups = list(range(n))
    kept = []
    for v in order:
        for k in kept:
            if near(v, k):
                groups[v] = k
                break
        else:
            kept.append(v)
    return np.array(groups, dtype=np.int64)


def _image(rng, side=48):
    """A smooth random colour image (low frequencies, as photos have) upscaled from 6x6."""
    from PIL import Image

    small = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(small).resize((side, side), Image.Resampling.BICUBIC)


def _edits(im):
    from PIL import Image

    w, h = im.size
    buf = io.BytesIO()
    im.save(buf, format="JPEG", quality=75)
    return {
        "flip": im.transpose(Image.Transpose.FLIP_LEFT_RIGHT),
        "crop": im.crop((1, 1, w - 1, h - 1)).resize((w, h), Image.Resampling.BICUBIC),
        "jpeg": Image.open(io.BytesIO(buf.getvalue())).convert("RGB"),
        "resize": im.resize((w * 2 // 3, h * 2 // 3), Image.Resampling.BILINEAR),
    }


@pytest.fixture(scope="module")
def pool():
    """40 originals and an edited copy of each of the first 16 (flip, crop, JPEG, resize in turn),
    shuffled: (query, index, kind of each row, origin of each row)."""
    rng = np.random.default_rng(0)
    originals = [_image(rng) for _ in range(40)]
    images, origin, kind = list(originals), list(range(40)), ["original"] * 40
    names = ["flip", "crop", "jpeg", "resize"]
    for i in range(16):
        images.append(_edits(originals[i])[names[i % 4]])
        origin.append(i)
        kind.append(names[i % 4])
    perm = rng.permutation(len(images))
    query, index = phash.hash_images([images[p] for p in perm])
    return query, index, [kind[p] for p in perm], np.array(origin)[perm]


def _near_by_hash(query, index, radius):
    return lambda x, y: phash.distance(query[x], index[x], query[y], index[y]) <= radius


@pytest.mark.parametrize("radius", [0, R, 2 * R + 2])
def test_perceptual_groups_equal_the_greedy_rule_on_real_hashes(pool, radius):
    query, index, _, _ = pool
    n = len(query)
    near = _near_by_hash(query, index, radius)
    got = perceptual.perceptual_groups(query, index, radius)
    assert got.tolist() == _naive_greedy(n, range(n), near).tolist()
    scores = np.random.default_rng(1).uniform(size=n)
    scores[[3, 7]] = scores[5]  # ties: by pool index
    scores[9] = np.nan  # NaN: visited last
    order = sorted(range(n), key=lambda i: (np.isnan(scores[i]), -np.nan_to_num(scores[i]), i))
    want = _naive_greedy(n, order, near)
    assert perceptual.perceptual_groups(query, index, radius, scores=scores).tolist() == want.tolist()
    rows = np.arange(0, n, 3)  # only these take part; the others stay alone
    want = _naive_greedy(n, [i for i in order if i in set(rows.tolist())], near)
    got = perceptual.perceptual_groups(query, index, radius, scores=scores, rows=rows)
    assert got.tolist() == want.tolist()


def test_each_kind_of_edit_joins_its_original(pool):
    """Every edited copy within the distance of its original joins it (none is lost by the index
    or taken by another original), and each kind of edit has such copies."""
    query, index, kind, origin = pool
    groups = perceptual.perceptual_groups(query, index, R)
    where = {int(o): i for i, (o, k) in enumerate(zip(origin, kind)) if k == "original"}
    within = {k: 0 for k in ("flip", "crop", "jpeg", "resize")}
    for i, (o, k) in enumerate(zip(origin, kind)):
        if k != "original":
            j = where[int(o)]
            if phash.distance(query[i], index[i], query[j], index[j]) <= R:
                within[k] += 1
                assert groups[i] == groups[j], (k, i, j)
    assert min(within.values()) >= 2, within
    # no two originals share a group: these random images are far apart
    assert len({int(groups[i]) for i in where.values()}) == len(where)


def _chain():
    """a ~ b ~ c with a !~ c at the default distance: c is b with R more bits flipped."""
    a = np.uint64(0)
    b = np.uint64((1 << R) - 1)  # R bits from a
    c = b | np.uint64(((1 << R) - 1) << 32)  # R bits from b, 2R from a
    query = np.zeros((3, phash.QUERIES, phash.WORDS), np.uint64)
    index = np.zeros((3, phash.VIEWS, phash.WORDS), np.uint64)
    for i, h in enumerate((a, b, c)):
        query[i], index[i] = h, h
    query[:, 1] = ~query[:, 0]  # mirrors far from everything
    return query, index


def test_groups_do_not_chain():
    query, index = _chain()
    assert perceptual.perceptual_groups(query, index, R).tolist() == [0, 0, 2]  # a and c kept
    # b visited first: it keeps both a and c, which join it
    assert perceptual.perceptual_groups(query, index, R, scores=np.array([0.5, 0.9, 0.1])).tolist() == [
        1,
        1,
        1,
    ]


def test_greedy_groups_equal_the_rule_on_random_and_deep_graphs():
    rng = np.random.default_rng(2)
    for n, e in ((60, 150), (300, 40), (200, 2000)):
        a, b = rng.integers(0, n, e), rng.integers(0, n, e)
        edges = set(zip(a.tolist(), b.tolist())) | set(zip(b.tolist(), a.tolist()))
        order = rng.permutation(n)[: n - 5]  # 5 samples take no part
        want = _naive_greedy(n, order.tolist(), lambda x, y: (x, y) in edges)
        assert perceptual.greedy_groups(n, a, b, order).tolist() == want.tolist()
    n = 500  # a path visited end to end: every sample waits for the one before, past the rounds cap
    a, b = np.arange(n - 1), np.arange(1, n)
    want = _naive_greedy(n, range(n), lambda x, y: abs(x - y) == 1)
    assert perceptual.greedy_groups(n, b, a, np.arange(n)).tolist() == want.tolist()


def _embeddings(n, rng):
    centres = rng.standard_normal((12, 16))
    emb = centres[rng.integers(0, 12, n)] + 0.08 * rng.standard_normal((n, 16))
    return emb, rng.integers(0, 3, n)


def test_semantic_pairs_equal_every_pair_by_hand():
    rng = np.random.default_rng(3)
    emb, labels = _embeddings(90, rng)
    eps = 0.01
    unit = [v / np.sqrt(sum(x * x for x in v)) for v in emb.tolist()]
    want = [
        (i, j)
        for i in range(90)
        for j in range(i + 1, 90)
        if labels[i] == labels[j] and sum(x * y for x, y in zip(unit[i], unit[j])) > 1 - eps
    ]
    assert want
    a, b = perceptual.semantic_pairs(emb, eps, labels, block_size=7)
    assert list(zip(a.tolist(), b.tolist())) == want
    rows = np.arange(0, 90, 2)
    a, b = perceptual.semantic_pairs(emb, eps, labels, rows=rows)
    assert list(zip(a.tolist(), b.tolist())) == [p for p in want if p[0] % 2 == 0 and p[1] % 2 == 0]
    with pytest.raises(ValueError, match="eps"):
        perceptual.semantic_pairs(emb, 3.0, labels)


def test_union_equals_the_rule_over_either_detector(pool):
    query, index, _, _ = pool
    n = len(query)
    rng = np.random.default_rng(4)
    emb, labels = _embeddings(n, rng)
    eps = 0.01
    scores = rng.uniform(size=n)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    by_hash = _near_by_hash(query, index, R)

    def near(x, y):
        return by_hash(x, y) or (labels[x] == labels[y] and float(unit[x] @ unit[y]) > 1 - eps)

    order = perceptual.visit_order(n, scores)
    assert order.tolist() == sorted(range(n), key=lambda i: (-scores[i], i))
    want = _naive_greedy(n, order.tolist(), near)
    p = perceptual.perceptual_pairs(query, index, R)
    s = perceptual.semantic_pairs(emb, eps, labels)
    assert len(p[0]) and len(s[0])  # both detectors find pairs, so the union is exercised
    got = perceptual.combined_groups(n, [p[:2], s], order)
    assert got.tolist() == want.tolist()
    dist = distance_to_kept(np.concatenate([query, index], axis=1), got)  # what decisions.parquet holds
    for i in range(n):
        assert dist[i] == phash.distance(query[i], index[i], query[got[i]], index[got[i]])


def test_bad_distance_is_one_line(pool):
    query, index, _, _ = pool
    with pytest.raises(ValueError, match=f"0..{phash.BITS - 1}"):
        perceptual.perceptual_groups(query, index, phash.BITS)
