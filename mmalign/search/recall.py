"""Recall@k of an index on its own corpus, with the evaluation suite's definitions.

    from mmalign.search.recall import index_recall
    index_recall("runs/x/index", ks=(1, 5, 10))  # {"image_retrieval_recall@1": ..., ...}

Its own module: it reads the embedding directory back and scores every row, which the
query-serving :class:`~mmalign.search.searcher.Searcher` never does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from mmalign.search.searcher import Searcher


def _hits_at(scores: np.ndarray, right: np.ndarray, ks: Sequence[int]) -> dict[int, np.ndarray]:
    """Per query, hit@k under the evaluation suite's rule: fewer than k wrong candidates
    score strictly above the best right one.  ``scores`` (n, K) sorted descending,
    ``right`` (n, K) bool; a query whose right answer is not among the K results misses."""
    best = np.where(right, scores, -np.inf).max(axis=1)  # (n,) best right score in the list
    above = ((scores > best[:, None]) & ~right).sum(axis=1)  # (n,) wrong results strictly above it
    found = right.any(axis=1)
    return {k: found & (above < k) for k in ks}


def index_recall(index_dir: str | Path, ks: Sequence[int] = (1, 5, 10), slack: int = 16) -> dict:
    """Recall@k of an index on its own corpus, as ``mmalign.evaluation.retrieval`` defines it.

    text->image (``image_retrieval_recall@k``): each caption row queries the image index;
    image->text (``text_retrieval_recall@k``): each image queries the text index and hits
    if any of its captions ranks in the top k.  ``slack`` extra results per query let
    exact ties with the right answer at the cut-off count.  Ties go to the query (the strict
    ranks of ``retrieval_ranks``); ``recall_at_k`` breaks exact ties as clip_benchmark's
    ``torch.topk`` does, which needs full score rows: the two agree when nothing ties.
    """
    s = Searcher(index_dir)
    emb = Path(s.info["emb_dir"])
    image_of_row = np.cumsum(s.table.column("caption_index") == 0) - 1  # (rows,) image id of each row
    kmax = max(ks) + slack
    text_vecs = np.concatenate(
        [
            np.load(f)
            for f in sorted(
                (emb / "text_emb").glob("text_emb_*.npy"), key=lambda p: int(p.stem.rsplit("_", 1)[1])
            )
        ]
    )
    img_vecs = np.concatenate(
        [
            np.load(f)
            for f in sorted(
                (emb / "img_emb").glob("img_emb_*.npy"), key=lambda p: int(p.stem.rsplit("_", 1)[1])
            )
        ]
    )
    from mmalign.search.index import _normalised

    metrics = {}
    # text -> image: each caption row queries the image index; image -> text: each image the text index
    for query, target, vecs, name in (
        ("text", "image", text_vecs, "image_retrieval_recall"),
        ("image", "text", img_vecs, "text_retrieval_recall"),
    ):
        index = s.indexes[target]
        scores, ids = index.search(_normalised(vecs[s.rows[query]]), min(kmax, index.ntotal))  # (n, K)
        valid = ids >= 0  # IVF may return fewer than K results
        owner = image_of_row[s.rows[target][np.where(valid, ids, 0)]]  # (n, K) image id of each result
        right = valid & (owner == image_of_row[s.rows[query]][:, None])
        for k, hit in _hits_at(np.where(valid, scores, -np.inf), right, ks).items():
            metrics[f"{name}@{k}"] = float(hit.mean())
    from mmalign.evaluation.caveats import TEMPLATE_CAVEAT, looks_templated

    if looks_templated([str(c) for c in s.table.column("caption")], len(img_vecs)):  # the numbers' one caveat
        logging.getLogger("mmalign.search").warning("index %s: %s", index_dir, TEMPLATE_CAVEAT)
    s.close()
    return metrics
