"""The DataComp CLIP-score filter: keep the pool's top fraction by CLIP score.

DataComp (Gadre et al. 2023) ranks a whole pool by the CLIP image-text cosine of each sample
and keeps the top 30% as its standard baseline (with an absolute minimum score as a variant).
The threshold is a quantile of the *whole* pool, not of each shard: a per-shard top 30% would
keep 30% of a bad shard too. :class:`PoolQuantile` gets the pool's quantile when the scores
come one shard at a time; the selection is then a second pass with a fixed threshold.
"""

import numpy as np


def _checked_fraction(keep_fraction) -> float:
    f = float(keep_fraction)
    # `not (0 < f <= 1)` and not `f <= 0 or f > 1`: the latter lets NaN through.
    if not (0.0 < f <= 1.0):
        raise ValueError(
            f"--keep-fraction must be in (0, 1] (the fraction of the pool kept), got {keep_fraction!r}"
        )
    return f


def _checked_scores(scores) -> np.ndarray:
    scores = np.asarray(scores)  # (N,)
    if scores.ndim != 1:
        raise ValueError(f"scores must be one score a sample, shape (N,), got {scores.shape}")
    if scores.size == 0:
        raise ValueError("the pool is empty: no scores to take a threshold over")
    # A NaN score (a broken embedding) would make the quantile NaN, and `>= NaN` keeps nothing.
    if not np.isfinite(scores).all():
        raise ValueError(f"{int((~np.isfinite(scores)).sum())} of {scores.size} scores are not finite")
    return scores


def keep_threshold(scores, keep_fraction: float) -> float:
    """The score t such that keeping ``scores >= t`` keeps the top ``keep_fraction`` of the pool.

    Defined as ``numpy.quantile(scores, 1 - keep_fraction)`` (linear interpolation), exactly:
    1.0 gives the minimum (keep all), a tiny fraction a value near the maximum. With ties or
    an interpolated t the kept count is within one sample of ``keep_fraction * N`` (more with
    ties at t, which are all kept)."""
    f = _checked_fraction(keep_fraction)
    return float(np.quantile(_checked_scores(scores), 1.0 - f))


class PoolQuantile:
    """Two-pass pool threshold for a pool that arrives in parts (one shard's scores at a time).

    Pass 1: ``add(part_scores)`` for every part; ``threshold(f)`` then equals
    ``keep_threshold(concatenation of the parts as float32, f)``. Pass 2: the caller re-reads
    each part and keeps ``select(part, threshold=t)``.

    Memory: the scores only, as float32, 4 bytes per sample (40 MB for 10M samples), not the
    embeddings. ``threshold`` joins the parts into one array once (a transient second copy,
    8 bytes per sample at the peak); later calls reuse it."""

    def __init__(self) -> None:
        self._parts: list[np.ndarray] = []  # each (n_i,) float32

    def add(self, part_scores) -> None:
        part = np.asarray(part_scores, dtype=np.float32).ravel()  # (n_i,): scores are stored float32
        # np.array(copy): a caller reusing its buffer for the next shard must not change this one.
        self._parts.append(np.array(part, copy=True))

    def __len__(self) -> int:
        return sum(p.size for p in self._parts)

    def threshold(self, keep_fraction: float) -> float:
        if len(self._parts) != 1:
            # np.concatenate of [] raises its own error; give the pool's instead.
            self._parts = [np.concatenate(self._parts) if self._parts else np.zeros(0, np.float32)]
        return keep_threshold(self._parts[0], keep_fraction)  # (N,) float32


def select(
    scores,
    clip_score_min: float | None = None,
    keep_fraction: float | None = None,
    threshold: float | None = None,
) -> np.ndarray:
    """(N,) scores -> (N,) bool mask of the samples kept.

    - ``clip_score_min``: keep ``score >= clip_score_min`` (an absolute CLIP-score floor).
    - ``keep_fraction``: keep the top fraction of *these* scores (they are the whole pool).
    - ``threshold``: keep ``score >= threshold``, a pool threshold computed before (a
      :class:`PoolQuantile`'s, when these scores are one part of the pool).

    Given together, the floor and the fraction are both required (logical and); the fraction's
    threshold is over the whole pool either way, not over what passes the floor. Nothing given
    keeps everything. ``keep_fraction`` and ``threshold`` are two spellings of one condition, so
    both at once is an error."""
    if keep_fraction is not None and threshold is not None:
        raise ValueError("give keep_fraction (of these scores) or threshold (of the pool), not both")
    scores = np.asarray(scores)
    if scores.ndim != 1:
        raise ValueError(f"scores must be one score a sample, shape (N,), got {scores.shape}")
    keep = np.ones(scores.shape, dtype=bool)  # (N,)
    if clip_score_min is not None:
        keep &= scores >= clip_score_min
    if keep_fraction is not None:
        threshold = keep_threshold(scores, keep_fraction)
    if threshold is not None:
        keep &= scores >= threshold
    return keep
