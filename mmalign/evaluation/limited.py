"""A suite on a sample of its images: ``mmalign eval --limit N`` and ``eval.during``'s ``limit``.

The N images are a seeded random draw stratified by the suite's first zero-shot label field
(see :mod:`mmalign.evaluation.datasets`), not the first N: shards of a class-sorted source
would give one class.  The draw is the same on every call and every rank (seed 0), so the
periodic evaluations of a run all score the same images.
"""

from __future__ import annotations

from mmalign.evaluation.suite import label_field


def limited_dataset(dataset, limit: int, stratify: str = "label") -> dict:
    """A suite's dataset entry with ``limit`` set (a shard-spec string becomes a mapping)."""
    spec = (
        {"type": "shards", "urls": dataset} if dataset is None or isinstance(dataset, str) else dict(dataset)
    )
    return {"stratify": stratify, **spec, "limit": limit}


def limited_suite(suite: dict, limit: int) -> dict:
    """A copy of ``suite`` whose dataset is a draw of ``limit`` images (the suite itself unchanged)."""
    return {**suite, "dataset": limited_dataset(suite.get("dataset"), limit, label_field(suite))}
