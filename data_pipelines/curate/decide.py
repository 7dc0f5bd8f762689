"""Pass 2 of ``mmalign curate``: the whole pool's per-shard results -> which samples are kept.

The policies (combinable; a sample is kept when every policy given keeps it):

- **score** (DataComp, Gadre et al. 2023): ``clip_score_min`` and/or ``keep_fraction``, whose
  threshold is the quantile of the *whole pool's* scores (:mod:`.threshold`), so a bad shard is
  not kept at the pool's rate;
- **exact**: equal image sha256 is one group, its copy of highest CLIP score kept;
- **semantic** (SemDeDup, Abbas et al. 2023): inside k-means clusters of the image embeddings,
  samples visited best CLIP score first, each kept unless within eps (cosine > 1 - eps) of a
  sample already kept, whose group it joins (:mod:`.dedupe`: groups do not chain). With both,
  semantic runs on one kept copy per sha256, and an exact copy's group is its kept copy's;
- **perceptual**: the same greedy rule over the perceptual hashes (:mod:`mmalign.data.phash`):
  a sample joins a kept one within ``perceptual_distance`` bits (:func:`phash.distance`), no
  model needed. After exact, like semantic; with semantic too, one greedy pass over both
  detectors' pairs (a sample joins the first kept sample near it by either);

ties in score go to the earliest in pool order. A policy that would drop more than
``max_drop`` of the pool is refused before anything is written (:func:`check_drop`).
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
from typing import TYPE_CHECKING

import numpy as np

from data_pipelines.curate.dedupe import (
    cluster_labels,
    exact_groups,
    group_report,
    keep_one_per_group,
    nearest_similarity,
    semantic_groups,
)
from data_pipelines.curate.embed_pass import shard_files
from data_pipelines.curate.perceptual_policy import detector, distance_to_kept, pool_groups
from data_pipelines.curate.scores import _unit_rows
from data_pipelines.curate.threshold import keep_threshold
from mmalign.data import phash

if TYPE_CHECKING:
    import pandas as pd

    from data_pipelines.curate.decontaminate import Contamination

SAMPLES_PER_CLUSTER = 5000  # the automatic k-means size: pairs compared grow with the cluster size squared
SIMILARITY_BLOCK = (
    8192  # rows a block for the cosine with the kept member: 4 float64 copies of (b, D), ~128 MB at 512-d
)
NEAREST_SAMPLE = 20_000  # samples whose nearest neighbour the report's eps histogram shows
TRAIN_PER_CLUSTER = 256  # k-means training rows per centroid (FAISS warns under 39)


@dataclass(frozen=True)
class Policies:
    clip_score_min: float | None = None
    keep_fraction: float | None = None
    dedupe: tuple[str, ...] = ()  # "exact", "perceptual", "semantic"
    perceptual_distance: int = phash.DEFAULT_DISTANCE  # bits: a perceptual duplicate is within it
    dedupe_eps: float = 0.002  # safe with a weak model (docs/data.md, "Picking eps")
    dedupe_clusters: int = 0  # 0 = ceil(N / SAMPLES_PER_CLUSTER)
    kmeans_sample: int = 0  # 0 = TRAIN_PER_CLUSTER x clusters
    false_negative_field: str | None = None
    seed: int = 0
    max_drop: float = 0.5  # a guarded policy may drop at most this fraction of the pool ...
    force: bool = False  # ... unless forced
    decontaminate: tuple[str, ...] = ()  # evaluation sets whose near-duplicates are dropped (.decontaminate)
    decontaminate_distance: int | None = None  # bits; None: mmalign.evaluation.contamination.DEFAULT_DISTANCE

    def model_needed_by(self) -> list[str]:
        """The flags given that need a filter model (its scores or embeddings)."""
        flags = [
            ("--clip-score-min", self.clip_score_min is not None),
            ("--keep-fraction", self.keep_fraction is not None),
        ]
        return [f for f, given in flags if given] + (
            ["--dedupe semantic"] if "semantic" in self.dedupe else []
        )

    def needs_hashes(self) -> bool:
        """Whether a policy reads the pool's perceptual hashes (perceptual de-duplication, decontamination)."""
        return "perceptual" in self.dedupe or bool(self.decontaminate)


@dataclass
class Pool:
    """Every readable sample of the pool, in pool order."""

    frame: pd.DataFrame  # embed_pass.COLUMNS + "shard" (its number)
    image: np.ndarray  # (N, D) float16, row i = frame row i
    stats: list[dict] = field(default_factory=list)  # per shard, embed_pass's u.json
    phash: np.ndarray | None = (
        None  # (N, QUERIES + VIEWS, WORDS) uint64 perceptual hashes, if every shard has them
    )

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
    from data_pipelines.curate.hash_pass import load_hashes

    return Pool(frame=frame, image=image, stats=stats, phash=load_hashes(out, n_shards))


