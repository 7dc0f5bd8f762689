"""Zero-shot classification, defined as clip_benchmark 1.6 defines it.

Classifier weights: for each class, embed every template, L2-normalise each
embedding, average, renormalise.  Logits are ``100 * image @ W``.  Metrics:
``acc1``, ``acc5`` (NaN with fewer than 5 classes) and ``mean_per_class_recall``
(sklearn's balanced accuracy).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F


@torch.no_grad()
def build_classifier(
    encode_text: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Callable,
    classnames: Sequence[str],
    templates: Sequence[str],
) -> torch.Tensor:
    """Returns W of shape (D, C)."""
    weights = []
    for name in classnames:
        texts = [t.format(c=name) for t in templates]
        emb = F.normalize(encode_text(tokenizer(texts)).float(), dim=-1)  # (T, D)
        weights.append(F.normalize(emb.mean(dim=0), dim=-1))  # (D,)
    return torch.stack(weights, dim=1)  # (D, C)


def topk_accuracy(logits: torch.Tensor, labels: torch.Tensor, k: int) -> float:
    if logits.shape[1] < k:
        return math.nan
    topk = logits.topk(k, dim=1).indices  # (N, k)
    return (topk == labels[:, None]).any(dim=1).float().mean().item()


def classification_metrics(scores: torch.Tensor, labels: torch.Tensor) -> dict:
    """``scores`` (N, C) of any classifier (zero-shot, probe, a slice) -> acc1, acc5, mean_per_class_recall."""
    pred = scores.argmax(dim=1)
    return {
        "acc1": topk_accuracy(scores, labels, 1),
        "acc5": topk_accuracy(scores, labels, 5),
        "mean_per_class_recall": float(_balanced_accuracy(labels.numpy(), pred.numpy())),
    }


def zero_shot_metrics(image_features: torch.Tensor, classifier: torch.Tensor, labels: torch.Tensor) -> dict:
    """``image_features`` (N, D) normalised, ``classifier`` (D, C), ``labels`` (N,)."""
    return classification_metrics(100.0 * image_features.float() @ classifier, labels)  # logits (N, C)


def _balanced_accuracy(labels, pred) -> float:
    from sklearn.metrics import balanced_accuracy_score  # lazily: sklearn costs ~1.5 s to import

    return balanced_accuracy_score(labels, pred)
