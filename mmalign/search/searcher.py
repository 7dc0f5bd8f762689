"""``mmalign search``: query an ``mmalign index`` directory with text or an image.

    s = Searcher("runs/x/index", "runs/x")      # index dir, model dir (or a step checkpoint)
    s.text("a red circle", k=10)                # -> [Hit(rank, key, caption, score, row), ...]
    s.image("photo.jpg", k=10)                  # image query, against the image index
    s.text("a red circle", k=5, against="text") # nearest captions instead of images

Scores are inner products of L2-normalised vectors, i.e. cosines in [-1, 1].  A hit
from the image index reports the image's first caption; a hit from the text index
the matched caption.  Each hit carries the sample's ``source_path`` (``cat/0001.jpg``)
when the index knows it (None for indexes built before it was recorded).

Searches against the text index de-duplicate identical captions by default: a dataset
captioned from templates holds thousands of rows of "a photo of a cat", and the top k
would otherwise be k copies of one caption.  The best-scoring copy is kept and k is
filled with the next distinct captions (looking at up to ``DEDUPE_SCAN`` nearest rows);
``dedupe=False`` returns the raw nearest rows.

:func:`index_recall` scores an index against its own corpus with the evaluation
suite's Recall@k definitions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmalign.errors import UsageError
from mmalign.extras import extra
from mmalign.search.index import INDEX_INFO, METADATA

if TYPE_CHECKING:
    from mmalign.models.load import Loaded

TARGETS = ("image", "text")
MAX_QUERY_PIXELS = 40_000_000  # an image query with more pixels is refused before it is decoded
DEDUPE_SCAN = 1 << 16  # de-duplication looks at most this many nearest rows to fill k distinct captions


@dataclass
class Hit:
    rank: int  # 1-based
    key: str
    caption: str
    score: float  # cosine similarity
    row: int  # the row in the embedding directory (metadata_N.parquet order)
    source_path: str | None = None  # where the sample came from (cat/0001.jpg), when the index knows


class ImageUnavailable(LookupError):
    """A hit's image cannot be read back (an old index without locations, a moved or changed shard)."""


def _read_index_dir(index_dir: Path) -> dict:
    if not (index_dir / INDEX_INFO).is_file():
        raise UsageError(
            f"--index: {index_dir} is not an index directory (no {INDEX_INFO}; run `mmalign index`)"
        )
    return json.loads((index_dir / INDEX_INFO).read_text())


