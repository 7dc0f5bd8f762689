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
  caption belongs to another image).  Only the kmax + 1 highest caption scores per
  image are needed for that count, so a running top-(kmax + 1) per image is kept.

Exact ties.  clip_benchmark takes ``torch.topk(row, k)`` of each score row (a
caption's scores over all images; an image's over all captions, a column of the
matrix) and asks whether a right candidate is among the k indices.  On CPU,
``topk`` is a ``std::partial_sort`` when 64 k <= row length, else a
``std::nth_element``, both on (value, index) pairs compared by value alone: which
of several equal scores straddling the k-th place are kept depends on the
algorithm and on where they sit in the row (not simply "lower index first"; e.g.
topk(zeros(10), 1) returns index 8).  So a query whose right candidate exactly ties
a wrong one within its top kmax + 1 (the running top keeps one more score so such a
tie is always seen) is decided by calling ``torch.topk`` on its full score row, for
each k, as clip_benchmark does: text->image rows are in the block at hand; the
columns of tied images are rebuilt by a second pass over the same caption blocks
(so the scores are the same numbers), in groups that fit the memory budget.  Every
other query is decided by its rank, which agrees with topk whenever nothing ties.
(Equal verdicts need equal scores: a BLAS may round a few-row block of the matmul
differently from the whole matrix in the last bit; quantised embeddings, whose
products are exact, agree under any blocking.)
:func:`retrieval_ranks` (the report's rank plots) keeps the strict ranks, in which
ties go to the query.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _block_rows(n_candidates: int, budget_elems: int = 1 << 24) -> int:
    return max(1, budget_elems // max(1, n_candidates))


@torch.no_grad()
def _scan(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor,
    kmax: int,
    budget_elems: int,
    ks: Sequence[int] = (),
) -> tuple:
    """One pass over caption blocks: strict ranks (t2i (M,), i2t (N,)), capped at ``kmax``;
    for each k in ``ks`` the clip_benchmark verdicts {k: (rows (r,), hits (r,))} of the
    captions whose own image ties a wrong one (decided by topk on their block row); and
    the (N,) bool mask of images whose best own caption ties another caption."""
    n_img, n_txt = image_features.shape[0], text_features.shape[0]
    t2i_rank = torch.empty(n_txt, dtype=torch.long)
    t2i_tied: dict[int, list] = {k: [] for k in ks}
    best_own = torch.full((n_img,), -torch.inf)  # (N,) best score of an image's own captions
    k_img, k_txt = min(kmax, n_img), min(kmax, n_txt)
    top_rows = torch.full((n_img, min(kmax + 1, n_txt)), -torch.inf)  # (N, k+1) running top caption scores
    for start, owner, scores in _blocks(image_features, text_features, text_to_image, budget_elems):
        pos = scores.gather(1, owner[:, None])  # (b, 1): from the same matmul, so comparisons are exact
        # topk along the contiguous dim is ~3x cheaper than a full compare-and-count
        top = scores.topk(min(kmax + 1, n_img), dim=1).values  # (b, k+1)
        rank = (top > pos).sum(dim=1).clamp(max=k_img)
        t2i_rank[start : start + len(owner)] = rank
        tied = ((top == pos).sum(dim=1) > 1) & (rank < k_img)  # (b,): a wrong image ties the own one
        if ks and bool(tied.any()):
            rows = tied.nonzero()[:, 0]
            own = torch.zeros(len(rows), n_img, dtype=torch.bool)
            own[torch.arange(len(rows)), owner[rows]] = True
            for k, hits in _topk_hits(scores[rows], own, ks).items():
                t2i_tied[k].append((start + rows, hits))
        best_own.scatter_reduce_(0, owner, pos[:, 0], reduce="amax")
        cols = scores.T.contiguous()  # (N, b); one copy makes the per-image topk contiguous too
        block_top = cols.topk(min(top_rows.shape[1], cols.shape[1]), dim=1).values  # (N, <=k+1)
        top_rows = torch.cat([top_rows, block_top], dim=1).topk(top_rows.shape[1], dim=1).values
    i2t_rank = (top_rows > best_own[:, None]).sum(dim=1).clamp(max=k_txt)  # (N,) = min(k, true rank)
    # best_own's value occurs once in the top for a lone own caption; more often, it ties another caption
    i2t_tied = ((top_rows == best_own[:, None]).sum(dim=1) > 1) & (i2t_rank < k_txt)
    fixes = {
        k: (torch.cat([r for r, _ in v]), torch.cat([h for _, h in v])) if v else None
        for k, v in t2i_tied.items()
    }
    return t2i_rank, i2t_rank, fixes, i2t_tied


def _blocks(
    image_features: torch.Tensor, text_features: torch.Tensor, text_to_image: torch.Tensor, budget_elems: int
):
    """(start, owners (b,), scores (b, N)) per block of captions, always the same blocks."""
    step = _block_rows(image_features.shape[0], budget_elems)
    for start in range(0, text_features.shape[0], step):
        yield (
            start,
            text_to_image[start : start + step],
            text_features[start : start + step] @ image_features.T,
        )


def _topk_hits(rows: torch.Tensor, right: torch.Tensor, ks: Sequence[int]) -> dict[int, torch.Tensor]:
    """clip_benchmark's verdict per k for full score rows (r, C): a right candidate
    (``right`` (r, C) bool) is among ``torch.topk(row, k)``'s indices; k >= C is a hit."""
    out = {}
    for k in ks:
        if k >= rows.shape[1]:
            out[k] = torch.ones(rows.shape[0], dtype=torch.bool)
        else:
            out[k] = right.gather(1, rows.topk(k, dim=1).indices).any(dim=1)
    return out


def _tied_images_hits(
    image_features: torch.Tensor,
    text_features: torch.Tensor,
    text_to_image: torch.Tensor,
    images: torch.Tensor,
    ks: Sequence[int],
    budget_elems: int,
) -> dict[int, torch.Tensor]:
    """clip_benchmark's image->text verdicts for ``images`` (T,): their full columns, rebuilt
    from the same caption blocks as the main pass, ``budget_elems // M`` images at a time."""
    n_txt = text_features.shape[0]
    group = _block_rows(n_txt, budget_elems)
    out: dict[int, list] = {k: [] for k in ks}
    for g0 in range(0, len(images), group):
        ids = images[g0 : g0 + group]  # (g,)
        cols = torch.empty(n_txt, len(ids))  # (M, g)
        for start, owner, scores in _blocks(image_features, text_features, text_to_image, budget_elems):
            cols[start : start + len(owner)] = scores[:, ids]
        right = text_to_image[None, :] == ids[:, None]  # (g, M) the image's own captions
        for k, hits in _topk_hits(cols.T.contiguous(), right, ks).items():
            out[k].append(hits)
    return {k: torch.cat(v) for k, v in out.items()}


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
    A rank r means r wrong candidates score strictly higher (ties go to the query);
    ``min(kmax, candidates)`` means "that many or more" (enough to decide every k <= kmax).
    """
    t2i, i2t, _, _ = _scan(
        image_features.float(), text_features.float(), text_to_image.long(), max(1, int(kmax)), budget_elems
    )
    return t2i, i2t


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
    """``image_features`` (N, D), ``text_features`` (M, D), ``text_to_image`` (M,) long;
    exact ties are broken as clip_benchmark's ``torch.topk`` breaks them (module docstring)."""
    img, txt, owner = image_features.float(), text_features.float(), text_to_image.long()
    ks = [int(k) for k in ks]
    t2i, i2t, t2i_fixes, i2t_tied = _scan(img, txt, owner, max(1, max(ks)), budget_elems, ks)
    tied_images = i2t_tied.nonzero()[:, 0]
    i2t_fixes = _tied_images_hits(img, txt, owner, tied_images, ks, budget_elems) if len(tied_images) else {}
    metrics: dict[str, float] = {}
    for k in ks:
        hits = t2i < k
        if t2i_fixes[k] is not None:
            rows, verdict = t2i_fixes[k]
            hits[rows] = verdict
        metrics[f"image_retrieval_recall@{k}"] = hits.float().mean().item()
    for k in ks:
        hits = i2t < k
        if k in i2t_fixes:
            hits[tied_images] = i2t_fixes[k]
        metrics[f"text_retrieval_recall@{k}"] = hits.float().mean().item()
    return metrics
