"""Search results a user can use: hits name their source file, searches against the
captions fold identical captions (a naive full sort is the reference), older indexes
still load, and the server shows all of it (JSON, thumbnails from the shards, one
access-log line per request)."""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
import torch
from PIL import Image

import mmalign
from mmalign.cli import main
from mmalign.data.shards import read_samples
from mmalign.search.searcher import ImageUnavailable, Searcher, format_hits
from mmalign.search.serve import make_server
from mmalign.search.serve_origin import is_loopback
from tests.harness.searchdata import CLASSES, PER_CLASS, TEMPLATES, build_corpus, serve_corpus
from tests.harness.searchindex import read_index_metadata


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("usable"))


def _stored_text(emb) -> np.ndarray:
    files = sorted((emb / "text_emb").glob("*.npy"), key=lambda p: int(p.stem.rsplit("_", 1)[1]))
    x = np.concatenate([np.load(f) for f in files]).astype(np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)  # (rows, D)


def _naive(vectors: np.ndarray, captions: list[str], query: np.ndarray, k: int, dedupe: bool):
    """Every row scored in float64, sorted best first; with ``dedupe`` the first row of each caption."""
    q = np.asarray(query, dtype=np.float64)
    scores = vectors @ (q / np.linalg.norm(q))  # (rows,)
    out, seen = [], set()
    for i in sorted(range(len(scores)), key=lambda i: -scores[i]):
        if dedupe and captions[i] in seen:
            continue
        seen.add(captions[i])
        out.append((captions[i], float(scores[i])))
    return out[:k]


OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local server: never via a proxy


def _get(url: str):
    with OPENER.open(url, timeout=10) as r:
        return r.status, r.headers, r.read()


