"""Probes: how much label information the image features hold, beyond zero-shot.

- Linear probe: multinomial logistic regression (scikit-learn, CPU) on the features,
  its inverse regularisation ``C`` chosen on a validation split from a sweep, then
  refitted on train + validation and scored on the held-out test split (the
  protocol of Radford et al. 2021, with sklearn in place of their L-BFGS code).
- kNN: cosine similarity to every training feature; majority vote of the k nearest;
  a tie goes to the tied class with the larger summed similarity.
- Few-shot: ``shots`` training images per class, classified by the nearest class
  prototype (the renormalised mean of its shots, as a zero-shot classifier is the
  mean of its prompts), averaged over ``episodes`` random draws.

Features are L2-normalised, either the joint-space embeddings or the pooled vision
features before the projection head (see :mod:`mmalign.evaluation.features`).
Splits are random and seeded: the same seed gives the same split on every run.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from mmalign.evaluation.zeroshot import classification_metrics
from mmalign.extras import extra

DEFAULT_CS = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)


def split_indices(n: int, fractions: Sequence[float], seed: int = 0) -> list[torch.Tensor]:
    """A seeded random partition of range(n) into len(fractions)+1 parts; the last gets the rest."""
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    parts, start = [], 0
    for frac in fractions:
        size = int(round(frac * n))
        parts.append(perm[start : start + size])
        start += size
    parts.append(perm[start:])
    return parts


def _logreg(c: float, seed: int):
    # sklearn (and scipy under it) is imported here, not at module level: it costs ~1.5 s of
    # start-up in every training process, most of which never fits a probe
    with extra("report", "a linear probe"):
        from sklearn.linear_model import LogisticRegression

    return LogisticRegression(C=c, max_iter=1000, random_state=seed)


def _scores(clf, x: torch.Tensor, n_classes: int) -> torch.Tensor:
    """Class scores (N, n_classes); classes absent from the training split score -inf."""
    out = torch.full((x.shape[0], n_classes), -math.inf, dtype=torch.float64)
    # log-probabilities are (N, fitted classes) even for two classes, unlike decision_function
    out[:, torch.as_tensor(clf.classes_)] = torch.from_numpy(clf.predict_log_proba(x.numpy())).double()
    return out


def linear_probe(
    train_x,
    train_y,
    val_x,
    val_y,
    test_x,
    test_y,
    n_classes: int,
    cs: Sequence[float] = DEFAULT_CS,
    seed: int = 0,
    say=None,
) -> dict:
    """Sweep ``cs`` on (train, val), refit the best on train+val, report test metrics.
    ``say(line)``, when given, hears of each fit (they can take minutes)."""
    sweep = {}
    with warnings.catch_warnings():
        with extra("report", "a linear probe"):
            from sklearn.exceptions import ConvergenceWarning

        warnings.simplefilter("ignore", ConvergenceWarning)  # the sweep's strongest C may not converge
        for i, c in enumerate(cs):
            if say is not None:
                say(f"linear probe: fitting C={c:g} ({i + 1}/{len(cs)}) on {len(train_y)} samples")
            clf = _logreg(c, seed).fit(train_x.numpy(), train_y.numpy())
            sweep[float(c)] = float((clf.predict(val_x.numpy()) == val_y.numpy()).mean())
        best = max(sweep, key=lambda c: (sweep[c], -c))  # ties: the stronger regularisation
        clf = _logreg(best, seed).fit(
            torch.cat([train_x, val_x]).numpy(), torch.cat([train_y, val_y]).numpy()
        )
    metrics = classification_metrics(_scores(clf, test_x, n_classes), test_y)
    metrics["best_C"] = best
    metrics["val_acc1_by_C"] = {str(c): a for c, a in sweep.items()}
    return metrics


def knn_scores(
    train_x: torch.Tensor, train_y: torch.Tensor, test_x: torch.Tensor, k: int, n_classes: int
) -> torch.Tensor:
    """(N_test, C) votes of the k nearest training features, plus their summed similarity / (k+1)
    as a tie-break below one vote."""
    sims = test_x @ train_x.T  # (Nt, Ntr)
    top = sims.topk(min(k, train_x.shape[0]), dim=1)
    labels = train_y[top.indices]  # (Nt, k)
    votes = torch.zeros(test_x.shape[0], n_classes, dtype=torch.float64)
    votes.scatter_add_(1, labels, torch.ones_like(labels, dtype=torch.float64))
    strength = torch.zeros_like(votes).scatter_add_(1, labels, top.values.double())
    return votes + strength / (k + 1)  # |strength| <= k, so this never outweighs a vote


def few_shot(
    train_x, train_y, test_x, test_y, n_classes: int, shots: int, episodes: int = 5, seed: int = 0
) -> dict:
    """Nearest-prototype accuracy with ``shots`` examples per class, mean and std over episodes."""
    g = torch.Generator().manual_seed(seed)
    accs, recalls = [], []
    for _ in range(episodes):
        protos = torch.zeros(n_classes, train_x.shape[1])
        present = torch.zeros(n_classes, dtype=torch.bool)
        for c in range(n_classes):
            idx = (train_y == c).nonzero()[:, 0]
            if len(idx) == 0:
                continue
            pick = idx[torch.randperm(len(idx), generator=g)[:shots]]
            protos[c] = F.normalize(train_x[pick].mean(dim=0), dim=0)
            present[c] = True
        scores = (test_x @ protos.T).double()  # (N, C)
        scores[:, ~present] = -math.inf
        m = classification_metrics(scores, test_y)
        accs.append(m["acc1"])
        recalls.append(m["mean_per_class_recall"])
    return {
        "acc1": float(np.mean(accs)),
        "acc1_std": float(np.std(accs)),
        "mean_per_class_recall": float(np.mean(recalls)),
        "shots": shots,
        "episodes": episodes,
    }


def run_probes(features: torch.Tensor, labels: torch.Tensor, n_classes: int, task: dict, say=None) -> dict:
    """One suite ``probe`` task: linear, kNN and few-shot on one seeded train/val/test split.

    task keys: ``val_fraction`` (0.2), ``test_fraction`` (0.3), ``seed`` (0), ``Cs``,
    ``knn_k`` ([1, 5, 20]), ``shots`` ([1, 5]), ``episodes`` (5),
    ``methods`` (default all of linear, knn, fewshot). ``say(line)``: progress, when given.
    """
    seed = int(task.get("seed", 0))
    test_idx, val_idx, train_idx = split_indices(
        len(labels), [task.get("test_fraction", 0.3), task.get("val_fraction", 0.2)], seed
    )
    x = F.normalize(features.float(), dim=-1)
    tr, va, te = (
        (x[train_idx], labels[train_idx]),
        (x[val_idx], labels[val_idx]),
        (x[test_idx], labels[test_idx]),
    )
    methods = task.get("methods", ["linear", "knn", "fewshot"])
    metrics: dict = {"n_train": len(train_idx), "n_val": len(val_idx), "n_test": len(test_idx)}
    if "linear" in methods:
        lin = linear_probe(*tr, *va, *te, n_classes, task.get("Cs", DEFAULT_CS), seed, say=say)
        metrics.update({f"linear_{k}": v for k, v in lin.items()})
    # kNN and few-shot have no hyper-parameter to tune: they use train + val as their pool
    pool_x, pool_y = torch.cat([tr[0], va[0]]), torch.cat([tr[1], va[1]])
    if "knn" in methods:
        if say is not None:
            say("kNN probes")
        for k in task.get("knn_k", [1, 5, 20]):
            m = classification_metrics(knn_scores(pool_x, pool_y, te[0], int(k), n_classes), te[1])
            metrics.update({f"knn{k}_{name}": v for name, v in m.items()})
    if "fewshot" in methods:
        if say is not None:
            say("few-shot probes")
        for shots in task.get("shots", [1, 5]):
            m = few_shot(pool_x, pool_y, *te, n_classes, int(shots), int(task.get("episodes", 5)), seed)
            metrics.update(
                {f"fewshot{shots}_{name}": m[name] for name in ("acc1", "acc1_std", "mean_per_class_recall")}
            )
    return metrics
