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
"""

from __future__ import annotations

import torch


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
