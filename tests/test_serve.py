"""The server serves: one thread per connection (a staller does not delay others), a
per-connection timeout, Host checks against DNS rebinding, 400 for a malformed
Content-Length and 413 for too many pixels, all with a stub searcher (no model)."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from PIL import Image

from mmalign.search import Hit
from mmalign.serve import make_server


class StubSearcher:
    dim = 4
    indexes = {"image": None}

    def __init__(self):
        self.images = []

    def text(self, text, k, against, dedupe=True):
        return [Hit(1, "key", text, 1.0, 0)]

    def image(self, image, k, against, dedupe=True):
        self.images.append(image.size)
        return [Hit(1, f"{image.width}x{image.height}", "", 1.0, 0)]


@pytest.fixture
def server(request):
    kwargs = getattr(request, "param", {})
    searcher = StubSearcher()
    srv = make_server(searcher, "127.0.0.1", 0, **{"max_pixels": 10_000, "access_log": lambda line: None, **kwargs})
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.stub = searcher
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def _raw(srv, payload: bytes, timeout=10.0) -> bytes:
    with socket.create_connection(srv.server_address, timeout=timeout) as s:
        s.sendall(payload)
        chunks = []
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _png(size, mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, format="PNG")
    return buf.getvalue()


@pytest.mark.parametrize("server", [{"timeout": 30.0}], indirect=True)
def test_a_staller_does_not_delay_a_concurrent_search(server):
    stallers = [socket.create_connection(server.server_address, timeout=5) for _ in range(3)]
    try:
        stallers[0].sendall(b"GET /search?text=a HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # half a request
        stallers[1].sendall(b"POST /search?k=1 HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 500\r\n\r\nxx")
        time.sleep(0.2)
        start = time.monotonic()
        with urllib.request.urlopen(f"{server.base}/search?text=a+red+circle&k=1", timeout=5) as r:
            assert json.loads(r.read())["hits"][0]["caption"] == "a red circle"
        assert time.monotonic() - start < 2.0
    finally:
        for s in stallers:
            s.close()
    assert server.socket.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and server.request_queue_size >= 64


@pytest.mark.parametrize("server", [{"timeout": 0.3}], indirect=True)
def test_an_idle_connection_is_closed_after_the_timeout(server):
    with socket.create_connection(server.server_address, timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")
        start = time.monotonic()
        assert s.recv(100) == b""  # closed by the server, without an answer
        assert time.monotonic() - start < 3.0


def test_host_header_must_be_this_server(server):
    port = server.server_address[1]
    for host, status in ((f"127.0.0.1:{port}", 200), (f"localhost:{port}", 200), ("localhost", 200),
                         (f"evil.example:{port}", 403), ("127.0.0.1.nip.io", 403), ("10.0.0.1", 403), ("", 403)):
        reply = _raw(server, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        assert reply.startswith(f"HTTP/1.0 {status}".encode()) or reply.startswith(f"HTTP/1.1 {status}".encode()), \
            (host, reply[:60])


def test_malformed_content_length_is_a_400(server):
    for value in (b"abc", b"1e3", b"-5"):
        reply = _raw(server, b"POST /search?k=1 HTTP/1.1\r\nHost: localhost\r\nContent-Length: " + value +
                     b"\r\n\r\n")
        status = reply.split(b"\r\n", 1)[0]
        assert status.split()[1] in (b"400", b"413"), reply[:80]
        assert b'"error"' in reply
    assert b" 400 " in _raw(server, b"POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Length: x\r\n\r\n")[:20]


def test_decoded_pixels_are_bounded(server):
    def post(body):
        request = urllib.request.Request(f"{server.base}/search?k=1", data=body, method="POST")
        return urllib.request.urlopen(request, timeout=5)

    with post(_png((20, 10))) as r:
        assert json.loads(r.read())["hits"][0]["key"] == "20x10"
    bomb = _png((20_000, 20_000), mode="1")  # a few KB on the wire, 400 M pixels decoded
    assert len(bomb) < 1 << 20
    with pytest.raises(urllib.error.HTTPError) as e:
        post(bomb)
    assert e.value.code == 413 and "pixels" in json.loads(e.value.read())["error"]
    with pytest.raises(urllib.error.HTTPError) as e:
        post(b"not an image")
    assert e.value.code == 400
    assert server.stub.images == [(20, 10)]  # nothing else reached the model
