"""NT-Xent between two augmented views of the same images (SimCLR / SLIP).

SimCLR (Chen et al. 2020, "A Simple Framework for Contrastive Learning of
Visual Representations", arXiv 2002.05709) and SLIP (Mu et al. 2021, "SLIP:
Self-supervision meets Language-Image Pre-training", arXiv 2112.12750, which
adds it to CLIP's loss with a weight) treat two augmentations of one image as
a positive pair, so the augmentations declare the invariances.

With z = [z1; z2] (2B, D), L2-normalised, and ``l_ab = s z_a . z_b``
(s = 1/tau; SimCLR / SLIP use tau = 0.1), anchor a's positive is its other
view p(a) = a +- B and its candidates are the 2B - 1 others (itself excluded):

    loss = (1 / 2B) sum_a [ LSE_{c != a} l_ac - l_{a p(a)} ]

The self-exclusion is the masked LSE of :mod:`.hardneg` with the diagonal as
the "positive" set, so ``tile_size`` streams the 2B x 2B matrix (Inf-CL
tiles) with the same values and gradients. One process: the views of other
ranks are not gathered here.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .hardneg import masked_lse
from .positives import Positives

__all__ = ["ntxent_loss"]


def ntxent_loss(view1: Tensor, view2: Tensor, scale: float | Tensor = 10.0, *, tile_size: int | None = None) -> Tensor:
    """Symmetric NT-Xent of two (B, D) L2-normalised views; ``scale`` = 1/tau."""
    if view1.ndim != 2 or view1.shape != view2.shape:
        raise ValueError(f"expected two (B, D) views, got {tuple(view1.shape)} and {tuple(view2.shape)}")
    z = torch.cat([view1, view2])  # (2B, D)
    s = torch.as_tensor(scale, dtype=z.dtype, device=z.device).reshape(())
    # Positives(0) marks the diagonal (a, a): select="neg" drops exactly the self-similarity.
    lse, _ = masked_lse(z, z, s, Positives(0), "neg", tile_size, want_cols=False)  # (2B,)
    partner = torch.cat([view2, view1])  # (2B, D): row a's other view
    pos = s * torch.linalg.vecdot(z, partner)  # (2B,)
    return (lse - pos).mean()
