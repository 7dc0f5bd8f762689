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


PROMPT_BATCH = 1024  # prompts per text-tower call: whole classes share a call, so 80 templates are no small batch


@torch.no_grad()
def build_classifier(
    encode_text: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Callable,
    classnames: Sequence[str],
    templates: Sequence[str],
    batch_size: int = PROMPT_BATCH,
) -> torch.Tensor:
    """Returns W of shape (D, C): per class, the renormalised mean of its normalised template
    embeddings (clip_benchmark's ``zero_shot_classifier``).

    The C x T prompts are encoded together, ``batch_size`` at a time, in order of token count,
    so a batch holds prompts of about one length and the text tower's trailing-pad trim
    (:mod:`mmalign.models.text_trim`) cuts the most; the order changes no value beyond float
    rounding, since every prompt is encoded on its own row.
    """
    c, t = len(classnames), len(templates)
    if not c or not t:
        raise ValueError(f"a zero-shot classifier needs class names and templates, got {c} and {t}")
    texts = [tpl.format(c=name) for name in classnames for tpl in templates]  # (C T,) class-major
    tokens = tokenizer(texts)  # (C T, L)
    if isinstance(tokens, torch.Tensor) and tokens.ndim == 2 and tokens.dtype in (torch.int32, torch.int64):
        order = torch.argsort((tokens != 0).sum(dim=1), stable=True)  # by length (pad id 0)
    else:  # a tokenizer of another shape (a test's stand-in): keep the order
        order = torch.arange(len(texts))
    emb = torch.empty(0)
    for s in range(0, len(texts), batch_size):
        rows = order[s:s + batch_size]
        part = F.normalize(encode_text(tokens[rows]).float(), dim=-1)  # (b, D)
        if emb.numel() == 0:
            emb = torch.empty(len(texts), part.shape[1])
        emb[rows] = part
    weights = F.normalize(emb.view(c, t, -1).mean(dim=1), dim=-1)  # (C, D)
    return weights.t().contiguous()  # (D, C)


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
