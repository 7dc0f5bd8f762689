"""serve's adversarial bounds, with stub searchers (no model): a thin image is a 413 from its
header; duplicate or conflicting body lengths are a 400; JSON replies say nosniff; work a worker
took is answered however long it takes, a request left in the queue past the timeout is a 503
(never run), an undelivered reply is logged as such; one client churning connections cannot
starve another (loopback, bounded in time and count)."""

from __future__ import annotations

import contextlib
import io
import json
import select
import socket
import struct
import threading
import time
import urllib.error
import urllib.request

import pytest
from PIL import Image

from mmalign.search.searcher import Hit
from mmalign.search.serve import make_server
from tests.search.test_serve import _png, _raw, server  # noqa: F401  (the fixture)


def _post(srv, body: bytes):
    request = urllib.request.Request(f"{srv.base}/search?k=1", data=body, method="POST")
    return urllib.request.urlopen(request, timeout=5)


@pytest.mark.parametrize("server", [{"max_pixels": 40_000_000}], indirect=True)
def test_a_thin_image_is_a_413_from_its_header(server):
    strip = _png((1, 20000))  # 20,000 pixels, far under the pixel cap; 4.9 GB resized at 224
    assert Image.open(io.BytesIO(strip)).size == (1, 20000)
    start = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server, strip)
    assert e.value.code == 413 and time.monotonic() - start < 2
    assert e.value.headers["Content-Type"] == "application/json"
    message = json.loads(e.value.read())["error"]
    assert "thin" in message and "1x20000" in message
    assert server.stub.images == []  # never reached the model
    with _post(server, _png((40, 2))) as r:  # 20:1, the bound itself, is served
        assert json.loads(r.read())["hits"][0]["key"] == "40x2"


# ---------------------------------------------------------------- framing and headers


@pytest.mark.parametrize(
    "headers",
    [
        b"Content-Length: 4\r\nContent-Length: 4\r\n",  # even equal: two framings of one body
        b"Content-Length: 4\r\nContent-Length: 40\r\n",
        b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n",
        b"Transfer-Encoding: chunked\r\n",
    ],
)
def test_ambiguous_body_framing_is_a_400(server, headers):
    lines = []
    server.access_log = lines.append
    reply = _raw(server, b"POST /search?k=1 HTTP/1.1\r\nHost: localhost\r\n" + headers + b"\r\nabcd")
    assert reply.startswith(b"HTTP/1.0 400 "), reply[:80]
    head, _, body = reply.partition(b"\r\n\r\n")
    assert b"X-Content-Type-Options: nosniff" in head
    message = json.loads(body)["error"]
    assert "Content-Length" in message or "Transfer-Encoding" in message
    deadline = time.monotonic() + 2  # the loop writes the access line just after the reply
    while not any(" 400 " in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert any(" 400 " in line for line in lines) and server.stub.images == []


def test_json_replies_say_nosniff(server):
    with urllib.request.urlopen(f"{server.base}/health", timeout=5) as r:
        assert (
            r.headers["X-Content-Type-Options"] == "nosniff"
            and r.headers["Content-Type"] == "application/json"
        )
    for url, code in ((f"{server.base}/nope", 404), (f"{server.base}/search?text=a&k=0", 400)):
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url, timeout=5)
        assert e.value.code == code and e.value.headers["X-Content-Type-Options"] == "nosniff"
    big = _raw(server, b"POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Length: 999999999\r\n\r\n")
    assert (
        big.startswith(b"HTTP/1.0 413 ") and b"X-Content-Type-Options: nosniff" in big.split(b"\r\n\r\n")[0]
    )


# ---------------------------------------------------------------- slow work and a busy queue


class SlowSearcher:
    """Text queries take ``delay`` s (a slow model); records the queries it ran."""

    dim = 4
    indexes = {"image": None}

    def __init__(self, delay: float):
        self.delay, self.ran = delay, []

    def text(self, text, k, against, dedupe=True):
        self.ran.append(text)
        time.sleep(self.delay)
        return [Hit(1, "key", text, 1.0, 0)]


@contextlib.contextmanager
def _slow_server(delay: float, **kwargs):
    lines: list[str] = []
    searcher = SlowSearcher(delay)
    srv = make_server(searcher, "127.0.0.1", 0, access_log=lines.append, **kwargs)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.searcher, srv.lines, srv.base = searcher, lines, f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        yield srv
    finally:
        srv.shutdown()
        srv.server_close()


def _get(srv, text: str, timeout: float = 10.0):
    """(status, JSON body, seconds) of a text search."""
    start = time.monotonic()
    try:
        with urllib.request.urlopen(f"{srv.base}/search?text={text}&k=1", timeout=timeout) as r:
            return r.status, json.loads(r.read()), time.monotonic() - start
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), time.monotonic() - start