@dataclass
class Decisions:
    keep: np.ndarray  # (N,) bool: the sample is in the output
    by_policy: dict[str, np.ndarray]  # policy name -> (N,) bool kept by that policy alone
    threshold: float | None  # the score a sample needs (max of the floor and the fraction's quantile)
    groups: dict[
        str, np.ndarray
    ]  # "exact" / "semantic" / "combined" -> (N,) group id (its kept member's index)
    group_field: list[str] | None  # per sample: the key its false-negative group is named by
    clusters: int | None = None
    info: dict = field(default_factory=dict)
    similarity: np.ndarray | None = None  # (N,) cosine with its group's kept member (1 for a kept one)
    nearest: np.ndarray | None = None  # (N,) highest cosine with another sample of its k-means cluster
    distance: np.ndarray | None = None  # (N,) perceptual bits to its group's kept member (0 for a kept one)
    contamination: Contamination | None = None  # --decontaminate's matches


def decide(pool: Pool, p: Policies, contamination: Contamination | None = None) -> Decisions:
    """The policies applied to ``pool``; ``contamination``: ``--decontaminate``'s matches, dropped."""
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
    reps = np.arange(n)  # the samples semantic de-duplication compares: one per exact group when both run
    if "exact" in p.dedupe:
        first = exact_groups(pool.frame["image_sha256"].tolist())  # (N,) named by the first of each digest
        best = keep_one_per_group(first, scores)  # (N,) the copy of highest score (ties: the first)
        name_of = np.empty(n, dtype=np.int64)
        name_of[first[best]] = np.flatnonzero(best)
        groups["exact"] = name_of[first]  # (N,) named by the kept copy
        reps = np.flatnonzero(best)
    nearest = labels = None
    if "semantic" in p.dedupe:
        m = reps.size
        clusters = p.dedupe_clusters or max(1, math.ceil(m / SAMPLES_PER_CLUSTER))
        clusters = max(1, min(clusters, m))
        train = min(p.kmeans_sample or TRAIN_PER_CLUSTER * clusters, m) if clusters > 1 else None
        # every row is assigned (k-means trained on a sample of them: an exact copy barely weighs), then
        # each exact copy that is not its group's kept one is put alone, so only the kept copies are
        # compared; the pool's array is used as it is (no (M, D) copy)
        labels = cluster_labels(pool.image, clusters, p.seed, train)  # (N,)
        if m < n:
            labels = np.where(groups["exact"] == np.arange(n), labels, -1 - np.arange(n))
        semantic = semantic_groups(pool.image, p.dedupe_eps, clusters, scores=scores, labels=labels)  # (N,)
        if "exact" in groups:
            semantic = semantic[groups["exact"]]  # an exact copy's group is its kept copy's (no chaining)
        groups["semantic"] = semantic
        sample = (
            reps
            if m <= NEAREST_SAMPLE
            else np.random.default_rng(p.seed).choice(reps, NEAREST_SAMPLE, replace=False)
        )
        nearest = nearest_similarity(pool.image, labels, rows=sample)  # for the histogram: a sample suffices
        if "exact" in groups:  # a sample with an exact copy: that copy is its nearest (cosine 1)
            nearest[np.bincount(groups["exact"], minlength=n)[groups["exact"]] > 1] = 1.0
        info["kmeans_train_rows"] = train or 0
    union = None
    if "perceptual" in p.dedupe:
        groups["perceptual"], union = pool_groups(pool, p, scores, reps, labels)
        if "exact" in groups:  # an exact copy's group is its kept copy's (no chaining)
            groups["perceptual"] = groups["perceptual"][groups["exact"]]
            union = None if union is None else union[groups["exact"]]
        info["detectors"] = {"perceptual_bits": p.perceptual_distance}
        if "semantic" in groups:
            info["detectors"]["semantic_eps"] = p.dedupe_eps
    group_field = None
    similarity = distance = None
    if groups:
        # the last detector over exact's kept copies decides; perceptual and semantic: their union
        combined = next(
            g
            for g in (union, groups.get("perceptual"), groups.get("semantic"), groups.get("exact"))
            if g is not None
        )
        groups["combined"] = combined
        for name in ("exact", "perceptual", "semantic"):
            if name in groups:
                info[f"{name}_groups"] = group_report(groups[name])
        info["group_sizes"] = group_sizes(combined)
        if pool.image.shape[1]:  # embeddings (none in a run without a model)
            similarity = np.empty(n)  # (N,) cosine with the kept member (1 for a kept one), a block at a time
            for s in range(0, n, SIMILARITY_BLOCK):
                e = s + SIMILARITY_BLOCK
                a, b = _unit_rows(pool.image[s:e]), _unit_rows(pool.image[combined[s:e]])  # (b, D) float64
                similarity[s:e] = np.einsum("nd,nd->n", a, b).clip(-1.0, 1.0)
        if pool.phash is not None:
            distance = distance_to_kept(pool.phash, combined)
        if p.false_negative_field is None:
            index = np.arange(n)
            if "exact" in groups:
                by_policy["exact"] = groups["exact"] == index
            rep_of = groups["exact"] if "exact" in groups else index
            for name in ("perceptual", "semantic"):
                if name in groups:  # alone, over exact's kept copies: its exact group's kept copy survives
                    by_policy[name] = groups[name][rep_of] == rep_of
            by_policy["dedupe"] = combined == index
        else:
            keys = pool.frame["key"].tolist()
            group_field = [
                keys[g] for g in combined.tolist()
            ]  # the member a dedupe would keep names its group
    if contamination is not None:  # every sample near an evaluation image, exact copies included
        by_policy["decontaminate"] = contamination.clean(n)
    keep = np.ones(n, dtype=bool)
    for name in ("clip_score", "dedupe", "decontaminate"):
        if name in by_policy:
            keep &= by_policy[name]
    return Decisions(
        keep=keep,
        by_policy=by_policy,
        threshold=threshold,
        groups=groups,
        group_field=group_field,
        clusters=clusters,
        info=info,
        similarity=similarity,
        nearest=nearest,
        distance=distance,
        contamination=contamination,
    )


