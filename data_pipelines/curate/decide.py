"""Pass 2 of ``mmalign curate``: the whole pool's per-shard results -> which samples are kept.

The policies (combinable; a sample is kept when every policy given keeps it):

- **score** (DataComp, Gadre et al. 2023): ``clip_score_min`` and/or ``keep_fraction``, whose
  threshold is the quantile of the *whole pool's* scores (:mod:`.threshold`), so a bad shard is
  not kept at the pool's rate;
- **exact**: equal image sha256 is one group, one member kept;
- **semantic** (SemDeDup, Abbas et al. 2023): groups of image embeddings with cosine > 1 - eps
  inside k-means clusters (:mod:`.dedupe`), one member kept;

where a group keeps its member of highest CLIP score (ties: the earliest in pool order).
With ``false_negative_field`` the groups drop nothing: each sample is labelled with its group
(the key of the member a dedupe would keep) for ``loss.false_negative_ids``.

Pool order is shard order (the ``--data`` list), then order in the shard: the decisions do not
depend on how many processes embedded the pool.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_pipelines.curate.dedupe import _join, exact_groups, group_report, keep_one_per_group, semantic_groups
from data_pipelines.curate.embed_pass import shard_files
from data_pipelines.curate.threshold import keep_threshold

SAMPLES_PER_CLUSTER = 5000  # the automatic k-means size: pairs compared grow with the cluster size squared
TRAIN_PER_CLUSTER = 256  # k-means training rows per centroid (FAISS warns under 39)


@dataclass(frozen=True)
class Policies:
    clip_score_min: float | None = None
    keep_fraction: float | None = None
    dedupe: tuple[str, ...] = ()  # "exact", "semantic"
    dedupe_eps: float = 0.05
    dedupe_clusters: int = 0  # 0 = ceil(N / SAMPLES_PER_CLUSTER)
    kmeans_sample: int = 0  # 0 = TRAIN_PER_CLUSTER x clusters
    false_negative_field: str | None = None
    seed: int = 0


@dataclass
class Pool:
    """Every readable sample of the pool, in pool order."""

    frame: object  # pandas DataFrame: embed_pass.COLUMNS + "shard" (its number)
    image: np.ndarray  # (N, D) float16, row i = frame row i
    stats: list[dict] = field(default_factory=list)  # per shard, embed_pass's u.json

    def __len__(self) -> int:
        return len(self.frame)


def load_pool(out: Path, n_shards: int) -> Pool:
    """Read pass 1's files of shards 0..n-1 (all must be done)."""
    import pandas as pd

    frames, images, stats = [], [], []
    for u in range(n_shards):
        files = shard_files(out, u)
        stats.append(json.loads(files["stats"].read_text()))
        frame = pd.read_parquet(files["parquet"])
        frame.insert(0, "shard", np.int32(u))
        img = np.load(files["image"], mmap_mode="r")  # (n_u, D)
        frames.append(frame)
        images.append(img[frame["image_emb_id"].to_numpy()] if len(frame) else img[:0])
    frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    dim = next((s["dim"] for s in stats), 0)
    image = np.concatenate(images).astype(np.float16) if images else np.zeros((0, dim), np.float16)
    return Pool(frame=frame, image=image, stats=stats)


@dataclass
class Decisions:
    keep: np.ndarray  # (N,) bool: the sample is in the output
    by_policy: dict[str, np.ndarray]  # policy name -> (N,) bool kept by that policy alone
    threshold: float | None  # the score a sample needs (max of the floor and the fraction's quantile)
    groups: dict[str, np.ndarray]  # "exact" / "semantic" / "combined" -> (N,) group id (root's pool index)
    group_field: list[str] | None  # per sample: the key its false-negative group is named by
    clusters: int | None = None
    info: dict = field(default_factory=dict)


def _join_groups(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Two groupings -> the groups of "a or b" (connected components), named by the smallest index."""
    index = np.arange(a.size, dtype=np.int64)
    lab = index.copy()
    _join(lab, index, a)  # every sample with its exact group's root ...
    _join(lab, index, b)  # ... and with its semantic group's
    return lab


def decide(pool: Pool, p: Policies) -> Decisions:
    n = len(pool)
    scores = pool.frame["clip_score"].to_numpy(np.float32) if n else np.zeros(0, np.float32)
    by_policy: dict[str, np.ndarray] = {}
    threshold = None
    if p.clip_score_min is not None or p.keep_fraction is not None:
        floor = -math.inf if p.clip_score_min is None else float(p.clip_score_min)
        quantile = -math.inf if p.keep_fraction is None else keep_threshold(scores, p.keep_fraction)
        threshold = max(floor, quantile)
        by_policy["clip_score"] = scores >= threshold
    groups: dict[str, np.ndarray] = {}
    info: dict = {}
    clusters = None
    if "exact" in p.dedupe:
        groups["exact"] = exact_groups(pool.frame["image_sha256"].tolist())
    if "semantic" in p.dedupe:
        clusters = p.dedupe_clusters or max(1, math.ceil(n / SAMPLES_PER_CLUSTER))
        clusters = min(clusters, n)
        train = min(p.kmeans_sample or TRAIN_PER_CLUSTER * clusters, n) if clusters > 1 else None
        groups["semantic"] = semantic_groups(pool.image, p.dedupe_eps, clusters, seed=p.seed, train_size=train)
        info["kmeans_train_rows"] = train or 0
    group_field = None
    if groups:
        combined = (_join_groups(groups["exact"], groups["semantic"]) if len(groups) == 2
                    else next(iter(groups.values())))
        groups["combined"] = combined
        for name in ("exact", "semantic"):
            if name in groups:
                info[f"{name}_groups"] = group_report(groups[name])
        if p.false_negative_field is None:
            for name in ("exact", "semantic"):
                if name in groups:
                    by_policy[name] = keep_one_per_group(groups[name], scores)
            by_policy["dedupe"] = keep_one_per_group(combined, scores)
        else:
            # the member a dedupe would keep names its group
            best = keep_one_per_group(combined, scores)
            name_of = np.empty(n, dtype=np.int64)
            name_of[combined[best]] = np.flatnonzero(best)
            keys = pool.frame["key"].tolist()
            group_field = [keys[name_of[g]] for g in combined.tolist()]
    keep = np.ones(n, dtype=bool)
    for name in ("clip_score", "dedupe"):
        if name in by_policy:
            keep &= by_policy[name]
    return Decisions(keep=keep, by_policy=by_policy, threshold=threshold, groups=groups, group_field=group_field,
                     clusters=clusters, info=info)
