"""clip-retrieval's back-end protocol, beside ``mmalign serve``'s own routes.

clip-retrieval's ``ClipClient`` and its front-end (clip-front) speak to a "back" with three
routes; ``mmalign serve`` answers them with the same shapes:

    GET  /indices-list   -> ["name", ...]  (the ``--index NAME=DIR`` names, first = default)
    POST /knn-service    {text | image (base64) | image_url | embedding_input, modality,
                          num_images, num_result_ids, indice_name, deduplicate, ...}
                         -> [{"id", "similarity", "caption", "url", ...}, ...]
    POST /metadata       {ids, indice_name} -> [{"id", "metadata": {"caption", "url", ...}}, ...]

``id`` is the row of the index's metadata (what ``/metadata`` takes back); ``similarity``
the inner product of the query with the row's vector.  ``modality`` is the index searched
(``image`` or ``text``: our ``against``).  ``num_result_ids`` results are returned, the first
``num_images`` of them with their metadata (the front asks for 3000 ids and the metadata of 40,
then the rest through ``/metadata`` as the user scrolls).  Metadata is every column the
shards' ``.json`` carried (img2dataset's ``url``, ``caption``, ``width``, ...), plus ``key``
and ``source_path``; the server's own bookkeeping (the shard file and offset, the raw json)
is left out, and so is a column that is null for the row (the front tests a field's
presence, e.g. ``url`` before ``image``).

Requests for more than ``--max-k`` results are clamped to it, not refused, and the reply's
``X-Mmalign-Clamped`` header says so; clip-retrieval's options this server does not implement
(``use_mclip``, ``use_safety_model``, ``use_violence_detector``, ``aesthetic_score``,
``aesthetic_weight``, and any other unknown field) are accepted, ignored, and named in
``X-Mmalign-Ignored`` when set.  ``deduplicate`` drops near-duplicate images as
clip-retrieval's back does (against the image index: results whose stored vectors have a
cosine of at least ``NEAR_DUPLICATE`` are linked, chains included, and only the best of each
group is kept, so fewer than ``num_result_ids`` may come back); against the text index it
folds identical captions, as our ``dedupe`` does.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mmalign.errors import UsageError
from mmalign.search.serve_origin import Refused

QUERY_FIELDS = ("text", "image", "image_url", "embedding_input")
KNOWN = set(QUERY_FIELDS) | {
    "modality",
    "num_images",
    "num_result_ids",
    "indice_name",
    "deduplicate",
}
# columns of our own bookkeeping, not the shards' metadata: where the image is, the raw json
INTERNAL = ("file", "offset", "json", "caption_index")
NEAR_DUPLICATE = 0.94  # clip-retrieval's cosine above which two results are one image


@dataclass
class KnnQuery:
    index: str  # the indice_name (resolved to a served index)
    kind: str  # one of QUERY_FIELDS
    value: Any  # the text, the image's bytes, the URL, or the (1, D) float32 vector
    modality: str  # the index searched: image or text
    num_result_ids: int
    num_images: int
    dedupe: bool
    clamped: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)


def _json_body(body: bytes) -> dict:
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        raise UsageError(f"the body is not JSON ({str(e)[:100]})") from None
    if not isinstance(data, dict):
        raise UsageError("the body must be a JSON object")
    return data


def _count(data: dict, name: str, default: int) -> int:
    value = data.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise UsageError(f"{name} must be a positive integer")
    try:
        number = int(value)
    except ValueError:
        raise UsageError(f"{name} must be a positive integer, not {str(value)[:40]!r}") from None
    if number < 1 or number != float(value):
        raise UsageError(f"{name} must be a positive integer, not {str(value)[:40]}")
    return number


def index_name(data: dict, names: list[str]) -> str:
    """The request's ``indice_name`` (absent or null: the first index); unknown -> 404."""
    name = data.get("indice_name")
    if name is None or name == "":
        return names[0]
    if not isinstance(name, str) or name not in names:
        raise Refused(404, f"no index named {str(name)[:100]!r} (have {', '.join(names)})")
    return name


def _flag(value) -> bool:
    if isinstance(value, str):
        return value.lower() in ("true", "1", "yes")
    return bool(value)


def parse_knn(body: bytes, dims: dict[str, int], max_k: int) -> KnnQuery:
    """A ``/knn-service`` body -> the query, its bounds clamped to ``max_k``; one-line errors.
    ``dims``: each served index's name -> its vector dimension (the first is the default)."""
    data = _json_body(body)
    name = index_name(data, list(dims))
    given = [f for f in QUERY_FIELDS if data.get(f) not in (None, "", [])]
    if len(given) != 1:
        got = f"got {', '.join(given)}" if given else "got none"
        raise UsageError(f"give exactly one of text, image, image_url, embedding_input ({got})")
    kind, value = given[0], data[given[0]]
    if kind == "embedding_input":
        value = _embedding(value, dims[name])
    elif not isinstance(value, str):
        raise UsageError(f"{kind} must be a string")
    elif kind == "image":
        try:
            value = base64.b64decode(
                value.split(",", 1)[-1] if value.startswith("data:") else value, validate=True
            )
        except (binascii.Error, ValueError):
            raise UsageError("image must be base64 (the image file's bytes)") from None
    modality = data.get("modality") or "image"
    if modality not in ("image", "text"):
        raise UsageError(f"modality must be image or text, not {str(modality)[:40]!r}")
    asked_images = _count(data, "num_images", 40)
    asked_ids = _count(data, "num_result_ids", asked_images)
    query = KnnQuery(
        index=name,
        kind=kind,
        value=value,
        modality=modality,
        num_result_ids=min(asked_ids, max_k),
        num_images=min(asked_images, max_k),
        dedupe=_flag(data.get("deduplicate", False)),
    )
    for name, asked in (("num_result_ids", asked_ids), ("num_images", asked_images)):
        if asked > max_k:
            query.clamped.append(f"{name} {asked} -> {max_k}")
    query.ignored = sorted(
        _header_safe(str(k)[:40])
        for k, v in data.items()
        if k not in KNOWN and v not in (None, False, "", 0, [])
    )
    return query


