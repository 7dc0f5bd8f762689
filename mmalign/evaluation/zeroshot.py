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

from mmalign.data.templates import check_templates

PROMPT_BATCH = 1024  # prompts per tokenizer-and-encoder call: whole classes share a call (the encoder may split it further)


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

    The C x T prompts are encoded together (:func:`encode_prompts`), not one class a call.
    :func:`mmalign.evaluation.sharded.build_classifiers` splits the same prompts over ranks.
    """
    texts = prompt_texts(classnames, templates)
    emb = encode_prompts(encode_text, tokenizer, texts, range(len(texts)), batch_size)  # (C T, D)
    return classifier_from_prompts(emb, len(classnames), len(templates))


def prompt_texts(classnames: Sequence[str], templates: Sequence[str]) -> list[str]:
    """The C x T prompts, class-major: prompt ``c T + t`` is template t over class c."""
    if not classnames or not templates:
        raise ValueError(
            f"a zero-shot classifier needs class names and templates, got {len(classnames)} "
            f"and {len(templates)}"
        )
    check_templates(list(templates), "zero-shot templates")  # one line naming the template, not a KeyError
    return [tpl.format(c=name) for name in classnames for tpl in templates]


@torch.no_grad()
def encode_prompts(
    encode_text: Callable[[torch.Tensor], torch.Tensor],
    tokenizer: Callable,
    texts: Sequence[str],
    rows: Sequence[int],
    batch_size: int = PROMPT_BATCH,
) -> torch.Tensor:
    """The normalised embeddings (len(rows), D) of ``texts[rows]``, in the order of ``rows``.

    Encoded ``batch_size`` at a time in order of token count, so a batch holds prompts of about
    one length and the text tower's trailing-pad trim (:mod:`mmalign.models.text_trim`) cuts the
    most; the order changes no value beyond float rounding (every prompt is its own row).
    """
    rows = list(rows)
    if not rows:  # a rank with no share (more ranks than prompts)
        return torch.zeros(0, 0)
    tokens = tokenizer([texts[i] for i in rows])  # (R, L)
    if isinstance(tokens, torch.Tensor) and tokens.ndim == 2 and not tokens.is_floating_point():
        order = torch.argsort((tokens != 0).sum(dim=1), stable=True)  # by length (pad id 0)
    else:  # a tokenizer of another shape (a test's stand-in): keep the order
        order = torch.arange(len(rows))
    out: torch.Tensor | None = None
    for s in range(0, len(rows), batch_size):
        pick = order[s : s + batch_size]
        part = F.normalize(encode_text(tokens[pick]).float(), dim=-1)  # (b, D)
        if out is None:
            out = torch.empty(len(rows), part.shape[1])
        out[pick] = part
    assert out is not None  # rows is not empty
    return out


def classifier_from_prompts(emb: torch.Tensor, n_classes: int, n_templates: int) -> torch.Tensor:
    """(C T, D) normalised prompt embeddings, class-major -> W (D, C)."""
    weights = F.normalize(emb.view(n_classes, n_templates, -1).mean(dim=1), dim=-1)  # (C, D)
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
    """sklearn's ``balanced_accuracy_score``: the mean over the classes present in ``labels`` of
    their recall (a class only predicted has no recall and is left out, as sklearn leaves it).
    Computed here: importing sklearn costs ~1.5 s, a tenth of a CIFAR-10 evaluation."""
    import numpy as np

    labels, pred = np.asarray(labels, dtype=np.int64), np.asarray(pred, dtype=np.int64)
    n = int(max(labels.max(initial=0), pred.max(initial=0))) + 1
    counts = np.bincount(labels, minlength=n)  # (n,) images per true class
    hits = np.bincount(labels[pred == labels], minlength=n)  # (n,) of them predicted right
    present = counts > 0
    return float(np.mean(hits[present] / counts[present]))
