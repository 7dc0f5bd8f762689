"""clip-retrieval's routes on ``mmalign serve``: one-line 4xx errors, counts clamped to
--max-k (said in a header), options ignored (named in a header), several indexes, the
image_url allow-list (a local HTTP server as the allowed host; another name, a redirect
elsewhere and an oversized image refused), CORS with the Host and Origin checks, and the
base64 thumbnail a result without a url carries for clip-front."""

from __future__ import annotations

import base64
import functools
import io
import json
import threading
import urllib.error
import urllib.request
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest
from PIL import Image

from mmalign.errors import UsageError
from tests.harness.searchdata import build_corpus

OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # local servers: never via a proxy


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return build_corpus(tmp_path_factory.mktemp("knn") / "corpus")


class _Files(SimpleHTTPRequestHandler):
    """Static files, a redirect at /elsewhere/NAME (to localhost: another host name), and a log."""

    seen: list

    def log_message(self, fmt, *args):
        pass

    def do_GET(self):
        self.seen.append(self.path)
        if self.path.startswith("/elsewhere/"):
            port = self.server.server_address[1]
            self.send_response(302)
            self.send_header("Location", f"http://localhost:{port}/{self.path.split('/', 2)[2]}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        super().do_GET()


@pytest.fixture(scope="module")
def images(corpus, tmp_path_factory):
    """A second local server: the corpus's source images, and one too big to fetch."""
    www = corpus["root"] / "src"
    big = io.BytesIO()
    Image.effect_noise((300, 300), 64).convert("RGB").save(big, format="PNG")  # > 60 kB of noise
    (www / "big.png").write_bytes(big.getvalue())
    handler = type("Files", (_Files,), {"seen": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(handler, directory=str(www)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.port, srv.seen = srv.server_address[1], handler.seen
    yield srv
    srv.shutdown()
    srv.server_close()


@pytest.fixture(scope="module")
def served(corpus):
    from mmalign.search.searcher import Searcher
    from mmalign.search.serve import make_server

    # the same index twice: "b" has no model of its own, its queries are embedded by "a"'s
    searchers = {"a": Searcher(corpus["idx"], corpus["model"]), "b": Searcher(corpus["idx"])}
    srv = make_server(
        searchers,
        "127.0.0.1",
        0,
        max_k=5,
        max_body=60_000,
        access_log=lambda line: None,
        cors="http://front.test:3000",
        allow_url_queries="127.0.0.1",
    )
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    srv.corpus_root = corpus["root"]
    yield srv
    srv.shutdown()
    srv.server_close()


def _call(url: str, body=None, method=None, headers=None):
    """(status, JSON body, headers) of one request; a 4xx/5xx is returned, not raised."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with OPENER.open(request, timeout=30) as r:
            raw, status, got = r.read(), r.status, r.headers
    except urllib.error.HTTPError as e:
        raw, status, got = e.read(), e.code, e.headers
    return status, (json.loads(raw) if raw else None), got


def _knn(served, body, headers=None):
    return _call(served.base + "/knn-service", body, headers=headers)


def _one_line_error(status, body, code, words):
    assert status == code, body
    assert set(body) == {"error"} and "\n" not in body["error"] and "Traceback" not in body["error"]
    assert words in body["error"], body["error"]


@pytest.mark.parametrize(
    ("body", "code", "words"),
    [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        ({"modality": "image"}, 400, "exactly one of text, image, image_url, embedding_input (got none)"),
        ({"text": "a cat", "embedding_input": [0.1] * 32}, 400, "(got text, embedding_input)"),
        ({"text": "a cat", "indice_name": "laion5B"}, 404, "no index named 'laion5B' (have a, b)"),
        (
            {"embedding_input": [0.1] * 31},
            400,
            "embedding_input has 31 numbers; this index's dimension is 32",
        ),
        ({"embedding_input": [0.1] * 31 + ["x"]}, 400, "must be a list of numbers"),
        ({"embedding_input": [1e39] * 32}, 400, "finite numbers"),
        ({"image": "not base64!"}, 400, "image must be base64"),
        ({"image": base64.b64encode(b"hello").decode()}, 400, "image is not a readable image"),
        ({"text": "a cat", "modality": "audio"}, 400, "modality must be image or text"),
        ({"text": "a cat", "num_images": "many"}, 400, "num_images must be a positive integer"),
        ({"text": "a cat", "num_result_ids": 0}, 400, "num_result_ids must be a positive integer"),
        ({"text": "x" * 1001}, 400, "text must be 1..1000 characters"),
    ],
)
def test_a_bad_knn_request_is_a_one_line_4xx(served, body, code, words):
    _one_line_error(*_knn(served, body)[:2], code, words)


def test_bad_metadata_requests_and_unknown_indexes_are_one_line_errors(served):
    url = served.base + "/metadata"
    _one_line_error(*_call(url, {"ids": "1,2"})[:2], 400, "ids must be a list of integers")
    _one_line_error(*_call(url, {"ids": [0, 10**6]})[:2], 400, "id 1000000 is not a row of this index (0..")
    _one_line_error(*_call(url, {"ids": [0], "indice_name": "x"})[:2], 404, "no index named 'x'")
    _one_line_error(*_call(url, b"", method="POST")[:2], 400, "needs a JSON body")
    _one_line_error(*_call(served.base + "/search?text=a&index=x")[:2], 404, "no index named 'x' (have a, b)")
    _one_line_error(*_call(served.base + "/health?index=x")[:2], 404, "no index named 'x'")


def test_counts_over_max_k_are_clamped_and_unknown_options_named(served):
    status, results, headers = _knn(
        served,
        {
            "text": "a photo of a cat",
            "num_images": 40,
            "num_result_ids": 3000,
            "indice_name": "a",
            "use_mclip": False,
            "use_safety_model": True,
            "aesthetic_score": 9,
            "aesthetic_weight": 0.5,
        },
    )
    assert status == 200 and len(results) == 5  # --max-k 5 (the corpus holds 12 images)
    assert headers["X-Mmalign-Clamped"].startswith("num_result_ids 3000 -> 5; num_images 40 -> 5")
    ignored = headers["X-Mmalign-Ignored"]
    assert ignored.startswith("aesthetic_score, aesthetic_weight, use_safety_model (")
    assert "use_mclip" not in ignored  # off: nothing ignored
    status, _, headers = _knn(served, {"text": "a photo of a cat", "num_images": 3})
    assert status == 200 and "X-Mmalign-Clamped" not in headers and "X-Mmalign-Ignored" not in headers


def test_several_indexes_share_the_model_and_are_listed(served):
    assert _call(served.base + "/indices-list")[:2] == (200, ["a", "b"])
    a = _call(served.base + "/search?text=a+photo+of+a+dog&k=4")[1]["hits"]
    b = _call(served.base + "/search?text=a+photo+of+a+dog&k=4&index=b")[1]["hits"]
    assert [(h["row"], h["score"]) for h in a] == [(h["row"], h["score"]) for h in b]
    knn_b = _knn(served, {"text": "a photo of a dog", "num_images": 4, "indice_name": "b"})[1]
    assert [(r["id"], r["similarity"]) for r in knn_b] == [(h["row"], pytest.approx(h["score"])) for h in a]
    png = (served.corpus_root / "src" / "dog" / "0001.png").read_bytes()
    by_a = _call(served.base + "/search?k=3", png)[1]["hits"]
    by_b = _call(served.base + "/search?k=3&index=b", png)[1]["hits"]
    assert [(h["row"], h["score"]) for h in by_a] == [(h["row"], h["score"]) for h in by_b]
    assert by_b[0]["source_path"] == "dog/0001.png"
    with OPENER.open(f"{served.base}/thumb?row={by_b[0]['row']}&index=b", timeout=30) as r:
        assert r.headers["Content-Type"] == "image/jpeg"
    health = _call(served.base + "/health?index=b")[1]
    assert (health["index"], health["indices"], health["dim"]) == ("b", ["a", "b"], 32)


def test_a_result_without_url_carries_its_thumbnail_for_a_local_client(served):
    results = _knn(served, {"text": "a photo of a bird", "num_images": 2, "num_result_ids": 4})[1]
    assert all("url" not in r for r in results)
    assert all("image" in r for r in results[:2]) and all("image" not in r for r in results[2:])
    for result in results[:2]:
        jpeg = base64.b64decode(result["image"])
        assert Image.open(io.BytesIO(jpeg)).format == "JPEG"
        with OPENER.open(f"{served.base}/thumb?row={result['id']}&size=128", timeout=30) as r:
            assert r.read() == jpeg  # the page's own thumbnail of the same row
        assert result["caption"].startswith("a ") and result["source_path"].endswith(".png")
        assert not {"file", "offset", "json"} & set(result)  # the server's bookkeeping stays inside


def test_image_url_is_fetched_from_allowed_hosts_only(served, images, corpus):
    picked = f"http://127.0.0.1:{images.port}/cat/0001.png"
    status, by_url, _ = _knn(served, {"image_url": picked, "num_images": 3})
    assert status == 200
    data = (corpus["root"] / "src" / "cat" / "0001.png").read_bytes()
    by_bytes = _knn(served, {"image": base64.b64encode(data).decode(), "num_images": 3})[1]
    assert by_url == by_bytes and by_url[0]["source_path"] == "cat/0001.png"
    before = list(images.seen)
    # another name for the same machine is another host: refused before any request is made
    _one_line_error(
        *_knn(served, {"image_url": f"http://localhost:{images.port}/cat/0001.png"})[:2],
        400,
        "image_url host 'localhost' is not allowed (allowed: 127.0.0.1)",
    )
    _one_line_error(*_knn(served, {"image_url": "file:///etc/passwd"})[:2], 400, "must be http or https")
    _one_line_error(
        *_knn(served, {"image_url": f"http://user:pw@127.0.0.1:{images.port}/x.png"})[:2], 400, "credentials"
    )
    assert images.seen == before
    # an allowed host redirecting to another is refused at the redirect
    _one_line_error(
        *_knn(served, {"image_url": f"http://127.0.0.1:{images.port}/elsewhere/cat/0001.png"})[:2],
        400,
        "image_url redirected: image_url host 'localhost' is not allowed",
    )
    assert images.seen == [*before, "/elsewhere/cat/0001.png"]
    # bounded: an image over the server's body limit, a missing one
    _one_line_error(
        *_knn(served, {"image_url": f"http://127.0.0.1:{images.port}/big.png"})[:2], 400, "at most 60000"
    )
    _one_line_error(
        *_knn(served, {"image_url": f"http://127.0.0.1:{images.port}/nope.png"})[:2], 400, "answered HTTP 404"
    )


def test_image_url_is_off_without_allowed_hosts(corpus):
    from mmalign.search.searcher import Searcher
    from mmalign.search.serve import make_server

    srv = make_server(Searcher(corpus["idx"], corpus["model"]), "127.0.0.1", 0, access_log=lambda line: None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{srv.server_address[1]}/knn-service"
        _one_line_error(
            *_call(url, {"image_url": "http://127.0.0.1/a.png"})[:2], 400, "image_url queries are off"
        )
        # a lone index is named after its directory
        assert _call(url.replace("knn-service", "indices-list"))[1] == ["idx"]
    finally:
        srv.shutdown()
        srv.server_close()


def test_cors_for_the_listed_origin_and_the_host_check_still_holds(served):
    front = {"Origin": "http://front.test:3000"}
    status, body, headers = _call(served.base + "/indices-list", headers=front)
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "http://front.test:3000"
    assert "X-Mmalign-Clamped" in headers["Access-Control-Expose-Headers"]
    assert headers["Vary"] == "Origin"
    status, _, headers = _call(
        served.base + "/knn-service",
        method="OPTIONS",
        headers={
            **front,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type",
        },
    )
    assert status == 204 and "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Origin"] == "http://front.test:3000"
    # another page: refused, preflight or not (a page cannot make the server work for it)
    evil = {"Origin": "http://evil.test"}
    _one_line_error(*_knn(served, {"text": "a cat"}, headers=evil)[:2], 403, "--cors http://evil.test")
    assert _call(served.base + "/knn-service", method="OPTIONS", headers=evil)[0] == 403
    # no Origin (not a browser) or the server's own page: no CORS headers needed
    status, _, headers = _call(served.base + "/indices-list")
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    own = {"Origin": served.base}
    assert _knn(served, {"text": "a cat", "num_images": 1}, headers=own)[0] == 200
    # a plain GET carries no Origin (an <img>, a no-cors fetch): its Referer names the page
    _one_line_error(
        *_call(served.base + "/search?text=a+cat&k=1", headers={"Referer": "http://evil.test/x.html"})[:2],
        403,
        "'http://evil.test' are not accepted",
    )
    assert (
        _call(served.base + "/search?text=a+cat&k=1", headers={"Referer": "http://front.test:3000/"})[0]
        == 200
    )
    assert _call(served.base + "/search?text=a+cat&k=1", headers={"Referer": served.base + "/?q=a"})[0] == 200
    # a link from another site to the search page is followed (a navigation shows our page)
    with OPENER.open(
        urllib.request.Request(
            served.base + "/", headers={"Referer": "http://evil.test/", "Sec-Fetch-Mode": "navigate"}
        ),
        timeout=30,
    ) as r:
        assert r.status == 200
    # a DNS name rebound to 127.0.0.1 is still refused, whatever the Origin
    _one_line_error(
        *_call(served.base + "/indices-list", headers={**front, "Host": "front.test:3000"})[:2],
        403,
        "is not this server",
    )


def test_flags_are_checked_in_one_line():
    from mmalign.search.serve_fetch import parse_hosts
    from mmalign.search.serve_indexes import parse_indexes
    from mmalign.search.serve_origin import parse_cors

    assert parse_hosts("Images.Example.com, 127.0.0.1") == {"images.example.com", "127.0.0.1"}
    for bad in ("http://x.com", "x.com:80", "a/b"):
        with pytest.raises(UsageError, match="not a host name"):
            parse_hosts(bad)
    assert parse_cors("http://localhost:3000/, *") == ("http://localhost:3000", "*")
    with pytest.raises(UsageError, match="is not an origin"):
        parse_cors("localhost:3000")
    assert parse_indexes(["laion=/data/x", "/data/coco"]) == [("laion", "/data/x"), ("coco", "/data/coco")]
    with pytest.raises(UsageError, match="two indexes are named 'x'"):
        parse_indexes(["x=/a", "/b/x"])


class _Stopped:
    server_address = ("127.0.0.1", 0)

    def serve_forever(self):
        pass

    def server_close(self):
        pass


def test_the_cli_serves_named_indexes_memory_mapped_with_cors_and_url_hosts(monkeypatch, capsys, tmp_path):
    from mmalign import cli
    from mmalign.search import serve as serve_mod

    monkeypatch.chdir(tmp_path)
    for name in ("i1", "i2"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "index.json").write_text("{}")  # the CLI checks each folder before loading
    (tmp_path / "m").mkdir()
    opened, seen = [], {}

    class Opened:
        dim = 4

        def __init__(self, index_dir, model_dir=None, *, mmap=False):
            opened.append((str(index_dir), model_dir, mmap))
            self.index_dir = index_dir

    monkeypatch.setattr(serve_mod, "Searcher", Opened)
    monkeypatch.setattr(
        serve_mod, "make_server", lambda s, host, port, **kw: seen.update(kw, searchers=s) or _Stopped()
    )
    flags = ["--model", "m", "--mmap", "--cors", "http://localhost:3000", "--allow-url-queries", "img.test"]
    assert cli.main(["serve", "--index", "laion=i1", "--index", "i2", *flags]) == 0
    assert opened == [("i1", "m", True), ("i2", None, True)]  # the model loads once, with the first
    assert list(seen["searchers"]) == ["laion", "i2"]
    assert (seen["cors"], seen["allow_url_queries"]) == ("http://localhost:3000", "img.test")
    capsys.readouterr()
    opened.clear()
    for bad, words in (
        (["--index", "a=i1", "--index", "a=i2"], "two indexes are named 'a'"),
        (["--index", "x=nowhere"], "nowhere is not an index directory"),
        (["--index", "i1", "--cors", "localhost:3000"], "--cors: 'localhost:3000' is not an origin"),
        (["--index", "i1", "--allow-url-queries", "http://img.test"], "is not a host name"),
    ):
        assert cli.main(["serve", *bad, "--model", "m"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err
    assert opened == []  # every one refused before an index or the model was opened


def test_mmalign_serve_answers_clip_retrieval_for_two_named_indexes(corpus, tmp_path):
    """The real command: ``mmalign serve --index a=DIR --index DIR2 --mmap --cors ...`` in its own
    process (stopped by its id); the startup line names both, indices-list lists them."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.harness import ROOT

    (tmp_path / "second").symlink_to(corpus["idx"], target_is_directory=True)
    args = [
        "--index",
        f"first={corpus['idx']}",
        "--index",
        str(tmp_path / "second"),
        "--model",
        corpus["model"],
    ]
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmalign.cli",
            "serve",
            *args,
            "--port",
            "0",
            "--mmap",
            "--cors",
            "http://x.test",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    try:
        deadline, line = time.monotonic() + 120, ""
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stdout.readline()
        assert "serving first=" in line and "second=" in line, (line, proc.poll())
        base = line.split("search page ", 1)[1].split()[0].rstrip("/")
        assert _call(base + "/indices-list")[:2] == (200, ["first", "second"])
        status, results, headers = _call(
            base + "/knn-service",
            {"text": "a photo of a cat", "indice_name": "second", "num_images": 2},
            headers={"Origin": "http://x.test"},
        )
        assert (
            status == 200 and len(results) == 2 and headers["Access-Control-Allow-Origin"] == "http://x.test"
        )
    finally:
        os.kill(proc.pid, signal.SIGINT)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
        proc.stdout.close()
        proc.stderr.close()
