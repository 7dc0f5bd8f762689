"""A perceptual image hash for near-duplicates: pHash over an image, its mirror and small crops of it.

pHash (Zauner 2010, "Implementation and benchmarking of perceptual image hash functions"; bit
for bit what ``imagehash.phash`` computes): the image in grayscale, resized to 32x32 (Lanczos),
its 2-D DCT-II, the 8x8 lowest frequencies, each bit set when its coefficient exceeds their
median. A re-encode or a resize moves the low frequencies little, so a copy lands a few of the
64 bits away, while unrelated images sit near 32.

Two edits move many bits, so they are hashed rather than tolerated:

- a mirror changes the sign of every odd horizontal frequency: each image is hashed as it is and
  mirrored (its two *query* hashes);
- a small crop, resized back, shifts and rescales every frequency: each image is also hashed
  over a grid of crops (sides :data:`CROP_SCALES` of the image, at positions from corner to
  corner, one every 1/32 of the side), which with the whole view are its *index* hashes.

The distance of two images is the smallest Hamming distance between a query hash of one and
an index hash of the other, either way round (:func:`distance`): a crop of ``a`` is near one
of ``a``'s crop views, a mirror of ``a`` is near ``a``'s mirrored query. Numpy and PIL only; the
view count and bit layout are module constants that the stored hashes depend on
(:data:`VERSION`).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

VERSION = 2  # bump when the hash changes: stored hashes of another version are recomputed
SIDE = 32  # pixels of the resized grayscale view (imagehash: hash_size x highfreq_factor)
LOW = 8  # the LOW x LOW lowest DCT frequencies are the bits
BITS = LOW * LOW
WORDS = BITS // 64  # uint64 words per hash
CROP_SCALES = (0.875, 0.9375)  # crop sides, as a fraction of the image's
CROP_STEP = 1 / 32  # crop positions every this fraction of the side, corner to corner
QUERIES = 2  # the view and its mirror


def _offsets(scale: float) -> tuple[float, ...]:
    """Where crops of this side sit, per axis, as a fraction of the room the image leaves: one
    every CROP_STEP of the side, both ends included (so a crop is within half a step of one)."""
    steps = max(1, round((1.0 - scale) / CROP_STEP))
    return tuple(k / steps for k in range(steps + 1))


CROPS = tuple((scale, _offsets(scale)) for scale in CROP_SCALES)  # (side, positions per axis)
VIEWS = 1 + sum(len(pos) ** 2 for _, pos in CROPS)  # index hashes: the whole image, then the crops
WORK_SIDE = 4 * SIDE  # crops are cut from a copy at most this large (the whole view is not)
BLOCK = 256  # images whose views are held at once: 256 x 36 x 32 x 32 float64, ~75 MB
DEFAULT_DISTANCE = 2  # bits; docs/data.md, "Perceptual de-duplication", says how it was chosen
DECONTAMINATE_DISTANCE = DEFAULT_DISTANCE + 2  # one step looser: a missed test image costs more

_n = np.arange(SIDE)
# DCT-II basis (scipy.fftpack's unnormalised type II up to a factor 2, which no median comparison sees)
_BASIS = np.cos(np.pi * np.arange(LOW)[:, None] * (2 * _n[None, :] + 1) / (2 * SIDE))  # (LOW, SIDE)


def check_distance(distance) -> int:
    """A Hamming threshold in 0..BITS-1 as an int; a ValueError naming the range otherwise."""
    try:
        value = int(distance)
    except (TypeError, ValueError):
        raise ValueError(f"a perceptual distance is a number of bits, got {distance!r}") from None
    if value != distance or not 0 <= value < BITS:
        raise ValueError(
            f"a perceptual distance must be a whole number of bits in 0..{BITS - 1} (of {BITS}), got {distance!r}"
        )
    return value


def _bits(pixels: np.ndarray) -> np.ndarray:
    """(M, SIDE, SIDE) grayscale -> (M, WORDS) uint64 pHash; bit j is frequency (j // LOW, j % LOW)."""
    coeffs = (_BASIS @ pixels @ _BASIS.T).reshape(
        len(pixels), BITS
    )  # (M, 64): batched matmuls, not einsum's loop
    above = coeffs > np.median(coeffs, axis=1, keepdims=True)  # (M, 64)
    return np.packbits(above, axis=1, bitorder="little").view(np.uint64)  # (M, WORDS)


def _views(image) -> np.ndarray:
    """One PIL image -> (QUERIES + VIEWS - 1, SIDE, SIDE) float64 grayscale: whole, mirror, crops."""
    from PIL import Image

    gray = image.convert("L")
    lanczos = Image.Resampling.LANCZOS
    whole = gray.resize((SIDE, SIDE), lanczos)
    mirror = gray.transpose(Image.Transpose.FLIP_LEFT_RIGHT).resize((SIDE, SIDE), lanczos)
    w, h = gray.size
    if max(w, h) > WORK_SIDE:  # cutting crops from a large original costs its size each time
        f = WORK_SIDE / max(w, h)
        gray = gray.resize((max(1, round(w * f)), max(1, round(h * f))), lanczos)
        w, h = gray.size
    views = [whole, mirror]
    for scale, positions in CROPS:
        cw, ch = scale * w, scale * h
        for py in positions:
            for px in positions:
                left, top = px * (w - cw), py * (h - ch)
                views.append(gray.resize((SIDE, SIDE), lanczos, box=(left, top, left + cw, top + ch)))
    return np.stack([np.asarray(v, dtype=np.float64) for v in views])


def hash_images(images: Iterable) -> tuple[np.ndarray, np.ndarray]:
    """PIL images -> (n, QUERIES, WORDS) query hashes (the image, its mirror) and (n, VIEWS, WORDS)
    index hashes (the whole image, then its crops), uint64. The views are made and hashed
    :data:`BLOCK` images at a time, so memory stays one block's views whatever ``n``."""
    queries, indexes = [np.zeros((0, QUERIES, WORDS), np.uint64)], [np.zeros((0, VIEWS, WORDS), np.uint64)]
    block: list = []
    for image in [*images, None]:  # None: the end, hash what is left
        if image is not None:
            block.append(_views(image))
            if len(block) < BLOCK:
                continue
        if block:
            hashes = _bits(np.concatenate(block)).reshape(
                len(block), QUERIES + VIEWS - 1, WORDS
            )  # (b, 36, W)
            queries.append(hashes[:, :QUERIES])  # (b, 2, W): the whole image, its mirror
            indexes.append(np.concatenate([hashes[:, :1], hashes[:, QUERIES:]], axis=1))  # (b, VIEWS, W)
            block = []
    return np.concatenate(queries), np.concatenate(indexes)


def popcount(x: np.ndarray) -> np.ndarray:
    """Set bits of each uint64, summed over the last axis (the words of a hash)."""
    return np.bitwise_count(x).sum(axis=-1, dtype=np.int64)


def distances(
    query_a: np.ndarray, index_a: np.ndarray, query_b: np.ndarray, index_b: np.ndarray
) -> np.ndarray:
    """:func:`distance` of K pairs at once: (K, QUERIES, W), (K, VIEWS, W) each -> (K,) int64.
    Holds (K, QUERIES, VIEWS, W) XORs: callers with many pairs pass them a block at a time."""
    ab = popcount(query_a[:, :, None] ^ index_b[:, None]).min(axis=(1, 2))  # (K,)
    ba = popcount(query_b[:, :, None] ^ index_a[:, None]).min(axis=(1, 2))  # (K,)
    return np.minimum(ab, ba)


def distance(query_a: np.ndarray, index_a: np.ndarray, query_b: np.ndarray, index_b: np.ndarray) -> int:
    """Two images' perceptual distance in bits: the smallest Hamming distance between a query hash
    of one and an index hash of the other, either way round. (QUERIES, W), (VIEWS, W) each."""
    return int(distances(query_a[None], index_a[None], query_b[None], index_b[None])[0])
