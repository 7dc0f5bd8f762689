"""Zero-shot on a subset of the classes: held-out classes, a novel-class split.

A zero-shot task with ``classes`` scores only the images whose label is one of
``classes``, and only among those classes: the classifier keeps their columns, so a
model that never saw the names in training is not helped (or hurt) by the classes it
did see.  This is the held-out-classes accuracy of a model trained on the other
classes (``configs/finetune_cifar10_cpu.yaml``: pretrained on 5 CIFAR-10 classes,
scored on the other 5 before and after fine-tuning on all 10).  Labels are re-indexed
in the order of ``classes``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmalign.errors import UsageError


def class_subset(
    labels: torch.Tensor, classnames: Sequence[str], classes: Sequence[str], task: str = "zeroshot"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``labels`` (N,) indices into ``classnames`` -> (rows (N',), cols (K,), labels (N',) in 0..K-1).

    ``rows``: the images of ``classes``; ``cols``: their columns of a (N, C) score matrix
    (or of a (D, C) classifier), in the order of ``classes``.
    """
    index = {name: i for i, name in enumerate(classnames)}
    unknown = [c for c in classes if c not in index]
    if unknown or len(set(classes)) != len(classes) or not classes:
        raise UsageError(
            f"task {task!r}: key 'classes' must list distinct names of its classnames, got {list(classes)}"
        )
    cols = torch.tensor([index[c] for c in classes])  # (K,)
    remap = torch.full((len(classnames),), -1, dtype=torch.long)
    remap[cols] = torch.arange(len(cols))
    new = remap[labels]  # (N,): -1 for the images of other classes
    rows = torch.nonzero(new >= 0).flatten()  # (N',)
    return rows, cols, new[rows]