def group_sizes(groups: np.ndarray) -> dict:
    """The duplicate groups' (more than one member) sizes: count, largest, median, and how many exceed 10."""
    _, counts = np.unique(np.asarray(groups), return_counts=True)
    multi = counts[counts > 1]
    return {
        "groups": int(multi.size),
        "largest": int(multi.max()) if multi.size else 1,
        "median": float(np.median(multi)) if multi.size else 0.0,
        "over_10": int((multi > 10).sum()),
    }


def check_drop(pool: Pool, d: Decisions, p: Policies) -> None:
    """Refuse (one line) a policy that would drop more than ``max_drop`` of the pool, before any output.

    Guarded: de-duplication (its drop depends on eps and on how the model spreads images: with a
    weak model distinct images sit within a loose eps) and ``clip_score_min`` (an absolute
    cosine, whose meaning depends on the model's score scale). Not guarded: ``keep_fraction``,
    which states the fraction it drops, nor a floor given with it (the score policy then states
    a drop of at least 1 - keep_fraction). ``force`` lifts the guard."""
    from mmalign.errors import UsageError

    n = len(pool)
    if p.force or n == 0:
        return
    if "dedupe" in d.by_policy:
        dropped = int(n - d.by_policy["dedupe"].sum())
        if dropped > p.max_drop * n:
            sizes = d.info["group_sizes"]
            semantic, perceptual = "semantic" in p.dedupe, "perceptual" in p.dedupe
            eps = f", eps {p.dedupe_eps:g}" if semantic else ""
            eps += f", {p.perceptual_distance} bits" if perceptual else ""
            fixes = ["lower --dedupe-eps"] if semantic else []
            fixes += ["lower --perceptual-distance"] if perceptual else []
            fix = " or ".join(fixes) or "most of the pool is byte-identical copies: check it"
            raise UsageError(
                f"curate: de-duplication ({','.join(p.dedupe)}{eps}) would drop {dropped} of {n} samples "
                f"({100 * dropped / n:.1f}% > --max-drop {p.max_drop:g}); its largest group holds "
                f"{sizes['largest']} samples; nothing written: {fix}, or pass --force"
            )
    if "decontaminate" in d.by_policy:
        dropped = int(n - d.by_policy["decontaminate"].sum())
        if dropped > p.max_drop * n:
            raise UsageError(
                f"curate: --decontaminate would drop {dropped} of {n} samples ({100 * dropped / n:.1f}% > "
                f"--max-drop {p.max_drop:g}); nothing written: lower --decontaminate-distance (or --dedupe-eps "
                f"with a model), or pass --force"
            )
    if p.clip_score_min is not None and p.keep_fraction is None:
        scores = pool.frame["clip_score"].to_numpy(np.float64)
        dropped = int((scores < p.clip_score_min).sum())
        if dropped > p.max_drop * n:
            raise UsageError(
                f"curate: --clip-score-min {p.clip_score_min:g} would drop {dropped} of {n} samples "
                f"({100 * dropped / n:.1f}% > --max-drop {p.max_drop:g}); the pool's median score is "
                f"{np.median(scores):.3f}; nothing written: lower it, use --keep-fraction, or pass "
                f"--force"
            )


def reasons(pool: Pool, d: Decisions) -> tuple[list[str], list[str | None]]:
    """Per sample: why it was dropped ("kept" when it was not), and the key of the sample it
    duplicates (None when it is no dropped duplicate). Several reasons are joined by "; "."""
    n = len(pool)
    keys = pool.frame["key"].tolist()
    sha = pool.frame["image_sha256"].tolist()
    combined = d.groups.get("combined")
    why: list[str] = []
    of: list[str | None] = []
    score_ok = d.by_policy.get("clip_score")
    dedupe_ok = d.by_policy.get("dedupe")
    near = d.contamination.reasons() if d.contamination is not None else {}  # row -> its matches
    for i in range(n):
        parts, dup = [], None
        if score_ok is not None and not score_ok[i]:
            parts.append("clip_score")
        if dedupe_ok is not None and not dedupe_ok[i]:
            assert combined is not None  # the dedupe policy names every sample's group
            k = int(combined[i])
            dup = keys[k]
            parts.append(f"{detector(d, i, k, sha)} duplicate of {dup}")
        parts += near.get(i, [])
        why.append("; ".join(parts) or "kept")
        of.append(dup)
    return why, of