def _status(url: str, data: bytes | None = None) -> int:
    try:
        with OPENER.open(urllib.request.Request(url, data=data), timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_hits_carry_the_source_path(corpus, capsys):
    searcher = Searcher(corpus["idx"], corpus["model"])
    # the shards' own .json (read independently) ties each key to its source file
    source_of = {
        s["key"]: s["json"]["source_path"]
        for s in read_samples(sorted(str(p) for p in corpus["shards"].glob("*.tar")))
    }
    assert sorted(source_of.values()) == sorted(corpus["colours"])
    hits = searcher.text("a photo of a cat", k=len(source_of))
    assert len(hits) == len(CLASSES) * PER_CLASS
    for h in hits:
        assert h.source_path == source_of[h.key]
        assert h.caption == TEMPLATES[0].format(c=h.source_path.split("/")[0])  # the right sample's caption
    text_hits = searcher.text("a photo of a cat", k=5, against="text")
    assert all(h.source_path == source_of[h.key] for h in text_hits)
    table = format_hits(hits)
    assert table.splitlines()[0].split() == ["rank", "score", "key", "source", "caption"]
    assert all(h.source_path in line for h, line in zip(hits, table.splitlines()[1:]))
    assert (
        main(
            [
                "search",
                "--index",
                str(corpus["idx"]),
                "--model",
                corpus["model"],
                "--text",
                "a dog",
                "-k",
                "3",
            ]
        )
        == 0
    )
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 3 and all(row.split()[3] in corpus["colours"] for row in rows)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dedupe_against_a_naive_full_sort(corpus, seed):
    searcher = Searcher(corpus["idx"])
    meta = read_index_metadata(corpus["idx"])
    vectors, captions = _stored_text(corpus["emb"]), list(meta["caption"])
    n_distinct = len(set(captions))
    assert n_distinct == len(CLASSES) * len(TEMPLATES) and len(captions) == n_distinct * PER_CLASS
    query = np.random.default_rng(seed).standard_normal((1, vectors.shape[1])).astype(np.float32)
    query /= np.linalg.norm(query)
    raw = _naive(vectors, captions, query[0], PER_CLASS, dedupe=False)
    # identical captions embed identically: the raw top PER_CLASS rows are copies of one caption,
    # so a de-duplicated top k > 1 must look past them
    assert len({c for c, _ in raw}) == 1
    for k in (1, 2, PER_CLASS, n_distinct, n_distinct + 3):
        hits = searcher.search_vectors(query, k, "text")[0]
        want = _naive(vectors, captions, query[0], k, dedupe=True)
        assert [h.caption for h in hits] == [c for c, _ in want]
        assert [h.rank for h in hits] == list(range(1, len(want) + 1))
        assert [h.score for h in hits] == pytest.approx([s for _, s in want], abs=1e-5)
        kept = searcher.search_vectors(query, k, "text", dedupe=False)[0]
        want = _naive(vectors, captions, query[0], k, dedupe=False)
        assert len(kept) == len(want) == min(k, len(captions))
        assert [h.caption for h in kept] == [c for c, _ in want]
        assert [h.score for h in kept] == pytest.approx([s for _, s in want], abs=1e-5)
    # the image index holds each image once: dedupe leaves it alone (two images can share a caption)
    image_hits = searcher.search_vectors(query, 5, "image")[0]
    assert len(image_hits) == 5 and len({h.caption for h in image_hits}) < 5


def test_image_to_text_dedupes_by_default_and_no_dedupe_keeps_copies(corpus, capsys):
    image = corpus["root"] / "src" / "cat" / "0001.png"
    loaded = mmalign.load(corpus["model"])  # the query embedded by the public API, independently
    with torch.no_grad():
        query = loaded.encode_image(loaded.preprocess(Image.open(image)).unsqueeze(0)).numpy()
    meta = read_index_metadata(corpus["idx"])
    vectors, captions = _stored_text(corpus["emb"]), list(meta["caption"])
    hits = Searcher(corpus["idx"], corpus["model"]).image(str(image), k=4, against="text")
    want = _naive(vectors, captions, query[0], 4, dedupe=True)
    assert [h.caption for h in hits] == [c for c, _ in want] and len(set(h.caption for h in hits)) == 4
    assert [h.score for h in hits] == pytest.approx([s for _, s in want], abs=1e-4)
    args = [
        "search",
        "--index",
        str(corpus["idx"]),
        "--model",
        corpus["model"],
        "--image",
        str(image),
        "--against",
        "text",
        "-k",
        "4",
    ]
    captions_out = []
    for extra in ([], ["--no-dedupe"]):
        assert main(args + extra) == 0
        rows = capsys.readouterr().out.splitlines()[1:]
        captions_out.append([" ".join(row.split()[4:]) for row in rows])
    assert captions_out[0] == [c for c, _ in want]
    assert captions_out[1] == [c for c, _ in _naive(vectors, captions, query[0], 4, dedupe=False)]
    assert len(set(captions_out[1])) == 1  # the four copies of the best caption


def test_an_index_from_before_source_paths_still_loads(corpus, tmp_path):
    old = tmp_path / "old_idx"
    shutil.copytree(corpus["idx"], old)
    meta = read_index_metadata(old)
    (old / "metadata.arrow").unlink()  # an old index: its metadata in parquet only
    meta[["key", "caption", "caption_index", "json"]].to_parquet(old / "metadata.parquet", index=False)
    searcher = Searcher(old, corpus["model"])
    hits = searcher.text("a photo of a bird", k=3)
    # the .json column still names the source (shards made by `mmalign shards`) ...
    assert all(h.source_path == json.loads(meta.at[h.row, "json"])["source_path"] for h in hits)
    with pytest.raises(ImageUnavailable, match="re-run `mmalign embed`"):
        searcher.image_bytes(hits[0].row, 1 << 20)
    # ... and without it a hit has no source and the table no source column
    meta["json"] = "{}"
    meta[["key", "caption", "caption_index", "json"]].to_parquet(old / "metadata.parquet", index=False)
    hits = Searcher(old, corpus["model"]).text("a photo of a bird", k=3)
    assert [h.source_path for h in hits] == [None] * 3
    assert format_hits(hits).splitlines()[0].split() == ["rank", "score", "key", "caption"]


def test_an_image_folder_embedding_knows_its_files(corpus, tmp_path):
    assert (
        main(
            [
                "embed",
                "--model",
                corpus["model"],
                "--data",
                str(corpus["root"] / "src"),
                "--out",
                str(tmp_path / "emb"),
            ]
        )
        == 0
    )
    assert main(["index", "--emb", str(tmp_path / "emb"), "--out", str(tmp_path / "idx")]) == 0
    searcher = Searcher(tmp_path / "idx")
    hits = searcher.search_vectors(np.ones((1, searcher.dim), np.float32), 12, "image")[0]
    assert sorted(h.source_path for h in hits) == sorted(corpus["colours"])
    for h in hits[:3]:
        assert searcher.image_bytes(h.row, 1 << 20) == (corpus["root"] / "src" / h.source_path).read_bytes()
    with pytest.raises(ImageUnavailable, match="over 10 bytes"):
        searcher.image_bytes(hits[0].row, 10)


@pytest.fixture(scope="module")
def served(corpus):
    yield from serve_corpus(corpus)


@pytest.fixture
def quiet_server(corpus):
    """A server of its own: a shared one may still log an earlier test's request (a line is
    written after its reply is sent, so the client can be done first)."""
    yield from serve_corpus(corpus)


def test_server_shows_sources_dedupes_and_serves_thumbnails(corpus, served):
    base = served.base
    status, _, body = _get(f"{base}/search?text=a+photo+of+a+cat&k=4&against=text")
    hits = json.loads(body)["hits"]
    assert status == 200 and len({h["caption"] for h in hits}) == 4
    assert all(h["source_path"] in corpus["colours"] for h in hits)
    kept = json.loads(_get(f"{base}/search?text=a+photo+of+a+cat&k=4&against=text&dedupe=false")[2])["hits"]
    assert len({h["caption"] for h in kept}) == 1 and kept[0]["caption"] == hits[0]["caption"]
    image = (corpus["root"] / "src" / "dog" / "0002.png").read_bytes()
    req = urllib.request.Request(f"{base}/search?k=3&against=text", data=image, method="POST")
    with OPENER.open(req, timeout=10) as r:
        assert len({h["caption"] for h in json.loads(r.read())["hits"]}) == 3
    assert _status(f"{base}/search?text=a&dedupe=maybe") == 400
    # thumbnails: the hit's own image, read back from its shard, at most `size` pixels a side
    for hit in json.loads(_get(f"{base}/search?text=a+photo+of+a+cat&k=12")[2])["hits"]:
        status, headers, body = _get(f"{base}/thumb?row={hit['row']}&size=24")
        thumb = Image.open(io.BytesIO(body))
        assert status == 200 and headers["Content-Type"] == "image/jpeg" and thumb.format == "JPEG"
        assert max(thumb.size) <= 24
        mean = np.asarray(thumb.convert("RGB"), dtype=np.float64).mean(axis=(0, 1))
        assert np.abs(mean - corpus["colours"][hit["source_path"]]).max() <= 8  # solid colour, via JPEG twice
    assert _status(f"{base}/thumb?row=0&size=1000") == 400
    assert _status(f"{base}/thumb?row=999999") == 400
    assert _status(f"{base}/thumb?row=x") == 400
    # the page: self-contained (inline script, nothing from elsewhere)
    status, headers, body = _get(f"{base}/")
    page = body.decode()
    assert status == 200 and headers["Content-Type"].startswith("text/html")
    assert "default-src 'none'" in headers["Content-Security-Policy"]
    assert 'id="q"' in page and "/search?" in page and "/thumb?row=" in page
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)


