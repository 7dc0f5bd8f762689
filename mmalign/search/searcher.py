"""``mmalign search``: query an ``mmalign index`` directory with text or an image.

    s = Searcher("runs/x/index", "runs/x")      # index dir, model dir (or a step checkpoint)
    s.text("a red circle", k=10)                # -> [Hit(rank, key, caption, score, row, ...), ...]
    s.image("photo.jpg", k=10)                  # image query, against the image index
    s.text("a red circle", k=5, against="text") # nearest captions instead of images
    Searcher("runs/x/index", mmap=True)         # indexes memory-mapped (searcher_shards.py says which)

Scores are inner products of L2-normalised vectors, i.e. cosines in [-1, 1].  A hit
from the image index reports the image's first caption; a hit from the text index
the matched caption.  Each hit carries the sample's ``source_path`` (``cat/0001.jpg``)
when the index knows it (None for indexes built before it was recorded), its ``url``
(img2dataset's column; None without one) and ``meta``: every other metadata column but
the image's location on this machine (``file``, ``offset``; :meth:`Searcher.metadata` has them).

An index may be split into shards (``index.json``'s ``shards``): every shard is searched
and the top k merged (:mod:`mmalign.search.searcher_shards`).  Metadata rows are read by
number from ``metadata.arrow`` through a memory map (:mod:`mmalign.search.searcher_meta`).

Searches against the text index de-duplicate identical captions by default: a dataset
captioned from templates holds thousands of rows of "a photo of a cat", and the top k
would otherwise be k copies of one caption.  The best-scoring copy is kept and k is
filled with the next distinct captions (looking at up to ``DEDUPE_SCAN`` nearest rows);
``dedupe=False`` returns the raw nearest rows.

Thread-safe without a lock: concurrent ``encode_text`` calls are encoded in one forward
and concurrent ``search_vectors`` calls searched in one FAISS call, each by a bounded
:class:`~mmalign.search.batcher.Batcher` (a full queue raises
:class:`~mmalign.search.batcher.Overloaded`); every other access only reads.

:func:`mmalign.search.recall.index_recall` scores an index against its own corpus with the
evaluation suite's Recall@k definitions.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmalign.errors import UsageError
from mmalign.search.batcher import Batcher, Overloaded
from mmalign.search.index import INDEX_INFO
from mmalign.search.searcher_meta import MetadataTable
from mmalign.search.searcher_shards import ShardedIndex, require_faiss

if TYPE_CHECKING:
    from mmalign.models.load import Loaded

__all__ = ["Hit", "ImageUnavailable", "Overloaded", "Searcher", "format_hits"]

TARGETS = ("image", "text")
MAX_QUERY_PIXELS = 40_000_000  # an image query with more pixels is refused before it is decoded
DEDUPE_SCAN = 1 << 16  # de-duplication looks at most this many nearest rows to fill k distinct captions
HIT_COLUMNS = ("key", "caption", "source_path", "url")  # a Hit's own fields; the rest go to Hit.meta
LOCATOR_COLUMNS = ("file", "offset")  # where this machine reads the image back: not sent in a Hit
MAX_BATCH = 32  # queries gathered into one forward / one FAISS call
MAX_WAIT_S = 0.002  # how long the first query of a batch waits for company
MAX_QUEUE = 256  # queries waiting beyond this: Overloaded (503)
ENCODE_CHUNK = 256  # texts per forward inside one batch


@dataclass
class Hit:
    rank: int  # 1-based
    key: str
    caption: str
    score: float  # cosine similarity
    row: int  # the row in the embedding directory (metadata_N.parquet order)
    source_path: str | None = None  # where the sample came from (cat/0001.jpg), when the index knows
    url: str | None = None  # the sample's source URL (img2dataset's ``url``), when it has one
    meta: dict = field(default_factory=dict)  # every other metadata column of the row (JSON-able)


class ImageUnavailable(LookupError):
    """A hit's image cannot be read back (an old index without locations, a moved or changed shard)."""


def _read_index_dir(index_dir: Path) -> dict:
    if not (index_dir / INDEX_INFO).is_file():
        raise UsageError(
            f"--index: {index_dir} is not an index directory (no {INDEX_INFO}; run `mmalign index`)"
        )
    return json.loads((index_dir / INDEX_INFO).read_text())


def _weak(method) -> Callable:
    """``method`` called through a weak reference: a batcher's worker never keeps its searcher alive."""
    ref = weakref.WeakMethod(method)

    def call(items):
        bound = ref()
        if bound is None:
            raise RuntimeError("the searcher is gone")
        return bound(items)

    return call


