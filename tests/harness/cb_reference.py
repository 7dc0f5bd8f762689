"""Reference numbers for a clip_benchmark WebDataset folder, computed by clip_benchmark 1.6.2 itself.

Its own reader (``build_dataset("wds/...")``), its ``zero_shot_classifier`` +
``run_classification`` (logits; the metrics from them by definition: top-k by ``topk``,
mean per-class recall by sklearn, as DataComp's ``wds_eval`` does), and its
``zeroshot_retrieval.evaluate``.  ``amp=False``: on CPU its autocast would run the towers
in bfloat16.  Nothing here calls mmalign's evaluation code.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from clip_benchmark.datasets.builder import build_dataset
from clip_benchmark.metrics import zeroshot_classification as cb_zs
from clip_benchmark.metrics import zeroshot_retrieval as cb_ret
from sklearn.metrics import balanced_accuracy_score


def cb_loader(root: Path, transform, batch: int, task: str = "zeroshot_classification"):
    """(dataset, loader) as clip_benchmark's CLI builds them for a wds/ dataset."""
    ds = build_dataset(
        dataset_name=f"wds/{Path(root).name}",
        root=str(root),
        transform=transform,
        split="test",
        download=False,
        task=task,
    )
    return ds, torch.utils.data.DataLoader(ds.batched(batch), batch_size=None, shuffle=False, num_workers=0)


def topk_hits(logits: torch.Tensor, target: torch.Tensor, k: int) -> torch.Tensor:
    return (logits.topk(k, dim=1).indices == target[:, None]).any(dim=1)  # (N,)


def cb_logits(model, transform, tokenizer, root: Path, batch: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """clip_benchmark's zero-shot logits (N, C) and targets (N,) on the dataset in ``root``."""
    ds, loader = cb_loader(root, transform, batch)
    weights = cb_zs.zero_shot_classifier(model, tokenizer, ds.classes, ds.templates, "cpu", amp=False)
    return cb_zs.run_classification(model, weights, loader, "cpu", amp=False)


def cb_classification(model, transform, tokenizer, root: Path, batch: int = 16) -> dict:
    logits, target = cb_logits(model, transform, tokenizer, root, batch)
    return {
        "acc1": topk_hits(logits, target, 1).float().mean().item(),
        "acc5": topk_hits(logits, target, 5).float().mean().item() if logits.shape[1] >= 5 else math.nan,
        "mean_per_class_recall": float(balanced_accuracy_score(target.numpy(), logits.argmax(dim=1).numpy())),
    }


def cb_retrieval(model, transform, tokenizer, root: Path, batch: int = 16) -> dict:
    _, loader = cb_loader(root, transform, batch, task="zeroshot_retrieval")
    return cb_ret.evaluate(model, loader, tokenizer, "cpu", amp=False, recall_k_list=[1, 5, 10])
