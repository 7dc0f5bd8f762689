"""clip-retrieval's routes on ``mmalign serve``'s handler: ``/knn-service`` and ``/metadata``.

The protocol (parsing, clamping, result shapes) is :mod:`mmalign.search.serve_knn`; this is
the part that runs a request: embed the query with the server's model (the text, the image,
or the image an allowed ``image_url`` points at), search the named index, attach each
shown row's metadata, and for a local client a thumbnail where the row has no ``url``.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

from mmalign.errors import UsageError, UserError
from mmalign.search.serve_fetch import fetch
from mmalign.search.serve_images import query_image, thumbnail
from mmalign.search.serve_knn import (
    distinct_images,
    knn_results,
    notes,
    parse_knn,
    parse_metadata,
    row_metadata,
)
from mmalign.search.serve_origin import Refused, is_loopback

KNN_THUMB = 128  # the side of the base64 thumbnail a knn result without a url carries (local clients)


class ClipRetrievalRoutes:
    """Mixed into the server's handler, whose attributes (searchers, encoder, bounds) it reads."""

    searchers: dict
    encoder: Any  # the Searcher that holds the model
    max_k: int
    max_text: int
    max_body: int
    max_pixels: int
    allow_urls: frozenset
    fetch_timeout: float
    client_address: Any
    _reply: Callable[..., None]

    def _knn(self, body: bytes) -> None:
        dims = {name: int(s.dim) for name, s in self.searchers.items()}
        query = parse_knn(body, dims, self.max_k)
        searcher = self.searchers[query.index]
        if query.kind == "embedding_input":
            vectors = query.value  # (1, D)
        elif query.kind == "text":
            if len(query.value) > self.max_text:
                raise UsageError(f"text must be 1..{self.max_text} characters")
            vectors = self.encoder.encode_text([query.value])
        else:
            data = query.value
            if query.kind == "image_url":
                data = fetch(data, self.allow_urls, self.max_body, self.fetch_timeout)
            vectors = self.encoder.encode_image([query_image(data, self.max_pixels, query.kind)])
        if query.dedupe and query.modality == "image":  # clip-retrieval's: near-duplicate images dropped
            rows, scores = distinct_images(searcher, vectors, query.num_result_ids)
        else:
            hits = searcher.search_vectors(vectors, query.num_result_ids, query.modality, query.dedupe)[0]
            rows, scores = [h.row for h in hits], [h.score for h in hits]
        shown = rows[: query.num_images]
        metas = self._with_images(searcher, shown, row_metadata(searcher, shown))
        results = knn_results(rows, scores, metas, query.num_images)
        self._reply(200, results, notes(query.clamped, query.ignored))

    def _metadata(self, body: bytes) -> None:
        data_rows = {name: int(s.num_rows) for name, s in self.searchers.items()}
        name, ids, clamped = parse_metadata(body, data_rows, self.max_k)
        searcher = self.searchers[name]
        metas = self._with_images(searcher, ids, row_metadata(searcher, ids))
        self._reply(200, [{"id": i, "metadata": m} for i, m in zip(ids, metas)], notes(clamped, []))

    def _with_images(self, searcher, rows: list[int], metas: list[dict]) -> list[dict]:
        """A row without a ``url`` carries its image as a base64 JPEG thumbnail (clip-front shows
        ``url``, else ``image``), for a loopback client only, as ``/thumb`` is."""
        if not is_loopback(str(self.client_address[0])):
            return metas
        for row, meta in zip(rows, metas):
            if "url" not in meta and "image" not in meta:
                try:
                    jpeg = thumbnail(searcher, row, KNN_THUMB, self.max_body, self.max_pixels)
                except (Refused, UserError):
                    continue  # no stored image (an index without locations): the caption alone
                meta["image"] = base64.b64encode(jpeg).decode("ascii")
        return metas
