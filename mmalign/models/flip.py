"""FLIP patch dropout: Li, Fan, Hu, Feichtenhofer & He 2023, "Scaling Language-Image
Pre-training via Masking".

In training, a ViT image tower keeps a random subset of ``1 - p`` of its patch tokens per
sample (the class token always stays) and encodes only those: the transformer's cost falls
about in proportion.  open_clip's ``PatchDropout`` does the masking, in train mode only, so
evaluation, the probe and every export see all patches.  The paper ends with a short
"unmasked tuning" phase; ``train.unmasked_steps: K`` runs the last K steps with ``p = 0``.

Each sample's mask is drawn from its own seed (``Batch.seeds``: (run seed, epoch, sample key),
mmalign/data/seeds.py), not from a rank's generator: which rank or gradient-cache chunk
encodes a sample changes nothing, and a chunk's re-forward draws the same mask again
(issue 30).  The scores are drawn on the CPU, as open_clip does, one small generator per
row.  Without seeds (a caller that passes none) the mask comes from torch's global generator,
as in open_clip.  The saved architecture (``final/``, exports) does not carry ``p``: the
module is added after the towers are built.
"""

from __future__ import annotations

import contextlib

import torch
from open_clip.transformer import PatchDropout, VisionTransformer
from torch import nn

from mmalign.errors import ConfigError

VIEW2 = 0x5DEECE66D  # a second view's rows draw from their seed xor this (another mask than the first view's)


class SeededPatchDropout(PatchDropout):
    """open_clip's PatchDropout (the class token always kept, the rest kept by the top
    ``1 - p`` of random scores), with each row's scores drawn from that row's seed."""

    def __init__(self, prob: float):
        super().__init__(prob, exclude_first_token=True)
        self.row_seeds: list[int] | None = None  # set around an image encode (:func:`seeded`)

    # Not traced by torch.compile: the seeds are new host values every step (a traced read of them
    # would recompile each step), and the scores come from host-side generators.
    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, 1 + P, W)
        if not self.training or self.prob == 0.0 or self.row_seeds is None:
            return super().forward(x)
        if len(self.row_seeds) != x.shape[0]:
            raise ValueError(f"patch dropout: {len(self.row_seeds)} seeds for {x.shape[0]} rows")
        cls_tokens, patches = x[:, :1], x[:, 1:]  # (B, 1, W), (B, P, W)
        n = patches.shape[1]
        index = kept_patches(tuple(self.row_seeds), n, max(1, int(n * (1 - self.prob)))).to(
            x.device
        )  # (B, K)
        kept = patches.gather(1, index[..., None].expand(-1, -1, patches.shape[-1]))  # (B, K, W)
        return torch.cat([cls_tokens, kept], dim=1)  # (B, 1 + K, W)


def kept_patches(seeds: tuple[int, ...], patches: int, keep: int) -> torch.Tensor:
    """Per row, the ``keep`` patch indices with the highest scores its seed draws: (B, K) on the CPU."""
    scores = torch.stack(
        [torch.rand(patches, generator=torch.Generator().manual_seed(int(s))) for s in seeds]
    )  # (B, P)
    return scores.topk(keep, dim=-1).indices


@contextlib.contextmanager
def seeded(tower: nn.Module, seeds: list[int] | None):
    """Every SeededPatchDropout of ``tower`` draws row i's mask from ``seeds[i]`` inside."""
    modules = [m for m in tower.modules() if isinstance(m, SeededPatchDropout)]
    for m in modules:
        m.row_seeds = seeds
    try:
        yield
    finally:
        for m in modules:
            m.row_seeds = None


def add_patch_dropout(model: nn.Module, prob: float) -> None:
    """Give ``model.visual`` (an open_clip ViT) a PatchDropout of ``prob``; any other image
    tower (ResNet, timm) is a one-line ConfigError: it has no patch tokens to drop here."""
    visual = model.visual
    if not isinstance(visual, VisionTransformer):
        raise ConfigError(
            f"config key 'model.patch_dropout': needs an open_clip ViT image tower, "
            f"the {type(visual).__name__} tower has no patch tokens to drop"
        )
    visual.patch_dropout = SeededPatchDropout(prob)  # the class token is always kept


def set_patch_dropout(model: nn.Module, prob: float) -> int:
    """Set the drop fraction of every PatchDropout of ``model``; returns how many there are."""
    modules = [m for m in model.modules() if isinstance(m, PatchDropout)]
    for m in modules:
        m.prob = float(prob)
    return len(modules)


def patch_dropout_at(cfg, step: int) -> float:
    """The drop fraction of (1-based) ``step``: ``model.patch_dropout``, then 0 for the last
    ``train.unmasked_steps``.  A function of the step alone, so a resume agrees with it."""
    unmasked = step > cfg.train.steps - cfg.train.unmasked_steps
    return 0.0 if unmasked else float(cfg.model.patch_dropout)
