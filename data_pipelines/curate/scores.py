"""The CLIP score of an image-text pair: the cosine of its two embeddings.

DataComp (Gadre et al. 2023) filters a pool by this score, computed with a trained CLIP
model on each sample's image and caption; see :mod:`data_pipelines.curate.threshold`.
"""

import numpy as np


def _unit_rows(x: np.ndarray) -> np.ndarray:
    """(N, D) -> (N, D) float64 rows of unit norm; a zero row stays zero.

    Embeddings saved by different models (or before a projection's norm) need not be unit
    norm, so the score never trusts that they are. A zero row has no direction: dividing it
    by its norm would give NaN, so it is left at zero and every cosine with it is 0."""
    x = np.asarray(
        x, dtype=np.float64
    )  # (N, D): float64 so that the norm of a float32 row is exact to ~1e-16
    norm = np.linalg.norm(x, axis=1, keepdims=True)  # (N, 1)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


def clip_scores(image_emb: np.ndarray, text_emb: np.ndarray) -> np.ndarray:
    """Per-sample cosine of image i with text i: (N, D) x (N, D) -> (N,) float32.

    Inputs are re-normalised (not assumed unit norm); a zero vector on either side gives 0.
    Computed in float64, returned as float32 (4 bytes a sample: what a pool's scores are
    stored as, see :class:`~data_pipelines.curate.threshold.PoolQuantile`)."""
    image_emb = np.asarray(image_emb)
    text_emb = np.asarray(text_emb)
    if image_emb.ndim != 2 or image_emb.shape != text_emb.shape:
        raise ValueError(
            f"clip_scores needs two (N, D) arrays of one shape, "
            f"got image {image_emb.shape} and text {text_emb.shape}"
        )
    img = _unit_rows(image_emb)  # (N, D)
    txt = _unit_rows(text_emb)  # (N, D)
    # A row-wise dot product, not img @ txt.T: only the N matched pairs, not an (N, N) matrix.
    cos = np.einsum("nd,nd->n", img, txt)  # (N,)
    # Rounding can push |cos| of a pair of equal vectors a few ulps past 1; a cosine cannot be.
    return np.clip(cos, -1.0, 1.0).astype(np.float32)