def test_work_taken_by_a_worker_is_answered_however_long_it_takes():
    with _slow_server(1.2, timeout=0.5, workers=1) as srv:  # the work takes 2.4x the timeout
        status, body, took = _get(srv, "slow")
        time.sleep(0.1)  # the access line is written after the reply
        assert status == 200 and body["hits"][0]["caption"] == "slow" and took >= 1.2
        assert any(" 200 " in line and "not delivered" not in line for line in srv.lines), srv.lines


def test_a_request_waiting_past_the_timeout_gets_a_503_and_is_never_run():
    with _slow_server(1.5, timeout=0.4, workers=1) as srv:
        first = threading.Thread(target=lambda: results.append(_get(srv, "first")))
        results: list = []
        first.start()
        time.sleep(0.2)  # the only worker is busy with it
        status, body, took = _get(srv, "second")
        assert status == 503 and "busy" in body["error"]
        assert took < 1.2  # answered at its queue deadline (0.4 s), not when the worker freed (1.5 s)
        first.join(10)
        time.sleep(0.1)
    assert results[0][0] == 200  # the one taken was answered
    assert srv.searcher.ran == ["first"]  # the one refused never ran
    assert sum(" 503 " in line and "/search?text=second" in line for line in srv.lines) == 1, srv.lines


def test_a_reply_the_client_did_not_take_is_logged_so():
    with _slow_server(0.6, timeout=2.0, workers=1) as srv:
        s = socket.create_connection(srv.server_address, timeout=5)
        s.sendall(b"GET /search?text=gone&k=1 HTTP/1.1\r\nHost: localhost\r\n\r\n")
        time.sleep(0.1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset: the reply, written 0.5 s later, cannot be delivered
        deadline = time.monotonic() + 5
        while not srv.lines and time.monotonic() < deadline:
            time.sleep(0.05)
    assert srv.searcher.ran == ["gone"] and len(srv.lines) == 1
    assert " 200 " in srv.lines[0] and "reply not delivered: the client left" in srv.lines[0], srv.lines


# ---------------------------------------------------------------- connection churn


def _churn(address, stop: threading.Event, sockets: int, max_opened: int = 5000) -> int:
    """Hold ``sockets`` connections from 127.0.0.1, re-opening each as soon as the server answers or
    closes it, until ``stop`` is set or ``max_opened`` were opened; returns how many were opened."""
    opened = 0
    held = []
    try:
        while not stop.is_set() and opened < max_opened:
            while len(held) < sockets and opened < max_opened:
                try:
                    held.append(socket.create_connection(address, timeout=1))
                except OSError:
                    break
                opened += 1
            ready = select.select(held, [], [], 0.02)[0] if held else []
            for s in ready:
                try:
                    s.recv(4096)
                except OSError:
                    pass
                held.remove(s)
                s.close()
    finally:
        for s in held:
            s.close()
    return opened


def _latencies_from(srv, source: str, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.monotonic()
        with socket.create_connection(srv.server_address, timeout=10, source_address=(source, 0)) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.0 200 "), reply[:80]
        out.append(time.monotonic() - start)
    return out


def _other_loopback() -> str:
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", 0))
    except OSError:
        pytest.skip("no second loopback address (127.0.0.2) to play the normal client")
    return "127.0.0.2"


@pytest.mark.parametrize("capped", [True, False], ids=["per-client-cap", "control-without-it"])
def test_a_churning_client_does_not_starve_another(capped):
    source = _other_loopback()
    per_client = 8 if capped else 1000
    with _slow_server(0.0, timeout=1.5, workers=2, max_connections=24, max_per_client=per_client) as srv:
        stop = threading.Event()
        opened: list[int] = []
        churner = threading.Thread(target=lambda: opened.append(_churn(srv.server_address, stop, sockets=40)))
        churner.start()
        try:
            holding = min(per_client, 24)  # what the churner can hold: its cap, or every place
            deadline = time.monotonic() + 5
            while sum(srv._open_from.values()) < holding and time.monotonic() < deadline:
                time.sleep(0.02)
            assert (
                sum(srv._open_from.values()) >= holding
            )  # the churner holds them (a loaded machine: waited)
            latencies = sorted(_latencies_from(srv, source, 3))
        finally:
            stop.set()
            churner.join(10)
    p50 = latencies[len(latencies) // 2]
    if capped:
        assert p50 < 0.5, latencies  # served at once: the churner holds at most 8 of 24 places
        assert any(" 429 " in line for line in srv.lines)  # the excess was turned away, and said so
    else:  # the control: without the cap the churner holds every place and the client waits for
        assert p50 > 0.8, latencies  # its idle connections to time out (1.5 s after they opened)
