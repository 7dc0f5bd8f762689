"""``GET /search?key=K``: "more like this" queries by an indexed item's key, answered from the
index's own vectors (no model), over an exact and an IVF-PQ index of synthetic embeddings."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import numpy as np
import pandas as pd
import pytest

from mmalign.search.embed import EMBED_INFO
from mmalign.search.index import build_index
from mmalign.search.searcher import Searcher
from mmalign.search.serve import make_server
from mmalign.search.serve_key import key_vector

IMAGES, CAPTIONS, DIM = 64, 2, 8
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local server: never via a proxy


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _embeddings(root, seed: int = 0) -> np.ndarray:
    """An ``mmalign embed``-shaped directory: IMAGES images, CAPTIONS rows each; returns (IMAGES, DIM)."""
    rng = np.random.default_rng(seed)
    images = _unit(rng.standard_normal((IMAGES, DIM))).astype(np.float32)
    rows = np.repeat(images, CAPTIONS, axis=0)  # (IMAGES * CAPTIONS, DIM): each image once per caption row
    texts = _unit(rows + 0.1 * rng.standard_normal(rows.shape)).astype(np.float32)
    for sub in ("img_emb", "text_emb", "metadata"):
        (root / sub).mkdir(parents=True)
    np.save(root / "img_emb" / "img_emb_0.npy", rows.astype(np.float16))
    np.save(root / "text_emb" / "text_emb_0.npy", texts.astype(np.float16))
    pd.DataFrame(
        {
            "key": [f"item_{i // CAPTIONS:03d}" for i in range(len(rows))],
            "caption": [f"caption {i // CAPTIONS} #{i % CAPTIONS}" for i in range(len(rows))],
            "caption_index": [i % CAPTIONS for i in range(len(rows))],
            "json": ["{}"] * len(rows),
        }
    ).to_parquet(root / "metadata" / "metadata_0.parquet", index=False)
    (root / EMBED_INFO).write_text(json.dumps({"dim": DIM, "parts": 1, "text": True, "rows": len(rows)}))
    return images


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("keys")
    images = _embeddings(root / "emb")
    build_index(root / "emb", root / "flat")
    build_index(root / "emb", root / "ivf", exact_max=10, pq_m=DIM, nbits=4, nprobe=64)  # 16 levels a dim
    return {"images": images, "flat": root / "flat", "ivf": root / "ivf"}


@pytest.fixture
def served(corpus):
    srv = make_server(Searcher(corpus["flat"]), "127.0.0.1", 0, max_k=20, access_log=lambda line: None)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def _get(url: str) -> tuple[int, dict]:
    try:
        with OPENER.open(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.mark.parametrize("kind", ["flat", "ivf"])
def test_key_vector_is_the_items_stored_image_vector(corpus, kind):
    searcher = Searcher(corpus[kind])
    vector = key_vector(searcher, "item_017")
    assert vector.shape == (DIM,) and vector.dtype == np.float32
    cosine = float(vector @ corpus["images"][17])
    # exact: the stored float16 vector; IVF-PQ: its decoded code, still nearer than any other image
    assert cosine > (0.999 if kind == "flat" else 0.95)
    assert int(np.argmax(corpus["images"] @ vector)) == 17
    assert key_vector(searcher, "item_999") is None


def test_more_like_this_by_key(corpus, served):
    status, body = _get(f"{served.base}/search?key=item_017&k=5")
    assert status == 200 and body["key"] == "item_017"
    hits = body["hits"]
    assert [h["rank"] for h in hits] == [1, 2, 3, 4, 5]
    assert hits[0]["key"] == "item_017" and hits[0]["score"] == pytest.approx(1.0, abs=1e-3)
    # the rest are the item's nearest images, in order
    order = np.argsort(-(corpus["images"] @ corpus["images"][17]))[:5]
    assert [h["key"] for h in hits] == [f"item_{i:03d}" for i in order]
    # against the captions: the item's own captions first (de-duplicated: distinct ones)
    status, body = _get(f"{served.base}/search?key=item_017&k=3&against=text")
    assert status == 200 and body["hits"][0]["caption"].startswith("caption 17 #")
    assert len({h["caption"] for h in body["hits"]}) == 3


def test_bad_key_queries_are_one_line_errors(served):
    assert _get(f"{served.base}/search?key=nobody&k=5") == (
        404,
        {"error": "no indexed image has key 'nobody'"},
    )
    status, body = _get(f"{served.base}/search?key=item_001&text=a+cat")
    assert status == 400 and "not both" in body["error"]
    status, body = _get(f"{served.base}/search?key=&k=5")
    assert status == 400 and "key must be" in body["error"]
    status, body = _get(f"{served.base}/search?key=item_001&k=21")
    assert status == 400 and "k must be in [1, 20]" in body["error"]
