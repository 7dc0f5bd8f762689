"""clip-retrieval's own client and front-end against ``mmalign serve`` (issue 41, point 1).

* ``ClipClient``, imported from its module file in the installed wheel (so its web-server
  dependencies are not needed), gets the same ids and scores from ``/knn-service`` as our
  ``/search`` answers for text, image and embedding queries (and the embedding query the
  brute-force top-k of the stored vectors), with every field of the shards' ``.json``.
* clip-front, the page shipped inside the wheel (``front/build``), served from another
  origin as clip-retrieval's own ``clip_front`` serves it (its ``config.json`` naming the
  back), loaded in headless Chromium against ``mmalign serve --cors``: a text query shows
  its result images, loaded from each hit's ``url``.

The corpus is shards written as img2dataset writes them (``.jpg``, ``.txt``, ``.json`` with
``url``), whose images a local HTTP server serves at those URLs.  Skips, saying why, when
clip-retrieval, ``requests`` or a Chromium binary is missing.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import io
import json
import tarfile
import threading
import urllib.parse
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmalign.cli import main
from tests.harness.chromium import browser_fixture
from tests.harness.searchdata import CLASSES, save_random_model

pytestmark = pytest.mark.integration  # real servers, a browser

PER_CLASS = 4
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local servers: never via a proxy


def _clip_retrieval_file(relative: str) -> Path:
    """A file of the installed clip-retrieval wheel, found without importing the package."""
    spec = importlib.util.find_spec("clip_retrieval")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("clip-retrieval is not installed (pip install --no-deps clip-retrieval==2.45.0)")
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.exists():
        pytest.skip(f"the installed clip-retrieval has no {relative}")
    return path


def _clip_client_module():
    pytest.importorskip("requests", reason="clip-retrieval's ClipClient posts with requests")
    path = _clip_retrieval_file("clip_client.py")
    spec = importlib.util.spec_from_file_location("clip_retrieval_clip_client", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, fmt, *args):
        pass


def _static(directory: Path, handler=_Quiet):
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(directory)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _jpeg(colour) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), colour).save(buf, format="JPEG", quality=95)
    return buf.getvalue()


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_url_shards(root: Path, image_base: str) -> list[dict]:
    """img2dataset's layout: 2 shards of ``KEY.jpg``, ``KEY.txt``, ``KEY.json`` (url, caption,
    status, sizes, sha256); each image also written to ``root/www`` (the web it came from)."""
    rng = np.random.default_rng(3)
    (root / "shards").mkdir()
    samples = []
    for i in range(len(CLASSES) * PER_CLASS):
        name = CLASSES[i % len(CLASSES)]
        jpeg = _jpeg(tuple(int(v) for v in rng.integers(0, 256, 3)))
        (root / "www" / f"{name}_{i:03d}.jpg").write_bytes(jpeg)
        caption = f"a photo of a {name}"
        samples.append(
            {
                "key": f"{i // 6:05d}{i % 6:04d}",
                "url": f"{image_base}/{name}_{i:03d}.jpg",
                "caption": caption,
                "status": "success",
                "error_message": None,
                "width": 32,
                "height": 32,
                "original_width": 32,
                "original_height": 32,
                "sha256": hashlib.sha256(jpeg).hexdigest(),
                "jpeg": jpeg,
            }
        )
    for shard in range(2):
        with tarfile.open(root / "shards" / f"{shard:05d}.tar", "w") as tar:
            for sample in samples[shard * 6 : shard * 6 + 6]:
                meta = {k: v for k, v in sample.items() if k != "jpeg"}
                _add(tar, f"{sample['key']}.jpg", sample["jpeg"])
                _add(tar, f"{sample['key']}.txt", sample["caption"].encode())
                _add(tar, f"{sample['key']}.json", json.dumps(meta).encode())
    return samples


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip_retrieval")
    (root / "www").mkdir()
    images = _static(root / "www")  # the "web" the shards' urls point at
    base = f"http://127.0.0.1:{images.server_address[1]}"
    samples = write_url_shards(root, base)
    model = save_random_model(root / "model", seed=5)
    assert main(["embed", "--model", model, "--data", str(root / "shards"), "--out", str(root / "emb")]) == 0
    assert main(["index", "--emb", str(root / "emb"), "--out", str(root / "idx")]) == 0
    yield {"root": root, "model": model, "samples": samples, "image_base": base}
    images.shutdown()
    images.server_close()


def _serve(corpus, **kwargs):
    from mmalign.search.searcher import Searcher
    from mmalign.search.serve import make_server

    srv = make_server(
        {"laion-like": Searcher(corpus["root"] / "idx", corpus["model"])},
        "127.0.0.1",
        0,
        access_log=lambda line: None,
        **kwargs,
    )
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    return srv


@pytest.fixture(scope="module")
def served(corpus):
    srv = _serve(corpus)
    yield srv
    srv.shutdown()
    srv.server_close()


def _get(url: str):
    with OPENER.open(url, timeout=30) as r:
        return json.loads(r.read())


def _post(url: str, data: bytes):
    with OPENER.open(urllib.request.Request(url, data=data, method="POST"), timeout=30) as r:
        return json.loads(r.read())


def _same(results: list[dict], hits: list[dict]) -> None:
    assert [r["id"] for r in results] == [h["row"] for h in hits]
    assert [r["similarity"] for r in results] == pytest.approx([h["score"] for h in hits], abs=1e-6)


def test_clip_client_gets_our_search_answers_for_text_image_and_embedding(served, corpus):
    clip_client = _clip_client_module()
    url = served.base + "/knn-service"
    images = clip_client.ClipClient(url, "laion-like", num_images=5, deduplicate=False)
    # text -> the image index
    got = images.query(text="a photo of a cat")
    _same(got, _get(f"{served.base}/search?text=a+photo+of+a+cat&k=5")["hits"])
    # every column the shards' .json carried comes with each result (ids are metadata rows)
    by_url = {s["url"]: s for s in corpus["samples"]}
    for result in got:
        sample = by_url[result["url"]]
        for field in ("caption", "status", "width", "height", "original_width", "sha256"):
            assert result[field] == sample[field], field
        assert "error_message" not in result  # null: left out, as clip-front tests presence
    # an image file (the client sends it base64) -> the same as POST /search with its bytes
    picked = corpus["root"] / "www" / Path(corpus["samples"][4]["url"]).name
    got = images.query(image=str(picked))
    _same(got, _post(f"{served.base}/search?k=5", picked.read_bytes())["hits"])
    assert got[0]["url"] == corpus["samples"][4]["url"]  # its own indexed copy first
    # a stored image's vector as embedding_input -> /search by that item's key, and brute force
    emb = np.concatenate(
        [np.load(p) for p in sorted((corpus["root"] / "emb" / "img_emb").glob("img_emb_*.npy"))]
    ).astype(np.float32)  # (N, D)
    key = corpus["samples"][7]["key"]
    by_key = _get(f"{served.base}/search?key={key}&k=5")["hits"]
    assert by_key[0]["key"] == key  # the item itself first: its row's stored vector is the query
    vector = emb[by_key[0]["row"]]
    got = images.query(embedding_input=vector.tolist())
    assert [r["id"] for r in got] == [h["row"] for h in by_key]
    assert [r["similarity"] for r in got] == pytest.approx([h["score"] for h in by_key], abs=2e-3)
    stored = emb / np.linalg.norm(emb, axis=1, keepdims=True)  # the index holds unit vectors
    brute = stored @ vector  # (N,) the naive reference
    order = np.argsort(-brute, kind="stable")[:5]
    assert [r["id"] for r in got] == order.tolist()
    assert [r["similarity"] for r in got] == pytest.approx(brute[order].tolist(), abs=1e-5)
    # modality=text with deduplicate: our caption index with identical captions folded
    captions = clip_client.ClipClient(
        url, "laion-like", num_images=3, modality=clip_client.Modality.TEXT, deduplicate=True
    )
    got = captions.query(text="a photo of a bird")
    _same(got, _get(f"{served.base}/search?text=a+photo+of+a+bird&k=3&against=text&dedupe=true")["hits"])
    assert len({r["caption"] for r in got}) == len(got) == 3


def test_knn_rows_are_the_shards_rows(served, corpus):
    """``id`` is the metadata row: /metadata gives back the same fields for it."""
    got = _post(
        served.base + "/knn-service",
        json.dumps(
            {"text": "a photo of a dog", "modality": "image", "num_images": 2, "num_result_ids": 6}
        ).encode(),
    )
    assert (
        len(got) == 6
        and all("url" in r for r in got[:2])
        and all(set(r) == {"id", "similarity"} for r in got[2:])
    )
    meta = _post(
        served.base + "/metadata",
        json.dumps({"ids": [r["id"] for r in got], "indice_name": "laion-like"}).encode(),
    )
    assert [m["id"] for m in meta] == [r["id"] for r in got]
    for result, item in zip(got[:2], meta):
        assert {k: v for k, v in result.items() if k not in ("id", "similarity")} == item["metadata"]
    urls = {s["url"] for s in corpus["samples"]}
    assert all(m["metadata"]["url"] in urls for m in meta)


# ------------------------------------------------------------------ clip-front in a browser


@pytest.fixture
def browser(tmp_path):
    yield from browser_fixture(tmp_path)


def _front(config: dict):
    """clip-front's build, served as clip-retrieval's ``clip_front`` serves it: the static files,
    and a ``config.json`` naming the back-end and its index (``config``, filled in later)."""
    build = _clip_retrieval_file("../front/build").resolve()
    if not (build / "index.html").is_file():
        pytest.skip("the installed clip-retrieval has no front-end build (front/build/index.html)")

    class Front(_Quiet):
        def do_GET(self):
            if urllib.parse.urlsplit(self.path).path == "/config.json":
                body = json.dumps(config).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                return
            super().do_GET()

    return _static(build, Front)


# the front's result images (in its shadow DOM) once every one has loaded, else null
SHOWN = """(() => {
  const front = document.querySelector('clip-front');
  const root = front && front.shadowRoot;
  const pics = root ? [...root.querySelectorAll('#products img.pic')] : [];
  if (pics.length === 0 || !pics.every(img => img.complete && img.naturalWidth > 0)) return null;
  return JSON.stringify(pics.map(img => ({src: img.getAttribute('src'), w: img.naturalWidth})));
})()"""


def test_clip_front_shows_the_images_of_a_text_query(browser, corpus):
    config: dict = {}
    front = _front(config)
    origin = f"http://127.0.0.1:{front.server_address[1]}"  # another origin than the back's
    srv = _serve(corpus, cors=origin)
    lines = []
    srv.RequestHandlerClass.access_log = staticmethod(lines.append)
    config.update({"defaultBackend": srv.base, "defaultIndex": "laion-like", "urlColumn": "url"})
    try:
        target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        browser.call("Page.enable", {}, session)
        browser.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": 1400, "height": 2000, "deviceScaleFactor": 1, "mobile": False},
            session,
        )
        browser.call("Page.navigate", {"url": origin + "/?query=a+photo+of+a+cat"}, session)
        shown = json.loads(browser.wait_for(session, SHOWN, timeout=30))
        # the front asked our back (thousands of ids: clamped, not refused) and shows each hit's image
        asked = {"modality": "image", "num_images": 40, "num_result_ids": 3000, "deduplicate": True}
        expected = _post(
            srv.base + "/knn-service", json.dumps({"text": "a photo of a cat", **asked}).encode()
        )
        assert [p["src"] for p in shown] == [r["url"] for r in expected]  # near-duplicates hidden, as asked
        assert len(shown) >= 2 and all(p["w"] == 32 for p in shown)
        # a query typed into the front's search bar (in its shadow DOM), then Enter
        bar = "document.querySelector('clip-front').shadowRoot.getElementById('searchBar')"
        browser.evaluate(session, f"{bar}.value = ''; {bar}.dispatchEvent(new Event('input')); {bar}.focus()")
        browser.call("Input.insertText", {"text": "a photo of a dog"}, session)
        for kind in ("keyDown", "keyUp"):
            browser.call(
                "Input.dispatchKeyEvent",
                {"type": kind, "key": "Enter", "code": "Enter", "windowsVirtualKeyCode": 13},
                session,
            )
        dog = _post(srv.base + "/knn-service", json.dumps({"text": "a photo of a dog", **asked}).encode())
        assert [r["url"] for r in dog] != [r["url"] for r in expected]  # another order, so the check can fail
        want = json.dumps(json.dumps([r["url"] for r in dog], separators=(",", ":")))  # a JS string literal
        browser.wait_for(
            session, f"(s => s && JSON.stringify(JSON.parse(s).map(p => p.src)) === {want})({SHOWN})"
        )
        paths = [line.split()[1:4] for line in lines]
        assert ["GET", "/indices-list", "200"] in paths and ["POST", "/knn-service", "200"] in paths
    finally:
        srv.shutdown()
        srv.server_close()
        front.shutdown()
        front.server_close()


def test_our_page_links_each_hit_to_its_url(browser, served):
    """mmalign's own search page: a hit with a source URL shows it as a link (issue 41, point 2)."""
    hits = _get(f"{served.base}/search?text=a+photo+of+a+cat&k=5")["hits"]
    assert all(h["url"].startswith("http://127.0.0.1:") for h in hits)
    target = browser.call("Target.createTarget", {"url": "about:blank"})["targetId"]
    session = browser.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
    browser.call("Page.enable", {}, session)
    browser.call("Page.navigate", {"url": served.base + "/?q=a+photo+of+a+cat&k=5"}, session)
    links = browser.wait_for(
        session,
        """(() => { const rows = [...document.querySelectorAll('#results tr.hit')];
          return rows.length === 5 ? JSON.stringify(rows.map(tr => { const a = tr.querySelector('td.source a');
            return a && [a.getAttribute('href'), a.textContent, a.rel]; })) : null; })()""",
    )
    assert json.loads(links) == [[h["url"], h["url"], "noopener noreferrer"] for h in hits]