class Searcher:
    """FAISS indexes + their metadata + (optionally) the model that embeds queries."""

    def __init__(self, index_dir: str | Path, model_dir: str | Path | None = None, device: str = "cpu"):
        import pandas as pd

        with extra("search", "searching an index (mmalign search, mmalign serve)"):
            import faiss

        self.index_dir = Path(index_dir)
        self.info = _read_index_dir(self.index_dir)
        self.dim = int(self.info["dim"])
        self.indexes, self.rows = {}, {}
        for name in TARGETS:
            if name in self.info:
                self.indexes[name] = faiss.read_index(str(self.index_dir / f"{name}.index"))
                self.rows[name] = np.load(self.index_dir / f"{name}_rows.npy")
                if "nprobe" in self.info[name]:  # IVF: the probe count is a search-time setting
                    faiss.extract_index_ivf(self.indexes[name]).nprobe = int(self.info[name]["nprobe"])
                if self.indexes[name].d != self.dim:
                    raise UsageError(
                        f"--index: {name}.index has dim {self.indexes[name].d}, index.json says {self.dim}"
                    )
        self.meta = pd.read_parquet(self.index_dir / METADATA)
        self.device = device
        self.max_pixels = MAX_QUERY_PIXELS
        self.source: Loaded | None = None
        if model_dir is not None:
            from mmalign.models.load import load

            self.source = load(model_dir, device=device)
            model_dim = self.source.model.embed_dim
            if model_dim != self.dim:
                raise UsageError(
                    f"--index: {self.index_dir} was built with embedding dim {self.dim}, but the model "
                    f"{model_dir} embeds to dim {model_dim}; rebuild the index with this model"
                )
            self.preprocess = self.source.preprocess

    # ------------------------------------------------------------ encoding

    def _need_source(self) -> Loaded:
        if self.source is None:
            raise UsageError("a model is needed to embed queries (pass --model)")
        return self.source

    def _need_model(self):
        return self._need_source().model

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str]) -> np.ndarray:
        source = self._need_source()
        tokens = source.tokenizer(list(texts)).to(self.device)
        return source.model.encode_text(tokens).float().cpu().numpy()  # (n, D), normalised

    @torch.no_grad()
    def encode_image(self, images: Sequence) -> np.ndarray:
        """Paths or PIL images -> (n, D) normalised."""
        from PIL import Image

        from mmalign.data.shards import BadSample, open_image

        model = self._need_model()
        pixels = []
        for image in images:
            if not isinstance(image, Image.Image):
                path = Path(image)
                if not path.is_file():
                    raise UsageError(f"--image: {path} does not exist")
                try:
                    image = open_image(path.read_bytes(), self.max_pixels)  # pixels counted before decoding
                except BadSample as e:
                    raise UsageError(f"--image: cannot read {path} ({e})") from None
            pixels.append(self.preprocess(image))
        return model.encode_image(torch.stack(pixels).to(self.device)).float().cpu().numpy()

    # ------------------------------------------------------------- search

    def search_vectors(
        self, vectors: np.ndarray, k: int = 10, against: str = "image", dedupe: bool = True
    ) -> list[list[Hit]]:
        """(n, D) query vectors -> for each, the top-``k`` hits of the ``against`` index
        (against ``text`` with ``dedupe``: the top ``k`` distinct captions)."""
        if against not in self.indexes:
            raise UsageError(
                f"--against: no {against!r} index in {self.index_dir} (have {', '.join(self.indexes)})"
            )
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise UsageError(
                f"query vectors of shape {tuple(vectors.shape)} do not match the index dim {self.dim}"
            )
        if k <= 0:
            raise UsageError(f"-k must be positive, got {k}")
        index, k = self.indexes[against], int(k)
        dedupe = dedupe and against == "text"
        total = index.ntotal
        fetch = min(k, total)  # FAISS allocates (n, fetch) results up front
        if fetch == 0:
            return [[] for _ in range(len(vectors))]
        scan = min(total, max(k, DEDUPE_SCAN))  # the most rows de-duplication looks at
        while True:
            scores, ids = index.search(vectors, fetch)  # (n, fetch) each; id -1 = no result
            out = [self._hits(srow, irow, against, k, dedupe) for srow, irow in zip(scores, ids)]
            if not dedupe or fetch >= scan or all(len(hits) == k for hits in out):
                return out
            fetch = min(scan, fetch * 4)  # duplicates took places: look further down the list

    def _hits(self, scores: np.ndarray, ids: np.ndarray, against: str, k: int, dedupe: bool) -> list[Hit]:
        hits: list[Hit] = []
        seen: set[str] = set()
        for score, i in zip(scores, ids):
            if i < 0:
                continue
            row = int(self.rows[against][i])
            caption = str(self.meta.at[row, "caption"])
            if dedupe:
                if caption in seen:
                    continue  # a lower-scoring copy: results come best first
                seen.add(caption)
            hits.append(
                Hit(
                    len(hits) + 1,
                    str(self.meta.at[row, "key"]),
                    caption,
                    float(score),
                    row,
                    self.source_path(row),
                )
            )
            if len(hits) == k:
                break
        return hits

    def text(self, query: str, k: int = 10, against: str = "image", dedupe: bool = True) -> list[Hit]:
        return self.search_vectors(self.encode_text([query]), k, against, dedupe)[0]

    def image(self, image, k: int = 10, against: str = "image", dedupe: bool = True) -> list[Hit]:
        return self.search_vectors(self.encode_image([image]), k, against, dedupe)[0]

    # ------------------------------------------------------ where a hit came from

    def source_path(self, row: int) -> str | None:
        """The row's ``source_path`` column, else (an index from before it) its ``.json``'s, else None."""
        if "source_path" in self.meta.columns:
            value = self.meta.at[row, "source_path"]
            return value if isinstance(value, str) else None
        try:
            value = json.loads(self.meta.at[row, "json"]).get("source_path")
        except (KeyError, TypeError, ValueError, AttributeError):
            return None
        return value if isinstance(value, str) else None

    def image_bytes(self, row: int, max_bytes: int) -> bytes:
        """The encoded image of metadata row ``row``, read back from its shard (or image file).
        Raises :class:`ImageUnavailable` when it cannot be found or is over ``max_bytes``."""
        from mmalign.data.shards import IMAGE_EXTS
        from mmalign.data.tario import CorruptTar, TruncatedTar, open_shard, read_sample_at

        if not 0 <= row < len(self.meta):
            raise UsageError(f"row must be in [0, {len(self.meta)})")
        if "file" not in self.meta.columns:
            raise ImageUnavailable(
                "this index records no image locations (built before they were kept: "
                "re-run `mmalign embed` and `mmalign index`)"
            )
        file, offset, key = (
            str(self.meta.at[row, "file"]),
            int(self.meta.at[row, "offset"]),
            self.meta.at[row, "key"],
        )
        try:
            if offset < 0:  # an image folder's file
                if Path(file).stat().st_size > max_bytes:
                    raise ImageUnavailable(f"row {row}: the image is over {max_bytes} bytes")
                return Path(file).read_bytes()
            with open_shard(file) as f:
                sample = read_sample_at(f, offset, 0, max_member=max_bytes)
        except (OSError, TruncatedTar, CorruptTar) as e:
            raise ImageUnavailable(f"row {row}: cannot read {Path(file).name} ({e})") from None
        if sample is None or Path(sample.key).name != key:  # the shard was rewritten since indexing
            raise ImageUnavailable(
                f"row {row}: sample {key!r} is no longer at its place in {Path(file).name}"
            )
        if any(e in sample.oversized for e in IMAGE_EXTS):
            raise ImageUnavailable(f"row {row}: the image is over {max_bytes} bytes")
        data = next((sample.members[e] for e in IMAGE_EXTS if e in sample.members), None)
        if data is None:
            raise ImageUnavailable(f"row {row}: sample {key!r} has no image")
        return data


def format_hits(hits: list[Hit]) -> str:
    """A table of hits, its columns aligned (each as wide as its widest cell; the caption last,
    unpadded); the source column appears when any hit knows its source path."""
    sources = any(h.source_path for h in hits)
    header = ["rank", "score", "key"] + (["source"] if sources else []) + ["caption"]
    rows = [
        [str(h.rank), f"{h.score:.4f}", str(h.key)]
        + ([h.source_path or "-"] if sources else [])
        + [h.caption]
        for h in hits
    ]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header) - 1)]
    numbers = 2  # rank and score: right-aligned

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) if i < numbers else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded + [cells[-1]]).rstrip()

    return "\n".join(line(r) for r in [header] + rows)


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
    image_of_row = np.cumsum(s.meta["caption_index"].to_numpy() == 0) - 1  # (rows,) image id of each row
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
    import logging

    from mmalign.evaluation.caveats import TEMPLATE_CAVEAT, looks_templated

    if looks_templated(s.meta["caption"].astype(str).tolist(), len(img_vecs)):  # the numbers' one caveat
        logging.getLogger("mmalign.search").warning("index %s: %s", index_dir, TEMPLATE_CAVEAT)
    return metrics
