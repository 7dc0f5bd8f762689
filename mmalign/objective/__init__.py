"""The objective of a training step: a list of terms over the model's Embeddings.

* :func:`build_objective` (``objective.py``): the run's objective from its config, the
  only run-time reader of ``cfg.loss.*``.
* Terms: :class:`Contrastive` (InfoNCE / SigLIP with its positives and estimators,
  ``contrastive.py``), :class:`QueueNegatives` (MoCo queue: its state and its term,
  ``queue.py``), :class:`MinedNegatives` and :class:`ImageImage` (``extras.py``).
* Which terms combine: one table, :mod:`mmalign.config.loss_rules` (the config checks it
  before any work; :func:`build_objective` again).

The maths live in :mod:`mmalign.losses` (pure kernels).  Attributes load lazily, so that
importing the package pulls in no torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names __getattr__ loads, spelled out for the type checker
    from .base import LossOutput as LossOutput
    from .base import StepContext as StepContext
    from .base import Term as Term
    from .base import TermOutput as TermOutput
    from .contrastive import LOSS_NAMES as LOSS_NAMES
    from .contrastive import Contrastive as Contrastive
    from .contrastive import PositiveSource as PositiveSource
    from .extras import ImageImage as ImageImage
    from .extras import MinedNegatives as MinedNegatives
    from .objective import Objective as Objective
    from .objective import build_objective as build_objective
    from .queue import FeatureQueue as FeatureQueue
    from .queue import MomentumQueue as MomentumQueue
    from .queue import QueueNegatives as QueueNegatives

_EXPORTS = {
    "Objective": "objective",
    "build_objective": "objective",
    "LossOutput": "base",
    "Term": "base",
    "TermOutput": "base",
    "StepContext": "base",
    "Contrastive": "contrastive",
    "PositiveSource": "contrastive",
    "LOSS_NAMES": "contrastive",
    "QueueNegatives": "queue",
    "MomentumQueue": "queue",
    "FeatureQueue": "queue",
    "MinedNegatives": "extras",
    "ImageImage": "extras",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
