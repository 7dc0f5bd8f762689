"""FLIP patch dropout: Li, Fan, Hu, Feichtenhofer & He 2023, "Scaling Language-Image
Pre-training via Masking".

In training, a ViT image tower keeps a random subset of ``1 - p`` of its patch tokens per
sample (the class token always stays) and encodes only those: the transformer's cost falls
about in proportion.  open_clip's ``PatchDropout`` does the masking, in train mode only, so
evaluation, the probe and every export see all patches.  The paper ends with a short
"unmasked tuning" phase; ``train.unmasked_steps: K`` runs the last K steps with ``p = 0``.

The masks are drawn from torch's global generator (open_clip draws them on the CPU), which
the loop seeds per rank (masks differ by rank) and the gradient cache records per chunk
(masks differ by chunk and its re-forward replays them exactly).  The saved architecture
(``final/``, exports) does not carry ``p``: the module is added after the towers are built.
"""

from __future__ import annotations

from open_clip.transformer import PatchDropout, VisionTransformer
from torch import nn

from mmalign.errors import ConfigError


def add_patch_dropout(model: nn.Module, prob: float) -> None:
    """Give ``model.visual`` (an open_clip ViT) a PatchDropout of ``prob``; any other image
    tower (ResNet, timm) is a one-line ConfigError: it has no patch tokens to drop here."""
    visual = model.visual
    if not isinstance(visual, VisionTransformer):
        raise ConfigError(f"config key 'model.patch_dropout': needs an open_clip ViT image tower, "
                          f"the {type(visual).__name__} tower has no patch tokens to drop")
    visual.patch_dropout = PatchDropout(prob)  # exclude_first_token: the class token is always kept


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