class Searcher:
    """FAISS indexes + their metadata + (optionally) the model that embeds queries."""

    def __init__(
        self,
        index_dir: str | Path,
        model_dir: str | Path | None = None,
        device: str = "cpu",
        *,
        mmap: bool = False,
    ):
        require_faiss()  # a missing [search] extra is the first thing said, before any file is read
        self.index_dir = Path(index_dir)
        self.info = _read_index_dir(self.index_dir)
        self.dim = int(self.info["dim"])
        self.mmap = bool(mmap)
        self.indexes: dict[str, ShardedIndex] = {}
        for name in TARGETS:
            if name in self.info:
                self.indexes[name] = ShardedIndex.load(
                    self.index_dir, name, self.info[name], self.dim, mmap=self.mmap
                )
        self.table = MetadataTable(self.index_dir)
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
        opts: dict[str, Any] = {"max_batch": MAX_BATCH, "max_wait_s": MAX_WAIT_S, "max_queue": MAX_QUEUE}
        self._texts = Batcher(_weak(self._encode_batch), name="mmalign-encode", **opts)
        self._searches = Batcher(_weak(self._search_batch), name="mmalign-search", **opts)

    def close(self) -> None:
        """Stop the batchers' worker threads (also done when the searcher is garbage-collected)."""
        self._texts.close()
        self._searches.close()

    def __enter__(self) -> Searcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def rows(self) -> dict[str, np.ndarray]:
        """Per modality, (count,) index position -> metadata row."""
        return {name: index.rows for name, index in self.indexes.items()}

    @property
    def num_rows(self) -> int:
        return self.table.num_rows

    def metadata(self, rows: Sequence[int]) -> list[dict]:
        """Every metadata column of each of ``rows`` (JSON-able values; None where a part lacked it)."""
        return self.table.rows(rows)

    # ------------------------------------------------------------ encoding

    def _need_source(self) -> Loaded:
        if self.source is None:
            raise UsageError("a model is needed to embed queries (pass --model)")
        return self.source

    def _need_model(self):
        return self._need_source().model

    def encode_text(self, texts: Sequence[str]) -> np.ndarray:
        """(n, D) normalised; concurrent calls share one forward (the batcher's worker)."""
        self._need_source()
        texts = [str(t) for t in texts]
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        return self._texts.submit(texts)

    def _encode_batch(self, blocks: list[list[str]]) -> list[np.ndarray]:
        """The worker's call: every block's texts in one forward (chunks of ``ENCODE_CHUNK``)."""
        source = self._need_source()
        texts = [t for block in blocks for t in block]
        out = []
        with torch.inference_mode():
            for a in range(0, len(texts), ENCODE_CHUNK):
                tokens = source.tokenizer(texts[a : a + ENCODE_CHUNK]).to(self.device)  # (n, L)
                out.append(source.model.encode_text(tokens).float().cpu().numpy())  # (n, D)
        vectors = np.concatenate(out)
        ends = np.cumsum([len(b) for b in blocks])
        return np.split(vectors, ends[:-1])

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
        with torch.inference_mode():
            return model.encode_image(torch.stack(pixels).to(self.device)).float().cpu().numpy()

    # ------------------------------------------------------------- search

    def search_vectors(
        self, vectors: np.ndarray, k: int = 10, against: str = "image", dedupe: bool = True
    ) -> list[list[Hit]]:
        """(n, D) query vectors -> for each, the top-``k`` hits of the ``against`` index
        (against ``text`` with ``dedupe``: the top ``k`` distinct captions).  Up to
        ``MAX_BATCH`` queries from concurrent callers are searched in one FAISS call."""
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
        dedupe = dedupe and against == "text"
        if len(vectors) == 0:
            return []
        if len(vectors) > MAX_BATCH:  # already a batch of its own
            return self._search(vectors, [int(k)] * len(vectors), against, dedupe)
        return self._searches.submit((vectors, int(k), against, dedupe))

    def _search_batch(self, items: list[tuple[np.ndarray, int, str, bool]]) -> list[list[list[Hit]]]:
        """The worker's call: items grouped by (against, dedupe), each group in one FAISS search."""
        out: list = [None] * len(items)
        groups: dict[tuple[str, bool], list[int]] = {}
        for i, (_, _, against, dedupe) in enumerate(items):
            groups.setdefault((against, dedupe), []).append(i)
        for (against, dedupe), members in groups.items():
            vectors = np.concatenate([items[i][0] for i in members])  # (n, D)
            ks = [items[i][1] for i in members for _ in range(len(items[i][0]))]
            hits = self._search(vectors, ks, against, dedupe)
            a = 0
            for i in members:
                out[i] = hits[a : a + len(items[i][0])]
                a += len(items[i][0])
        return out

    def _search(self, vectors: np.ndarray, ks: list[int], against: str, dedupe: bool) -> list[list[Hit]]:
        # one search at the largest k: exact and IVF top-k are prefixes of a larger k's (HNSW
        # searches at least k wide, so a smaller k batched with a larger one is searched wider)
        index, kmax = self.indexes[against], max(ks)
        total = index.ntotal
        fetch = min(kmax, total)  # FAISS allocates (n, fetch) results up front
        if fetch == 0:
            return [[] for _ in range(len(vectors))]
        scan = min(total, max(kmax, DEDUPE_SCAN))  # the most rows de-duplication looks at
        while True:
            scores, ids = index.search(vectors, fetch)  # (n, fetch) each; id -1 = no result
            out = [self._hits(s, i, against, k, dedupe) for s, i, k in zip(scores, ids, ks)]
            if not dedupe or fetch >= scan or all(len(h) == k for h, k in zip(out, ks)):
                return out
            fetch = min(scan, fetch * 4)  # duplicates took places: look further down the list

    def _hits(self, scores: np.ndarray, ids: np.ndarray, against: str, k: int, dedupe: bool) -> list[Hit]:
        valid = ids >= 0
        scores, positions = scores[valid], ids[valid]
        if not dedupe:
            scores, positions = scores[:k], positions[:k]
        rows = self.indexes[against].row_of(positions)  # (m,) metadata rows
        captions = [str(c) for c in self.table.values("caption", rows)]
        keep: list[int] = []
        seen: set[str] = set()
        for j, caption in enumerate(captions):
            if dedupe:
                if caption in seen:
                    continue  # a lower-scoring copy: results come best first
                seen.add(caption)
            keep.append(j)
            if len(keep) == k:
                break
        return self._make_hits([int(rows[j]) for j in keep], [float(scores[j]) for j in keep])

    def _make_hits(self, rows: list[int], scores: list[float]) -> list[Hit]:
        records = self.table.rows(rows)
        fallback = "source_path" not in self.table.columns
        hits = []
        for rank, (row, score, record) in enumerate(zip(rows, scores, records), start=1):
            source = record.get("source_path")
            if fallback:
                source = _json_source(record.get("json"))
            url = record.get("url")
            hits.append(
                Hit(
                    rank,
                    str(record.get("key")),
                    str(record.get("caption")),
                    score,
                    row,
                    source if isinstance(source, str) else None,
                    url if isinstance(url, str) and url else None,
                    {c: v for c, v in record.items() if c not in HIT_COLUMNS + LOCATOR_COLUMNS},
                )
            )
        return hits

    def text(self, query: str, k: int = 10, against: str = "image", dedupe: bool = True) -> list[Hit]:
        return self.search_vectors(self.encode_text([query]), k, against, dedupe)[0]

    def image(self, image, k: int = 10, against: str = "image", dedupe: bool = True) -> list[Hit]:
        return self.search_vectors(self.encode_image([image]), k, against, dedupe)[0]

    # ------------------------------------------------------ where a hit came from

    def source_path(self, row: int) -> str | None:
        """The row's ``source_path`` column, else (an index from before it) its ``.json``'s, else None."""
        if "source_path" in self.table.columns:
            value = self.table.values("source_path", [row])[0]
            return value if isinstance(value, str) else None
        return _json_source(self.table.values("json", [row])[0])

    def image_bytes(self, row: int, max_bytes: int) -> bytes:
        """The encoded image of metadata row ``row``, read back from its shard (or image file).
        Raises :class:`ImageUnavailable` when it cannot be found or is over ``max_bytes``."""
        from mmalign.data.shards import IMAGE_EXTS
        from mmalign.data.tario import CorruptTar, TruncatedTar, open_shard, read_sample_at

        if not 0 <= row < self.table.num_rows:
            raise UsageError(f"row must be in [0, {self.table.num_rows})")
        if "file" not in self.table.columns:
            raise ImageUnavailable(
                "this index records no image locations (built before they were kept: "
                "re-run `mmalign embed` and `mmalign index`)"
            )
        record = self.table.rows([row])[0]
        file, offset, key = str(record["file"]), int(record["offset"]), record["key"]
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


def _json_source(value) -> str | None:
    """``source_path`` from a row's ``.json`` text (indexes from before the column)."""
    try:
        source = json.loads(value).get("source_path")
    except (TypeError, ValueError, AttributeError):
        return None
    return source if isinstance(source, str) else None


def format_hits(hits: list[Hit]) -> str:
    """A table of hits, its columns aligned (each as wide as its widest cell; the caption last,
    unpadded); the source column appears when any hit knows its source path, the url column
    when any hit has a url."""
    sources = any(h.source_path for h in hits)
    urls = any(getattr(h, "url", None) for h in hits)
    header = (
        ["rank", "score", "key"] + (["source"] if sources else []) + (["url"] if urls else []) + ["caption"]
    )
    rows = [
        [str(h.rank), f"{h.score:.4f}", str(h.key)]
        + ([h.source_path or "-"] if sources else [])
        + ([h.url or "-"] if urls else [])
        + [h.caption]
        for h in hits
    ]
    widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header) - 1)]
    numbers = 2  # rank and score: right-aligned

    def line(cells: list[str]) -> str:
        padded = [c.rjust(w) if i < numbers else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(padded + [cells[-1]]).rstrip()

    return "\n".join(line(r) for r in [header] + rows)
