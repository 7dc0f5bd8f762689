"""Cache-sized pieces for inference on a CPU: how many images or captions one tower call
should take.

On a CPU a transformer tower's throughput falls as the batch grows past what the caches
hold: each block's MLP writes a (rows, 4 x width) activation, and once that no longer fits
in a few MiB every matmul streams it from memory.  Measured here (2 cores, fp32, inference):
the tiny ViT at 32 px (65 tokens, MLP 512) encodes ~1100 images/s in calls of 32 and ~700
at 256; its text tower ~4400 prompts/s in calls of 64 and ~3200 at 1024.  ViT-B-32 is flat
from 8 to 32 images a call and slower at 4.  So evaluation keeps its batch (what is read and
decoded at once) and splits each tower call into pieces whose MLP activation is about
:data:`CACHE_BYTES`, and never fewer than :data:`MIN_ITEMS` items.  Rows are independent at
inference, so a piece changes no value beyond float rounding.  On a GPU a call is not split.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["CACHE_BYTES", "MIN_ITEMS", "mlp_width", "image_tokens", "piece_size", "in_pieces"]

CACHE_BYTES = 4 << 20  # one MLP activation per piece (the measured optimum above: 32 tiny images)
MIN_ITEMS = 8  # below this the matmuls are too thin to pay for the calls (ViT-B-32 at 4: -17%)


def mlp_width(tower: nn.Module) -> int | None:
    """The hidden width of the tower's first transformer MLP (open_clip's ``mlp.c_fc``), or None."""
    for name, module in tower.named_modules():
        if name.endswith("c_fc") and isinstance(module, nn.Linear):
            return module.out_features
    return None


def image_tokens(visual: nn.Module) -> int | None:
    """Tokens per image of an open_clip ViT (patches + class token), or None for other towers."""
    grid = getattr(visual, "grid_size", None)
    if not isinstance(grid, (tuple, list)) or len(grid) != 2:
        return None
    return int(grid[0]) * int(grid[1]) + 1


def piece_size(tower: nn.Module, tokens_per_item: int | None, device: torch.device | str) -> int | None:
    """Items per tower call on ``device``: None (no split) on a GPU or for a tower we cannot size."""
    if torch.device(device).type != "cpu" or not tokens_per_item:
        return None
    width = mlp_width(tower)
    if not width:
        return None
    return max(MIN_ITEMS, CACHE_BYTES // (4 * width * tokens_per_item))  # float32 activation bytes


def in_pieces(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, size: int | None) -> torch.Tensor:
    """``fn(x)`` computed ``size`` rows at a time (at once when ``size`` is None or covers x)."""
    if size is None or len(x) <= size:
        return fn(x)
    return torch.cat([fn(x[s : s + size]) for s in range(0, len(x), size)])