def _header_safe(text: str) -> str:
    """A client's field name as header text: printable ASCII only (no line breaks, no latin-1 errors)."""
    return "".join(c if " " <= c <= "~" and c != "," else "?" for c in text)


def _embedding(value, dim: int) -> np.ndarray:
    if not isinstance(value, list) or not all(
        isinstance(v, (int, float)) and not isinstance(v, bool) for v in value
    ):
        raise UsageError("embedding_input must be a list of numbers")
    if len(value) != dim:
        raise UsageError(f"embedding_input has {len(value)} numbers; this index's dimension is {dim}")
    wide = np.asarray(value, dtype=np.float64)  # (D,) checked before the float32 cast can overflow
    if not np.isfinite(wide).all() or np.abs(wide).max() > np.finfo(np.float32).max:
        raise UsageError("embedding_input must hold finite numbers (float32 range)")
    return wide.astype(np.float32)[None]  # (1, D)


def parse_metadata(body: bytes, sizes: dict[str, int], max_ids: int) -> tuple[str, list[int], list[str]]:
    """A ``/metadata`` body -> (index, ids, clamped notes); ids past ``max_ids`` are dropped (said so).
    ``sizes``: each served index's name -> its metadata row count."""
    data = _json_body(body)
    name = index_name(data, list(sizes))
    rows = sizes[name]
    ids = data.get("ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UsageError("ids must be a list of integers (the id of each knn-service result)")
    bad = next((i for i in ids if not 0 <= i < rows), None)
    if bad is not None:
        raise UsageError(f"id {bad} is not a row of this index (0..{rows - 1})")
    clamped = [f"ids {len(ids)} -> {max_ids}"] if len(ids) > max_ids else []
    return name, ids[:max_ids], clamped


def _plain(value):
    """A metadata value as JSON: numpy scalars as Python numbers, bytes as text; None for null/NaN."""
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, bytes):
        value = value.decode("utf-8", "replace")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, (list, dict, tuple, np.ndarray)):
        return json.dumps(value.tolist() if isinstance(value, np.ndarray) else value, default=str)
    return value


def row_metadata(searcher, rows: list[int]) -> list[dict]:
    """Each row's metadata for clip-retrieval's answers: the shards' columns, null ones left out.

    The fields of a row's raw ``json`` column fill in columns an older index did not split out."""
    records = searcher.metadata(list(rows))
    out = []
    for record in records:
        raw = record.get("json")
        extra = {}
        if isinstance(raw, str) and raw:
            try:
                parsed = json.loads(raw)
                extra = parsed if isinstance(parsed, dict) else {}
            except ValueError:
                pass
        meta = {}
        for source in (record, extra):
            for name, value in source.items():
                if name in INTERNAL or name in meta:
                    continue
                value = _plain(value)
                if value is not None:
                    meta[str(name)] = value
        out.append(meta)
    return out


def knn_results(rows: list[int], scores: list[float], metas: list[dict], num_images: int) -> list[dict]:
    """Results (best first) -> clip-retrieval's list; the first ``num_images`` carry metadata."""
    results = []
    for i, (row, score) in enumerate(zip(rows, scores)):
        item = dict(metas[i]) if i < num_images else {}
        item["id"] = int(row)
        item["similarity"] = float(score)
        results.append(item)
    return results


def distinct(vectors: np.ndarray, threshold: float = NEAR_DUPLICATE) -> np.ndarray:
    """(n, D) result vectors, best first -> (n,) bool, True for the best of each group of results
    linked by a cosine >= ``threshold`` (a chain a~b~c is one group even when a !~ c)."""
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # (n, D)
    linked = np.argwhere(np.triu(unit @ unit.T >= threshold, k=1))  # (pairs, 2) i < j
    parent = np.arange(len(vectors))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = int(parent[i])
        return i

    for i, j in linked:
        a, b = root(int(i)), root(int(j))
        parent[max(a, b)] = min(a, b)  # a group's root is its best-scoring result
    return np.array([root(i) == i for i in range(len(vectors))], dtype=bool)


def distinct_images(searcher, vectors: np.ndarray, n: int) -> tuple[list[int], list[float]]:
    """The top ``n`` of the image index for one query (1, D), near-duplicates dropped: (rows, scores)."""
    if "image" not in searcher.indexes:
        raise UsageError("modality image: this index has no image index")
    index = searcher.indexes["image"]
    fetch = min(int(n), int(index.ntotal))
    if fetch == 0:
        return [], []
    scores, positions = index.search(np.ascontiguousarray(vectors, dtype=np.float32), fetch)  # (1, n) each
    found = positions[0] >= 0
    scores, positions = scores[0][found], positions[0][found]
    stored = np.stack([np.asarray(index.reconstruct(int(p)), dtype=np.float32) for p in positions])
    keep = distinct(stored)  # (n,)
    return index.row_of(positions[keep]).tolist(), scores[keep].tolist()


def notes(clamped: list[str], ignored: list[str]) -> dict:
    """The reply headers that say what was clamped and what was ignored."""
    headers = {}
    if clamped:
        headers["X-Mmalign-Clamped"] = "; ".join(clamped) + " (the server's --max-k)"
    if ignored:
        headers["X-Mmalign-Ignored"] = ", ".join(ignored) + " (not implemented by mmalign serve)"
    return headers