def test_one_access_log_line_per_request(quiet_server):
    served = quiet_server
    before = len(served.lines)

    def logged(n: int) -> None:
        # a line is written once its reply is sent: the client may be first, and its next
        # request's line could come before this one's; wait for it
        deadline = time.monotonic() + 5
        while len(served.lines) < before + n and time.monotonic() < deadline:
            time.sleep(0.01)

    assert _status(f"{served.base}/health") == 200
    logged(1)
    assert _status(f"{served.base}/nowhere") == 404
    logged(2)
    assert _status(f"{served.base}/search?k=1", data=b"not an image") == 400
    logged(3)
    with socket.create_connection(served.server_address, timeout=5) as s:  # a forged log line in the path
        s.sendall(b"GET /health\x1b[2J HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        s.recv(4096)
    logged(4)
    new = served.lines[before:]
    pattern = r"127\.0\.0\.1 (GET|POST) (\S+) (\d{3}) \d+\.\d ms"
    assert [re.fullmatch(pattern, line).group(1, 2, 3) for line in new] == [
        ("GET", "/health", "200"),
        ("GET", "/nowhere", "404"),
        ("POST", "/search?k=1", "400"),
        ("GET", "/health?[2J", "404"),
    ]


def test_thumbnails_only_for_loopback_clients(corpus):
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("192.0.2.7") and not is_loopback("not an address")
    try:  # a non-loopback address of this machine, if it has one
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.connect(("192.0.2.1", 9))  # no packet is sent: this only picks the outgoing interface
        address = udp.getsockname()[0]
        udp.close()
    except OSError:
        address = "127.0.0.1"
    if address.startswith("127."):
        pytest.skip("this machine has no non-loopback IPv4 address to connect from")
    srv = make_server(Searcher(corpus["idx"]), "0.0.0.0", 0, access_log=lambda line: None)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    try:
        port = srv.server_address[1]
        assert _status(f"http://127.0.0.1:{port}/thumb?row=0") == 200
        assert _status(f"http://{address}:{port}/thumb?row=0") == 403
        assert _status(f"http://{address}:{port}/health") == 200
    finally:
        srv.shutdown()
        srv.server_close()


def test_serve_help_documents_the_routes(capsys):
    with pytest.raises(SystemExit) as done:
        main(["serve", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    for needle in (
        "GET  /health",
        "POST /search",
        "against=image|text",
        "dedupe=false",
        "GET  /thumb",
        "access-log line",
        "(default: 127.0.0.1)",
    ):
        assert needle in out, needle


def test_hit_meta_holds_the_other_columns_but_not_the_image_location(corpus):
    searcher = Searcher(corpus["idx"], corpus["model"])
    hit = searcher.text("a photo of a bird", k=1)[0]
    frame = read_index_metadata(corpus["idx"])  # the reference: pandas' reading
    want = frame.iloc[hit.row]
    assert {"file", "offset"} <= set(frame.columns) and {"file", "offset"} <= set(
        searcher.metadata([hit.row])[0]
    )
    own = {"key", "caption", "source_path", "url", "file", "offset"}
    assert set(hit.meta) == set(frame.columns) - own  # the image's place on this machine is not sent
    assert hit.meta["caption_index"] == int(want["caption_index"]) and hit.meta["json"] == want["json"]
    assert (hit.key, hit.caption, hit.source_path) == (want["key"], want["caption"], want["source_path"])
    searcher.close()
