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
from typing import Any

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
