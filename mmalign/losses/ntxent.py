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
tiles) with the same values and gradients.

**Sharded**: across W ranks the local anchors z = [z1; z2] (2B) are gathered
with :func:`mmalign.dist.distributed.all_gather_with_grad` into the 2WB candidates,
rank r's block at offset 2rB (so anchor a's excluded self is column 2rB + a,
a shifted diagonal); a rank averages over its local anchors, as
:mod:`mmalign.objective` does for InfoNCE, so the mean over ranks is the global NT-Xent
of the 2WB views and the data-parallel average gives its exact gradient.

**In the trainer** (:class:`mmalign.objective.extras.ImageImage`) the total loss is the
contrastive loss + ``loss.image_image_weight`` x NT-Xent at the fixed
temperature ``loss.image_image_temperature`` (SimCLR / SLIP use 0.1: a
fixed, low temperature, because the image-image logits of two views of one
image are near 1 and a learnt temperature would be a second, unanchored
scale next to CLIP's).
"""

from __future__ import annotations

import torch
from torch import Tensor

from mmalign.dist import distributed as mdist

from .hardneg import masked_lse
from .positives import Positives

__all__ = ["ntxent_loss"]


def ntxent_loss(
    view1: Tensor, view2: Tensor, scale: float | Tensor = 10.0, *, tile_size: int | None = None
) -> Tensor:
    """Symmetric NT-Xent of two (B, D) L2-normalised views; ``scale`` = 1/tau.

    In a process group of W > 1 ranks the candidates are every rank's views
    (gathered with gradient) and the result is this rank's anchors' mean; every
    rank must pass the same B.
    """
    if view1.ndim != 2 or view1.shape != view2.shape:
        raise ValueError(f"expected two (B, D) views, got {tuple(view1.shape)} and {tuple(view2.shape)}")
    z = torch.cat([view1, view2])  # (2B, D) local anchors
    s = torch.as_tensor(scale, dtype=z.dtype, device=z.device).reshape(())
    cols = mdist.all_gather_with_grad(z)  # (W 2B, D); this rank's anchors at 2 r B ..
    # Paired Positives(offset) marks (a, offset + a), the anchor itself: select="neg" drops
    # exactly the self-similarity.
    self_cols = Positives(mdist.get_rank() * z.shape[0])
    lse, _ = masked_lse(z, cols, s, self_cols, "neg", tile_size, want_cols=False)  # (2B,)
    partner = torch.cat([view2, view1])  # (2B, D): row a's other view
    pos: Tensor = s * torch.linalg.vecdot(z, partner)  # (2B,)
    return (lse - pos).mean()
