"""Embedding geometry diagnostics on L2-normalised features.

- Alignment (Wang & Isola 2020, "Understanding Contrastive Representation
  Learning through Alignment and Uniformity on the Hypersphere"):
  ``E ||f(x) - g(y)||^2`` over positive pairs, in [0, 4].
- Uniformity (same paper): ``log E exp(-2 ||f(x) - f(y)||^2)`` over distinct
  pairs of one modality, in [-4, 0]; lower is more uniform.  O(N^2), so it is
  computed on a subsample.
- Effective rank (Roy & Vetterli 2007): ``exp(H(p))`` with ``p_k = s_k / sum s``
  over the singular values ``s`` of the centred embeddings (singular values,
  not their squares).
- Modality gap (Liang et al. 2022, "Mind the Gap"): ``||mean(img) - mean(txt)||_2``.
- Per-dimension standard deviation: collapse drives it toward 0.
- Nearest-neighbour diversity: the fraction of items that are some item's nearest
  neighbour.  Collapse (or hubness) makes a few items everyone's neighbour.
- Positive vs negative similarity distributions: cosine of each caption with its
  own image against cosines of random non-matching (caption, image) pairs, and the
  probability that a positive outscores a negative (the ROC AUC of the cosine as a
  match detector).  The loss is one number; these show how the two masses separate.
"""

from __future__ import annotations

import torch

from mmalign.evaluation.retrieval import _block_rows


def per_dim_std(x: torch.Tensor) -> torch.Tensor:
    """(N, D) -> (D,) standard deviation of each dimension."""
    return x.float().std(dim=0)


def effective_rank(x: torch.Tensor) -> float:
    """Roy & Vetterli's effective rank of the centred (N, D) embeddings, from singular values."""
    x = x.float()
    if not torch.isfinite(x).all():
        return float("nan")
    s = torch.linalg.svdvals(x - x.mean(dim=0, keepdim=True))  # (min(N, D),)
    total = s.sum()
    if total <= 0:
        return 0.0
    p = s / total
    p = p[p > 0]
    return float(torch.exp(-(p * p.log()).sum()))


def alignment(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean squared distance between row-aligned positive pairs (N, D), (N, D)."""
    return float((a.float() - b.float()).pow(2).sum(dim=1).mean())


def uniformity(x: torch.Tensor, max_samples: int = 2048, generator: torch.Generator | None = None) -> float:
    """log E exp(-2 ||x_i - x_j||^2) over distinct pairs of a subsample."""
    x = x.float()
    if x.shape[0] > max_samples:
        idx = torch.randperm(x.shape[0], generator=generator)[:max_samples]
        x = x[idx]
    n = x.shape[0]
    sq = torch.cdist(x, x).pow(2)  # (n, n)
    off = ~torch.eye(n, dtype=torch.bool)
    return float(torch.logsumexp(-2 * sq[off], dim=0) - torch.log(torch.tensor(float(off.sum()))))


def modality_gap(image: torch.Tensor, text: torch.Tensor) -> float:
    return float((image.float().mean(dim=0) - text.float().mean(dim=0)).norm())


@torch.no_grad()
def nn_diversity(x: torch.Tensor, budget_elems: int = 1 << 24) -> float:
    """Distinct nearest neighbours / N for (N, D) normalised ``x`` (self excluded), in [1/N, 1]."""
    x = x.float()
    n = x.shape[0]
    if n < 2:
        return float("nan")
    nearest = torch.empty(n, dtype=torch.long)
    step = _block_rows(n, budget_elems)
    for start in range(0, n, step):
        sims = x[start : start + step] @ x.T  # (b, N)
        rows = torch.arange(sims.shape[0])
        sims[rows, rows + start] = -torch.inf  # not one's own neighbour
        nearest[start : start + sims.shape[0]] = sims.argmax(dim=1)
    return nearest.unique().numel() / n


@torch.no_grad()
def similarity_samples(
    image: torch.Tensor,
    text: torch.Tensor,
    text_to_image: torch.Tensor,
    n_negatives: int = 20000,
    generator: torch.Generator | None = None,
) -> dict:
    """Cosines of every (caption, own image) pair and of random (caption, other image) pairs.

    ``image`` (N, D), ``text`` (M, D), ``text_to_image`` (M,).  Returns
    ``{"positive": (M,), "negative": (<= n_negatives,)}``.
    """
    image, text, owner = image.float(), text.float(), text_to_image.long()
    positive = (text * image[owner]).sum(dim=1)  # (M,)
    t = torch.randint(0, text.shape[0], (n_negatives,), generator=generator)
    i = torch.randint(0, image.shape[0], (n_negatives,), generator=generator)
    keep = i != owner[t]  # drop the draws that hit a positive pair
    negative = (text[t[keep]] * image[i[keep]]).sum(dim=1)
    return {"positive": positive, "negative": negative}


def positive_negative_auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """P(pos > neg) + P(pos == neg)/2 over all pairs of the two samples (Mann-Whitney U / (n m))."""
    pooled = torch.cat([positive, negative]).double()
    # average ranks for ties, 1-based
    order = pooled.argsort()
    ranks = torch.empty_like(pooled)
    ranks[order] = torch.arange(1, len(pooled) + 1, dtype=torch.float64)
    uniq, inverse = pooled.unique(return_inverse=True)
    mean_rank = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inverse, ranks)
    mean_rank /= torch.bincount(inverse, minlength=len(uniq)).double()
    n_pos, n_neg = len(positive), len(negative)
    u = mean_rank[inverse[:n_pos]].sum() - n_pos * (n_pos + 1) / 2
    return float(u / (n_pos * n_neg))


def _summary(x: torch.Tensor) -> dict:
    q = torch.quantile(x.double(), torch.tensor([0.05, 0.5, 0.95], dtype=torch.float64))
    return {
        "mean": float(x.mean()),
        "std": float(x.std()) if len(x) > 1 else 0.0,
        "p05": float(q[0]),
        "p50": float(q[1]),
        "p95": float(q[2]),
    }


def embedding_diagnostics(
    image: torch.Tensor,
    text: torch.Tensor,
    text_to_image: torch.Tensor,
    max_samples: int = 2048,
    seed: int = 0,
) -> dict:
    """Every diagnostic above on one set of paired embeddings, as a flat dict of floats.

    Alignment pairs each caption with its own image.  Uniformity is per modality on a
    ``max_samples`` subsample.  Effective rank uses singular values (not squared).
    """
    g = torch.Generator().manual_seed(seed)
    owner = text_to_image.long()
    sims = similarity_samples(image, text, owner, generator=g)
    out = {
        "alignment": alignment(text, image[owner]),
        "uniformity_image": uniformity(image, max_samples, g),
        "uniformity_text": uniformity(text, max_samples, g),
        "effective_rank_image": effective_rank(image),
        "effective_rank_text": effective_rank(text),
        "dim_std_mean_image": float(per_dim_std(image).mean()),
        "dim_std_min_image": float(per_dim_std(image).min()),
        "dim_std_mean_text": float(per_dim_std(text).mean()),
        "dim_std_min_text": float(per_dim_std(text).min()),
        "modality_gap": modality_gap(image, text),
        "nn_diversity_image": nn_diversity(image),
        "nn_diversity_text": nn_diversity(text),
        "positive_negative_auc": positive_negative_auc(sims["positive"], sims["negative"]),
    }
    for name in ("positive", "negative"):
        out.update({f"{name}_similarity_{k}": v for k, v in _summary(sims[name]).items()})
    return out
