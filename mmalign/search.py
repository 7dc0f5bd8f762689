"""``mmalign search``: query an ``mmalign index`` directory with text or an image.

    s = Searcher("runs/x/index", "runs/x")      # index dir, model dir (or a step checkpoint)
    s.text("a red circle", k=10)                # -> [Hit(rank, key, caption, score, row), ...]
    s.image("photo.jpg", k=10)                  # image query, against the image index
    s.text("a red circle", k=5, against="text") # nearest captions instead of images

Scores are inner products of L2-normalised vectors, i.e. cosines in [-1, 1].  A hit
from the image index reports the image's first caption; a hit from the text index
the matched caption.  :func:`index_recall` scores an index against its own corpus
with the evaluation suite's Recall@k definitions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from mmalign.config import ConfigError
from mmalign.index import INDEX_INFO, METADATA

TARGETS = ("image", "text")
MAX_QUERY_PIXELS = 40_000_000  # an image query with more pixels is refused before it is decoded


@dataclass
class Hit:
    rank: int  # 1-based
    key: str
    caption: str
    score: float  # cosine similarity
    row: int  # the row in the embedding directory (metadata_N.parquet order)


def _read_index_dir(index_dir: Path) -> dict:
    if not (index_dir / INDEX_INFO).is_file():
        raise ConfigError(f"--index: {index_dir} is not an index directory (no {INDEX_INFO}; run `mmalign index`)")
    return json.loads((index_dir / INDEX_INFO).read_text())


class Searcher:
    """FAISS indexes + their metadata + (optionally) the model that embeds queries."""

    def __init__(self, index_dir: str | Path, model_dir: str | Path | None = None, device: str = "cpu"):
        import faiss
        import pandas as pd

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
                    raise ConfigError(f"--index: {name}.index has dim {self.indexes[name].d}, "
                                      f"index.json says {self.dim}")
        self.meta = pd.read_parquet(self.index_dir / METADATA)
        self.device = device
        self.max_pixels = MAX_QUERY_PIXELS
        self.source = None
        if model_dir is not None:
            from mmalign.data.transforms import eval_transform
            from mmalign.export.source import load_source

            self.source = load_source(model_dir)
            self.source.model.to(device).eval()
            model_dim = self.source.model.embed_dim
            if model_dim != self.dim:
                raise ConfigError(f"--index: {self.index_dir} was built with embedding dim {self.dim}, but the model "
                                  f"{model_dir} embeds to dim {model_dim}; rebuild the index with this model")
            size = self.source.preprocess_cfg["size"]
            self.preprocess = eval_transform(int(size[0] if isinstance(size, (list, tuple)) else size))

    # ------------------------------------------------------------ encoding

    def _need_model(self):
        if self.source is None:
            raise ConfigError("a model is needed to embed queries (pass --model)")
        return self.source.model

    @torch.no_grad()
    def encode_text(self, texts: Sequence[str]) -> np.ndarray:
        model = self._need_model()
        tokens = self.source.tokenizer(list(texts)).to(self.device)
        return model.encode_text(tokens).float().cpu().numpy()  # (n, D), normalised

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
                    raise ConfigError(f"--image: {path} does not exist")
                try:
                    image = open_image(path.read_bytes(), self.max_pixels)  # pixels counted before decoding
                except BadSample as e:
                    raise ConfigError(f"--image: cannot read {path} ({e})") from None
            pixels.append(self.preprocess(image))
        return model.encode_image(torch.stack(pixels).to(self.device)).float().cpu().numpy()

    # ------------------------------------------------------------- search

    def search_vectors(self, vectors: np.ndarray, k: int = 10, against: str = "image") -> list[list[Hit]]:
        """(n, D) query vectors -> for each, the top-``k`` hits of the ``against`` index."""
        if against not in self.indexes:
            raise ConfigError(f"--against: no {against!r} index in {self.index_dir} (have {', '.join(self.indexes)})")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != self.dim:
            raise ConfigError(f"query vectors of shape {tuple(vectors.shape)} do not match the index dim {self.dim}")
        if k <= 0:
            raise ConfigError(f"-k must be positive, got {k}")
        k = min(int(k), self.indexes[against].ntotal)  # FAISS allocates (n, k) results up front
        if k == 0:
            return [[] for _ in range(len(vectors))]
        scores, ids = self.indexes[against].search(vectors, k)  # (n, k) each; id -1 = no result
        out = []
        for srow, irow in zip(scores, ids):
            hits = []
            for score, i in zip(srow, irow):
                if i < 0:
                    continue
                row = int(self.rows[against][i])
                hits.append(Hit(len(hits) + 1, str(self.meta.at[row, "key"]), str(self.meta.at[row, "caption"]),
                                float(score), row))
            out.append(hits)
        return out

    def text(self, query: str, k: int = 10, against: str = "image") -> list[Hit]:
        return self.search_vectors(self.encode_text([query]), k, against)[0]

    def image(self, image, k: int = 10, against: str = "image") -> list[Hit]:
        return self.search_vectors(self.encode_image([image]), k, against)[0]


def format_hits(hits: list[Hit]) -> str:
    lines = [f"{'rank':>4}  {'score':>7}  key  caption"]
    lines += [f"{h.rank:>4}  {h.score:7.4f}  {h.key}  {h.caption}" for h in hits]
    return "\n".join(lines)


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
    text_vecs = np.concatenate([np.load(f) for f in sorted((emb / "text_emb").glob("text_emb_*.npy"),
                                                          key=lambda p: int(p.stem.rsplit("_", 1)[1]))])
    img_vecs = np.concatenate([np.load(f) for f in sorted((emb / "img_emb").glob("img_emb_*.npy"),
                                                         key=lambda p: int(p.stem.rsplit("_", 1)[1]))])
    from mmalign.index import _normalised

    metrics = {}
    # text -> image: each caption row queries the image index; image -> text: each image the text index
    for query, target, vecs, name in (("text", "image", text_vecs, "image_retrieval_recall"),
                                      ("image", "text", img_vecs, "text_retrieval_recall")):
        index = s.indexes[target]
        scores, ids = index.search(_normalised(vecs[s.rows[query]]), min(kmax, index.ntotal))  # (n, K)
        valid = ids >= 0  # IVF may return fewer than K results
        owner = image_of_row[s.rows[target][np.where(valid, ids, 0)]]  # (n, K) image id of each result
        right = valid & (owner == image_of_row[s.rows[query]][:, None])
        for k, hit in _hits_at(np.where(valid, scores, -np.inf), right, ks).items():
            metrics[f"{name}@{k}"] = float(hit.mean())
    return metrics
