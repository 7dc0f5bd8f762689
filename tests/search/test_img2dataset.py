"""Sources kept, end to end with img2dataset itself: generated images served by a local HTTP server,
downloaded into webdataset shards by ``img2dataset``, then ``mmalign embed`` -> ``index`` ->
the Searcher, ``mmalign search`` and ``mmalign serve``: a hit's ``url`` is its source URL on the
server, and img2dataset's other fields (status, width, ...) come along as metadata.

The reference is what this file served and wrote into the url list: img2dataset names each
sample by its row in the list (``000000003`` for row 3), so a hit's key gives the URL it must
carry, and the image file's size gives its ``original_width`` / ``original_height``.
"""

from __future__ import annotations

import functools
import http.server
import json
import os
import subprocess
import threading
import urllib.request
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from mmalign.cli import main
from tests.harness import ROOT, cli_main
from tests.harness.searchdata import save_random_model

IMG2DATASET = ROOT / ".venv-tools/bin/img2dataset"
N_IMAGES = 12
SIZE = 32  # img2dataset's --image_size

pytestmark = pytest.mark.integration


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # no line per request on the test's stderr
        pass


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``N_IMAGES`` PNG / JPEG images of different sizes on a local server; yields the url list."""
    root = tmp_path_factory.mktemp("served")
    rng = np.random.default_rng(3)
    sizes = {}
    for i in range(N_IMAGES):
        name = f"img{i}.{'png' if i % 2 else 'jpg'}"
        w, h = 40 + 2 * i, 36 + i
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name)
        sizes[name] = (w, h)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield {
            "urls": [f"{base}/{name}" for name in sizes],
            "captions": [f"picture number {i}" for i in range(N_IMAGES)],
            "sizes": list(sizes.values()),
            "base": base,
        }
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def built(served, tmp_path_factory):
    """img2dataset's shards -> embeddings -> an index, with a random micro model."""
    if not IMG2DATASET.is_file():
        pytest.skip(f"img2dataset is not installed at {IMG2DATASET} (make install: the field's tools)")
    root = tmp_path_factory.mktemp("i2d")
    pd.DataFrame({"url": served["urls"], "caption": served["captions"]}).to_parquet(root / "urls.parquet")
    cmd = [str(IMG2DATASET), "--url_list", str(root / "urls.parquet"), "--input_format", "parquet"]
    cmd += ["--url_col", "url", "--caption_col", "caption", "--output_format", "webdataset"]
    cmd += ["--output_folder", str(root / "shards"), "--image_size", str(SIZE)]
    cmd += ["--processes_count", "1", "--thread_count", "4", "--enable_wandb", "False"]
    env = {**os.environ, "NO_ALBUMENTATIONS_UPDATE": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=root)
    assert run.returncode == 0, run.stderr[-3000:]
    assert sorted(p.name for p in (root / "shards").glob("*.tar")) == ["00000.tar"], run.stderr[-3000:]
    model = save_random_model(root / "model", seed=8)
    emb, idx = root / "emb", root / "idx"
    assert main(["embed", "--model", model, "--data", str(root / "shards"), "--out", str(emb)]) == 0
    assert main(["index", "--emb", str(emb), "--out", str(idx)]) == 0
    return {"model": model, "emb": emb, "idx": idx}


def _expected_url(served, key: str) -> str:
    return served["urls"][int(key)]  # img2dataset's key: the row in the url list


def test_embed_keeps_img2dataset_fields_as_columns(served, built):
    meta = pd.read_parquet(built["emb"] / "metadata" / "metadata_0.parquet")
    assert len(meta) == N_IMAGES
    for column in ("url", "status", "error_message", "width", "height", "original_width", "original_height"):
        assert column in meta.columns, column
    assert {"exif", "sha256"} <= set(meta.columns)
    for _, row in meta.iterrows():
        i = int(row["key"])
        assert row["url"] == served["urls"][i] and row["caption"] == served["captions"][i]
        assert row["status"] == "success" and row["width"] == SIZE and row["height"] == SIZE
        assert (row["original_width"], row["original_height"]) == served["sizes"][i]
        assert pd.isna(row["source_path"])  # img2dataset writes no source_path: the url is the source


def test_a_hit_carries_its_source_url(served, built):
    from mmalign.search.searcher import Searcher

    searcher = Searcher(built["idx"], built["model"])
    hits = searcher.text("picture number 3", k=N_IMAGES)
    assert len(hits) == N_IMAGES
    for hit in hits:
        assert hit.url == _expected_url(served, hit.key), hit
        assert hit.meta["status"] == "success" and hit.meta["width"] == SIZE
        assert (hit.meta["original_width"], hit.meta["original_height"]) == served["sizes"][int(hit.key)]
    assert {h.url for h in hits} == set(served["urls"])


def test_mmalign_search_prints_the_url(served, built):
    run = cli_main(
        "search", "--index", built["idx"], "--model", built["model"], "--text", "picture", "-k", "3"
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    assert "url" in lines[0].split()
    for line in lines[1:]:
        key = line.split()[2]
        assert _expected_url(served, key) in line, line


def test_served_hits_carry_the_url(served, built):
    from mmalign.search.searcher import Searcher
    from mmalign.search.serve import make_server

    server = make_server(Searcher(built["idx"], built["model"]), "127.0.0.1", 0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with urllib.request.urlopen(f"{base}/search?text=picture+number+5&k=4", timeout=30) as r:
            hits = json.loads(r.read())["hits"]
        assert len(hits) == 4
        for hit in hits:
            assert hit["url"] == _expected_url(served, hit["key"])
        body = json.dumps({"text": "picture number 5", "modality": "image", "num_images": 4}).encode()
        request = urllib.request.Request(f"{base}/knn-service", data=body, method="POST")
        with urllib.request.urlopen(request, timeout=30) as r:
            results = json.loads(r.read())
        assert [r["url"] for r in results] == [h["url"] for h in hits]  # clip-retrieval's response too
    finally:
        server.shutdown()
        server.server_close()


def test_the_shards_are_img2datasets(built):
    """Guard: the shards came from img2dataset (its stats file beside them), not from a fallback."""
    stats = json.loads(next(Path(built["emb"]).parent.glob("shards/*_stats.json")).read_text())
    assert stats["successes"] == N_IMAGES
