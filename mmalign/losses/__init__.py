"""Contrastive losses for CLIP-style pretraining.

Public API:

* :func:`clip_loss` - symmetric InfoNCE (CLIP), optional multi-positive
  targets (``positive_ids``) and tiling (``tile_size``, Inf-CL).
* :func:`siglip_loss` - SigLIP pairwise sigmoid loss, optionally tiled.
* :func:`caption_ids` - stable int64 ids for (normalised) captions.
* :func:`queue_clip_loss` / :class:`QueueEntries` - InfoNCE with a MoCo
  momentum queue's entries as extra negatives (the queue: mmalign.momentum).
* :class:`ContrastiveLoss` / :func:`build_loss` / :class:`LossOutput` - the
  config-built module that works across ranks and reports monitors.
"""

from .infonce import clip_loss
from .module import LOSS_NAMES, ContrastiveLoss, LossOutput, build_loss
from .positives import caption_ids
from .queue import QueueEntries, queue_clip_loss
from .siglip import siglip_loss

# Tile edge tuned with bench/loss.py on the 2-core CPU (docs/benchmarks.md):
# 1024-2048 are equally fast on a quiet machine; under load every tile op pays
# a thread-synchronisation cost, so fewer, larger tiles win, and 2048 is the
# largest that keeps B = 16384 under 1 GB peak RSS. On a GPU larger tiles
# (4096-8192) should amortise kernel launches better; not measured here.
DEFAULT_TILE_SIZE = 2048

__all__ = [
    "clip_loss",
    "siglip_loss",
    "caption_ids",
    "queue_clip_loss",
    "QueueEntries",
    "ContrastiveLoss",
    "LossOutput",
    "build_loss",
    "LOSS_NAMES",
    "DEFAULT_TILE_SIZE",
]
