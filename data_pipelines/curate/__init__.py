"""Data curation kernels with a CLIP model: the pure layer under a future ``mmalign curate`` (issue 31).

- :mod:`.scores`: per-sample image-text CLIP score (cosine).
- :mod:`.threshold`: the DataComp CLIP-score filter (Gadre et al. 2023, "DataComp: In search of
  the next generation of multimodal datasets"): keep the pool's top fraction by score, and/or
  an absolute minimum score.
- :mod:`.dedupe`: exact de-duplication by digest and SemDeDup (Abbas et al. 2023, "SemDeDup:
  Data-efficient learning at web-scale through semantic deduplication"): near-duplicate groups
  of image embeddings within k-means clusters, one member kept per group.

Arrays in, arrays out: no shard I/O, no model, no torch (numpy and faiss only).
"""

from data_pipelines.curate.dedupe import (
    cluster_labels,
    exact_groups,
    group_report,
    keep_one_per_group,
    semantic_groups,
)
from data_pipelines.curate.scores import clip_scores
from data_pipelines.curate.threshold import PoolQuantile, keep_threshold, select

__all__ = [
    "PoolQuantile",
    "clip_scores",
    "cluster_labels",
    "exact_groups",
    "group_report",
    "keep_one_per_group",
    "keep_threshold",
    "select",
    "semantic_groups",
]
