"""Recall@k in both directions, as clip_benchmark 1.6 defines it, in bounded memory.

``scores = text @ image.T`` on normalised embeddings.
- ``image_retrieval_recall@k`` is text->image: a caption hits when its image is in
  its top-k images; averaged over captions.
- ``text_retrieval_recall@k`` is image->text: an image hits when ANY of its
  captions is in its top-k captions; averaged over images.
Scores are computed a block of queries at a time, so the full (captions x images)
matrix is never held: memory is O(block x candidates).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _block_rows(n_candidates: int, budget_elems: int = 1 << 24) -> int:
    return max(1, budget_elems // max(1, n_candidates))


@torch.no_grad()
def recall_at_k(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor,
    ks: Sequence[int] = (1, 5, 10),
    budget_elems: int = 1 << 24,
) -> dict:
    """``image_features`` (N, D), ``text_features`` (M, D), ``text_to_image`` (M,) long."""
    image_features = image_features.float()
    text_features = text_features.float()
    n_img, n_txt = image_features.shape[0], text_features.shape[0]
    kmax = max(ks)
    metrics: dict[str, float] = {}

    # text -> image
    hits = {k: 0 for k in ks}
    step = _block_rows(n_img, budget_elems)
    for start in range(0, n_txt, step):
        scores = text_features[start : start + step] @ image_features.T  # (b, N)
        top = scores.topk(min(kmax, n_img), dim=1).indices  # (b, k)
        match = top == text_to_image[start : start + step, None]  # (b, k)
        for k in ks:
            hits[k] += match[:, :k].any(dim=1).sum().item()
    for k in ks:
        metrics[f"image_retrieval_recall@{k}"] = hits[k] / n_txt

    # image -> text: any of the image's captions in its top-k
    hits = {k: 0 for k in ks}
    step = _block_rows(n_txt, budget_elems)
    for start in range(0, n_img, step):
        scores = image_features[start : start + step] @ text_features.T  # (b, M)
        top = scores.topk(min(kmax, n_txt), dim=1).indices  # (b, k)
        owner = text_to_image[top]  # (b, k): which image each retrieved caption belongs to
        rows = torch.arange(start, start + scores.shape[0])[:, None]
        match = owner == rows
        for k in ks:
            hits[k] += match[:, :k].any(dim=1).sum().item()
    for k in ks:
        metrics[f"text_retrieval_recall@{k}"] = hits[k] / n_img
    return metrics
