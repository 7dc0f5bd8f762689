"""SigLIP pairwise sigmoid loss (Zhai et al. 2023, arXiv 2303.15343).

``loss = -(1/B) sum_{i,j} log sigmoid(z_ij (scale x_i . y_j + bias))`` with
z = +1 on positives and -1 elsewhere, normalised by the number of image rows
as open_clip's ``SigLipLoss`` does. With ``positive_ids`` every pair with
equal ids is labelled positive (a multi-label sigmoid, no renormalisation
needed since pairs are independent).

Sharded: a rank scores its B local images against all W*B gathered texts and
divides by B, so the mean over ranks is the full-batch loss. (open_clip
instead passes texts around a ring; the sum it computes is the same.)
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from .positives import Positives
from .tiled_sigmoid import tiled_sigmoid_rows
from .tracks import full_matrix_tracks

__all__ = ["siglip_loss", "siglip_local"]


def siglip_local(
    image: Tensor,
    text_all: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    *,
    ids: Tensor | None = None,
    ids_all: Tensor | None = None,
    offset: int = 0,
    tile_size: int | None = None,
    track: bool = False,
) -> tuple[Tensor, Tensor]:
    """Local image rows (B, D) vs all texts (N, D); returns (loss, (3, B) tracks)."""
    pos = Positives(offset) if ids is None else Positives(offset, ids, ids_all)
    if tile_size:
        row_loss, tracks = tiled_sigmoid_rows(
            image, text_all, logit_scale, logit_bias, tile_size, positives=pos, track=track
        )
    else:
        logits = logit_scale.reshape(()) * image @ text_all.T + logit_bias.reshape(())  # (B, N)
        mask = pos.full_mask(logits.shape[0], logits.shape[1], logits.device)
        signs = mask.to(logits.dtype) * 2 - 1  # z_ij
        row_loss = -F.logsigmoid(signs * logits).sum(dim=1)
        tracks = full_matrix_tracks(logits, mask) if track else logits.new_empty(0)
    return row_loss.sum() / image.shape[0], tracks


def siglip_loss(
    image_features: Tensor,
    text_features: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    *,
    positive_ids: Tensor | None = None,
    tile_size: int | None = None,
) -> Tensor:
    """SigLIP loss ``-sum_ij log sigmoid(z_ij (scale x_i . y_j + b)) / B``.

    Args:
        image_features, text_features: (B, D), L2-normalised.
        logit_scale: multiplicative scale, already exponentiated ([] or [1]).
        logit_bias: additive bias b ([] or [1]).
        positive_ids: optional (B,) ids; equal ids are positives (z = +1).
        tile_size: stream t x t tiles with recomputation in backward.
    """
    if image_features.ndim != 2 or image_features.shape != text_features.shape:
        raise ValueError("expected two (B, D) feature tensors of the same shape")
    ids = None if positive_ids is None else positive_ids.to(image_features.device)
    loss, _ = siglip_local(
        image_features, text_features, logit_scale, logit_bias, ids=ids, ids_all=ids, tile_size=tile_size
    )
    return loss
