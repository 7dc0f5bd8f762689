"""Recall@k in both directions, as clip_benchmark 1.6 defines it, in bounded memory.

``scores = text @ image.T`` on normalised embeddings.
- ``image_retrieval_recall@k`` is text->image: a caption hits when its image is in
  its top-k images; averaged over captions.
- ``text_retrieval_recall@k`` is image->text: an image hits when ANY of its
  captions is in its top-k captions; averaged over images.

One pass over blocks of captions serves both directions, so each score is computed
once and the full (captions x images) matrix is never held: memory is
O(block x images + kmax x images).

- text->image: a caption's rank is the number of images scoring strictly above its
  own image; it hits at k when that rank is < k.
- image->text: an image hits at k when one of its captions is in the top k, i.e.
  when fewer than k captions score strictly above its best own caption (every such
  caption belongs to another image).  Only the kmax highest caption scores per image
  are needed for that count, so a running top-kmax per image is kept.

Exact ties go to the query (a wrong candidate must score strictly higher to push the
right one out).  clip_benchmark's ``topk`` breaks ties in implementation order
instead; the two agree whenever no wrong candidate exactly ties a right one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _block_rows(n_candidates: int, budget_elems: int = 1 << 24) -> int:
    return max(1, budget_elems // max(1, n_candidates))


@torch.no_grad()
def retrieval_ranks(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor,
    kmax: int,
    budget_elems: int = 1 << 24,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ranks of the right answer, capped at ``kmax``: (text->image (M,), image->text (N,)).

    ``image_features`` (N, D), ``text_features`` (M, D), ``text_to_image`` (M,) long.
    A rank r means r wrong candidates score strictly higher; ``min(kmax, candidates)``
    means "that many or more" (enough to decide every k <= kmax).
    """
    image_features = image_features.float()
    text_features = text_features.float()
    text_to_image = text_to_image.long()
    n_img, n_txt = image_features.shape[0], text_features.shape[0]
    kmax = max(1, int(kmax))
    t2i_rank = torch.empty(n_txt, dtype=torch.long)
    best_own = torch.full((n_img,), -torch.inf)  # (N,) best score of an image's own captions
    k_img, k_txt = min(kmax, n_img), min(kmax, n_txt)
    top_rows = torch.full((n_img, k_txt), -torch.inf)  # (N, k) running top-k caption scores per image
    step = _block_rows(n_img, budget_elems)
    for start in range(0, n_txt, step):
        owner = text_to_image[start : start + step]  # (b,)
        scores = text_features[start : start + step] @ image_features.T  # (b, N)
        pos = scores.gather(1, owner[:, None])  # (b, 1): from the same matmul, so comparisons are exact
        # topk along the contiguous dim is ~3x cheaper than a full compare-and-count
        t2i_rank[start : start + len(owner)] = (scores.topk(k_img, dim=1).values > pos).sum(dim=1)
        best_own.scatter_reduce_(0, owner, pos[:, 0], reduce="amax")
        cols = scores.T.contiguous()  # (N, b); one copy makes the per-image topk contiguous too
        block_top = cols.topk(min(k_txt, cols.shape[1]), dim=1).values  # (N, <=k)
        top_rows = torch.cat([top_rows, block_top], dim=1).topk(k_txt, dim=1).values
    i2t_rank = (top_rows > best_own[:, None]).sum(dim=1)  # (N,) = min(k, true rank)
    return t2i_rank, i2t_rank


def recall_from_ranks(t2i_rank: torch.Tensor, i2t_rank: torch.Tensor, ks: Sequence[int]) -> dict:
    metrics: dict[str, float] = {}
    for k in ks:
        metrics[f"image_retrieval_recall@{k}"] = (t2i_rank < k).float().mean().item()
    for k in ks:
        metrics[f"text_retrieval_recall@{k}"] = (i2t_rank < k).float().mean().item()
    return metrics


@torch.no_grad()
def recall_at_k(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor,
    ks: Sequence[int] = (1, 5, 10),
    budget_elems: int = 1 << 24,
) -> dict:
    """``image_features`` (N, D), ``text_features`` (M, D), ``text_to_image`` (M,) long."""
    t2i, i2t = retrieval_ranks(image_features, text_features, text_to_image, max(ks), budget_elems)
    return recall_from_ranks(t2i, i2t, ks)
