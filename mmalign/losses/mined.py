"""Mined hard negatives: extra per-image text candidates in InfoNCE's image->text direction.

An offline nearest-neighbour pass (``mmalign mine``, :mod:`data_pipelines.mine`)
stores, per sample, the captions of other samples that a previous model scores
closest to its image (suspected false negatives above a similarity threshold
already dropped). The loader tokenizes up to k of them; the text tower embeds
them as ``neg_text_features`` (B, k, D) with a validity mask (B, k).

How they enter the loss (a choice, documented here and tested against a naive
loop): each image row i gets ITS OWN valid mined negatives n_i1..n_ik as extra
columns of its softmax, in the image->text direction only. With the in-batch
row LSE ``L_i = LSE_j s x_i . y_j`` (over all in-batch candidates, across
ranks when sharded) and ``N_i = LSE_{m valid} s x_i . n_im``:

    loss_i2t_i = LSE(L_i, N_i) - pos_i = L_i + softplus(N_i - L_i) - pos_i

so the mined negatives add ``0.5 * mean_i softplus(N_i - L_i)`` to the plain
symmetric loss (the 0.5 is the directions' average), exactly, and the in-batch
LSE needs no change (it may be tiled or sharded). A row without valid
negatives has ``N_i = -inf`` and adds 0. Per-row rather than all B k
negatives as shared columns: a mined negative is hard for the image it was
mined for, and the cost stays O(B k D) instead of O(B^2 k D). The
text->image direction is unchanged: a mined caption has no image of its own
in the batch. This is the "hard negatives from a retriever" recipe of dense
retrieval (Karpukhin et al. 2020, DPR, arXiv 2004.04906; Xiong et al. 2021,
ANCE, arXiv 2007.00808) applied to image->text; the false-negative guard is
the similarity-threshold filter of Moreira et al. 2024 (NV-Retriever,
arXiv 2407.15831).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["mined_lse", "mined_negatives_term"]

_NEG_INF = float("-inf")


def mined_lse(image: Tensor, neg_text: Tensor, neg_mask: Tensor, scale: Tensor) -> Tensor:
    """(B,) ``LSE_{m valid} scale * image_i . neg_text_im``; -inf (zero gradient) for rows without any."""
    if neg_text.ndim != 3 or neg_text.shape[0] != image.shape[0] or neg_text.shape[2] != image.shape[1]:
        raise ValueError(
            f"neg_text_features must be (B, k, D) for image features {tuple(image.shape)}, "
            f"got {tuple(neg_text.shape)}"
        )
    if neg_mask.shape != neg_text.shape[:2] or neg_mask.dtype != torch.bool:
        raise ValueError(f"neg_mask must be a {tuple(neg_text.shape[:2])} bool tensor")
    logits = scale.reshape(()) * torch.einsum("bd,bkd->bk", image, neg_text)  # (B, k)
    has = neg_mask.any(dim=1)  # (B,)
    # Rows without a valid negative: fill 0 instead of -inf so logsumexp's backward is not nan.
    filled = logits.masked_fill(~neg_mask, _NEG_INF).masked_fill(~has[:, None], 0.0)
    return torch.where(
        has, torch.logsumexp(filled, dim=1), torch.full_like(has, _NEG_INF, dtype=logits.dtype)
    )


def mined_negatives_term(
    image: Tensor, neg_text: Tensor, neg_mask: Tensor | None, scale: Tensor, lse_i2t: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The addition to the symmetric InfoNCE (module docstring) and its monitors.

    image: (B, D) local image rows; neg_text: (B, k, D); neg_mask: (B, k) bool
    (None: all valid);
    lse_i2t: (B,) the rows' in-batch image->text LSE, with its graph (the
    returned term depends on it). Stats: ``mined_neg_prob`` (mean softmax mass
    of the mined negatives in an image row) and ``mined_neg_valid`` (fraction of
    the B k slots holding a mined negative).
    """
    if neg_mask is None:
        neg_mask = torch.ones(neg_text.shape[:2], dtype=torch.bool, device=image.device)
    neg_mask = neg_mask.to(image.device)
    lse_neg = mined_lse(image, neg_text, neg_mask, scale)  # (B,)
    gap = lse_neg - lse_i2t  # (B,), -inf for rows without negatives
    term = 0.5 * F.softplus(gap).mean()
    with torch.no_grad():
        stats = {
            "mined_neg_prob": torch.sigmoid(gap.detach().float()).mean(),
            "mined_neg_valid": neg_mask.float().mean(),
        }
    return term, stats
