"""mmalign.data.phash against imagehash's own pHash, and its pair distance against a naive loop."""

import io

import numpy as np
import pytest
from PIL import Image, ImageOps

from mmalign.data import phash

imagehash = pytest.importorskip("imagehash")


def _images(seed: int = 0) -> list[Image.Image]:
    """Images of several sizes, aspect ratios and modes, with detail at many scales."""
    rng = np.random.default_rng(seed)
    out = []
    for size, mode in (
        ((32, 32), "RGB"),
        ((64, 48), "RGB"),
        ((200, 300), "RGB"),
        ((40, 40), "L"),
        ((50, 70), "RGBA"),
    ):
        base = rng.integers(0, 256, (12, 12, 4), dtype=np.uint8)
        image = Image.fromarray(base, "RGBA").resize(size, Image.Resampling.BICUBIC).convert(mode)
        out.append(image)
    return out


def _bits(word: np.ndarray) -> np.ndarray:
    return np.unpackbits(np.ascontiguousarray(word).view(np.uint8), bitorder="little").astype(bool)


def _ref(image: Image.Image) -> np.ndarray:
    return imagehash.phash(image).hash.ravel()  # (64,) bool, row-major frequencies


def test_the_whole_view_and_its_mirror_are_imagehash_phash_bit_for_bit():
    images = _images()
    query, index = phash.hash_images(images)
    assert query.shape == (len(images), phash.QUERIES, phash.WORDS) and query.dtype == np.uint64
    assert index.shape == (len(images), phash.VIEWS, phash.WORDS)
    for k, image in enumerate(images):
        np.testing.assert_array_equal(_bits(query[k, 0]), _ref(image))
        np.testing.assert_array_equal(_bits(query[k, 1]), _ref(ImageOps.mirror(image)))
        np.testing.assert_array_equal(index[k, 0], query[k, 0])  # the whole image is an index view too


def test_each_crop_view_is_imagehash_phash_of_that_crop():
    """On an image no larger than the crop working size, each crop view is pHash of the crop box
    (PIL's box resize), taken through imagehash on the cropped image."""
    image = _images()[1]  # 64 x 48: cut as it is
    w, h = image.size
    _, index = phash.hash_images([image])
    boxes = []
    for scale, positions in phash.CROPS:
        cw, ch = scale * w, scale * h
        boxes += [
            (px * (w - cw), py * (h - ch), px * (w - cw) + cw, py * (h - ch) + ch)
            for py in positions
            for px in positions
        ]
    assert len(boxes) == phash.VIEWS - 1
    for v, box in enumerate(boxes, start=1):
        crop = image.convert("L").resize((phash.SIDE, phash.SIDE), Image.Resampling.LANCZOS, box=box)
        np.testing.assert_array_equal(_bits(index[0, v]), _ref(crop))


def test_distance_is_the_smallest_query_to_index_distance_either_way():
    rng = np.random.default_rng(3)
    pairs = []
    for _ in range(20):
        qa, qb = rng.integers(0, 2**63, (2, phash.QUERIES, phash.WORDS), dtype=np.uint64)
        ia, ib = rng.integers(0, 2**63, (2, phash.VIEWS, phash.WORDS), dtype=np.uint64)
        naive = min(
            *(bin(int(q ^ v)).count("1") for q in qb[:, 0] for v in ia[:, 0]),
            *(bin(int(q ^ v)).count("1") for q in qa[:, 0] for v in ib[:, 0]),
        )
        assert phash.distance(qa, ia, qb, ib) == naive == phash.distance(qb, ib, qa, ia)
        pairs.append((qa, ia, qb, ib, naive))
    qa, ia, qb, ib, naive = (np.stack(x) for x in zip(*pairs))  # the K pairs at once
    np.testing.assert_array_equal(phash.distances(qa, ia, qb, ib), naive)


def _jpeg(image: Image.Image, quality: int) -> Image.Image:
    buf = io.BytesIO()
    image.convert("RGB").save(buf, format="JPEG", quality=quality)
    return Image.open(io.BytesIO(buf.getvalue()))


def test_edits_land_near_and_other_images_far():
    """Each kind of edit within the default distance of its original; unrelated images far apart.
    Crops: a crop on a grid position of the views (60 of 64 px, 2 px in)."""
    images = [im.convert("RGB").resize((64, 64)) for im in _images(7)]
    edits = {
        "mirror": ImageOps.mirror,
        "jpeg 60": lambda im: _jpeg(im, 60),
        "resize 40 px": lambda im: im.resize((40, 40), Image.Resampling.BILINEAR),
        "crop 60 of 64": lambda im: im.crop((2, 2, 62, 62)).resize((64, 64), Image.Resampling.BICUBIC),
    }
    q, i = phash.hash_images(images)
    for name, edit in edits.items():
        eq, ei = phash.hash_images([edit(im) for im in images])
        for k in range(len(images)):
            assert phash.distance(q[k], i[k], eq[k], ei[k]) <= phash.DEFAULT_DISTANCE, (name, k)
    for a in range(len(images)):
        for b in range(a + 1, len(images)):
            assert phash.distance(q[a], i[a], q[b], i[b]) > 4 * phash.DEFAULT_DISTANCE


def test_one_colour_histogram_in_another_layout_is_far():
    image = np.asarray(_images(11)[2].convert("RGB").resize((64, 64)))
    swapped = np.concatenate(
        [
            np.concatenate([image[32:, 32:], image[32:, :32]], 1),
            np.concatenate([image[:32, 32:], image[:32, :32]], 1),
        ],
        0,
    )
    q, i = phash.hash_images([Image.fromarray(image), Image.fromarray(swapped)])
    assert phash.distance(q[0], i[0], q[1], i[1]) > 4 * phash.DEFAULT_DISTANCE


@pytest.mark.parametrize("bad", [-1, phash.BITS, 2.5, "two", None])
def test_a_distance_outside_the_bits_is_refused_naming_the_range(bad):
    with pytest.raises(ValueError, match=f"0..{phash.BITS - 1}|number of bits"):
        phash.check_distance(bad)
    assert phash.check_distance(phash.DEFAULT_DISTANCE) == phash.DEFAULT_DISTANCE


def test_no_images_give_empty_arrays():
    query, index = phash.hash_images([])
    assert query.shape == (0, phash.QUERIES, phash.WORDS) and index.shape == (0, phash.VIEWS, phash.WORDS)


def test_hashing_in_blocks_gives_the_hashes_of_one_pass(monkeypatch):
    images = _images(5) * 3  # 15 images
    whole = phash.hash_images(images)
    monkeypatch.setattr(phash, "BLOCK", 4)  # 4 + 4 + 4 + 3
    blocked = phash.hash_images(iter(images))  # any iterable, not only a list
    for a, b in zip(whole, blocked):
        np.testing.assert_array_equal(a, b)