def test_the_guides_clip_client_snippet_runs(served, monkeypatch):
    """docs/search.md's ClipClient block, against this server (its index named as in the guide)."""
    import sys
    import types

    from tests.harness.doc_snippets import snippet

    module = _clip_client_module()
    package = types.ModuleType("clip_retrieval")  # its __init__ imports the web server's dependencies
    monkeypatch.setitem(sys.modules, "clip_retrieval", package)
    monkeypatch.setitem(sys.modules, "clip_retrieval.clip_client", module)
    code = snippet(
        "docs/search.md", "tests/search/test_clip_retrieval.py::test_the_guides_clip_client_snippet_runs"
    )
    assert "http://127.0.0.1:8765" in code and '"laion"' in code
    namespace: dict = {}
    exec(code.replace("http://127.0.0.1:8765", served.base).replace('"laion"', '"laion-like"'), namespace)
    results = namespace["results"]
    # at most 10: the client's default deduplicate=True drops near-duplicate images
    assert 1 <= len(results) <= 10 and all({"id", "similarity", "caption", "url"} <= set(r) for r in results)
    assert namespace["captions"].modality == "text"


def _naive_groups(unit: np.ndarray, threshold: float) -> list[int]:
    """Indices kept: the first of each connected group of the graph cosine >= threshold (BFS)."""
    n, seen, kept = len(unit), set(), []
    for start in range(n):
        if start in seen:
            continue
        kept.append(start)
        todo = [start]
        while todo:
            i = todo.pop()
            if i in seen:
                continue
            seen.add(i)
            todo += [j for j in range(n) if j not in seen and float(unit[i] @ unit[j]) >= threshold]
    return kept


def test_deduplicate_drops_near_duplicate_images_as_clip_retrieval_does(served, corpus):
    """ClipClient's default deduplicate=True: of results whose stored vectors are >= 0.94 alike
    (chains included), only the best stays; checked against a brute-force ranking and grouping."""
    clip_client = _clip_client_module()
    emb = np.concatenate(
        [np.load(p) for p in sorted((corpus["root"] / "emb" / "img_emb").glob("img_emb_*.npy"))]
    ).astype(np.float32)  # (N, D)
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    client = clip_client.ClipClient(served.base + "/knn-service", "laion-like", num_images=len(emb))
    assert client.deduplicate  # the client's default
    checked = 0
    for row in range(len(emb)):
        got = client.query(embedding_input=unit[row].tolist())
        order = np.argsort(-(unit @ unit[row]), kind="stable")  # (N,) the naive ranking
        kept = order[_naive_groups(unit[order], 0.94)]
        assert [r["id"] for r in got] == kept.tolist()
        assert [r["similarity"] for r in got] == pytest.approx((unit[kept] @ unit[row]).tolist(), abs=1e-5)
        checked += len(kept) < len(emb)
    assert checked > 0  # some query had near-duplicates to drop, so the comparison could fail
