"""Contrastive loss kernels for CLIP-style pretraining (pure functions; the objective
that combines them per run is :mod:`mmalign.objective`).

Public API:

* :func:`clip_loss` - symmetric InfoNCE (CLIP), optional multi-positive
  targets (``positive_ids``) and tiling (``tile_size``, Inf-CL).
* :func:`siglip_loss` - SigLIP pairwise sigmoid loss, optionally tiled.
* :func:`caption_ids` - stable int64 ids for (normalised) captions.
* :func:`queue_clip_loss` / :class:`QueueEntries` - InfoNCE with a MoCo
  queue's entries as extra negatives (the queue's state: mmalign.objective.queue).
"""

from .infonce import clip_loss
from .positives import caption_ids
from .queue import QueueEntries, queue_clip_loss
from .siglip import siglip_loss

__all__ = [
    "clip_loss",
    "siglip_loss",
    "caption_ids",
    "queue_clip_loss",
    "QueueEntries",
]
