"""The server serves: a staller does not delay others, many drippers hold no threads and
get a 408 by the request deadline, connections beyond the cap wait in the backlog, an
oversized body gets a 413 the client reads, Host checks against DNS rebinding, 400 for a
malformed Content-Length and 413 for too many pixels, all with a stub searcher (no model)."""

from __future__ import annotations

import io
import json
import select
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest
from PIL import Image

from mmalign.errors import UsageError
from mmalign.search.searcher import Hit
from mmalign.search.serve import make_server
from mmalign.search.serve_loop import LINGER


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
    srv = make_server(
        searcher, "127.0.0.1", 0, **{"max_pixels": 10_000, "access_log": lambda line: None, **kwargs}
    )
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.stub = searcher
    srv.base = f"http://127.0.0.1:{srv.server_address[1]}"
    yield srv
    srv.shutdown()
    srv.server_close()


def _until_closed(s: socket.socket) -> bytes:
    """Everything the server sends on ``s`` until it closes the connection."""
    chunks = []
    while chunk := s.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def _raw(srv, payload: bytes, timeout=10.0) -> bytes:
    with socket.create_connection(srv.server_address, timeout=timeout) as s:
        s.sendall(payload)
        return _until_closed(s)


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
    assert (
        server.socket.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) and server.request_queue_size >= 64
    )


def _status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1])


def _served_once(srv) -> None:
    """Wait (bounded) until the server answers, i.e. its loop and worker pool are running."""
    with urllib.request.urlopen(f"{srv.base}/health", timeout=10) as r:
        assert r.status == 200


@pytest.mark.parametrize("server", [{"timeout": 0.3}], indirect=True)
def test_an_unfinished_request_gets_a_408_and_an_idle_connection_is_closed(server):
    with socket.create_connection(server.server_address, timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\n")  # no end of the head: the request never completes
        start = time.monotonic()
        reply = s.recv(4096)
        assert _status_of(reply) == 408 and b'"error"' in reply and b"0.3 s" in reply
        assert time.monotonic() - start < 3.0
        while s.recv(4096):  # then the server closes (bounded: the socket has a 5 s timeout)
            pass
    with socket.create_connection(server.server_address, timeout=5) as s:  # sends nothing at all
        start = time.monotonic()
        assert s.recv(100) == b""  # closed without an answer
        assert time.monotonic() - start < 3.0


def _drip(socks: list, until: float, every: float = 0.1) -> dict:
    """Send one byte per socket every ``every`` s until each has a reply or ``until`` passes;
    returns socket index -> (reply bytes, seconds after the start)."""
    start, replies = time.monotonic(), {}
    while len(replies) < len(socks) and time.monotonic() < until:
        for i, s in enumerate(socks):
            if i in replies:
                continue
            if select.select([s], [], [], 0)[0]:
                try:
                    replies[i] = (s.recv(4096), time.monotonic() - start)
                except ConnectionError:
                    replies[i] = (b"", time.monotonic() - start)
                continue
            try:
                s.send(b"a")  # one more byte of a header line that never ends
            except (BlockingIOError, ConnectionError):
                pass
        time.sleep(every)
    return replies


@pytest.mark.parametrize("server", [{"timeout": 2.0, "workers": 2, "max_per_client": 64}], indirect=True)
def test_dripping_sockets_hold_no_threads_and_get_a_408_while_others_are_served(server):
    _served_once(server)
    threads = threading.active_count()  # the loop and its 2 workers included
    n = 40  # 20x the pool
    socks = [socket.create_connection(server.server_address, timeout=5) for _ in range(n)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            s.setblocking(False)
        # while they drip, a whole request is answered at once, and no thread was added for them
        time.sleep(0.3)
        start = time.monotonic()
        with urllib.request.urlopen(f"{server.base}/search?text=a+red+circle&k=1", timeout=5) as r:
            assert json.loads(r.read())["hits"][0]["caption"] == "a red circle"
        assert time.monotonic() - start < 1.5  # before the drippers' 2 s deadline
        assert threading.active_count() <= threads
        replies = _drip(socks, until=time.monotonic() + 6.0)
        assert threading.active_count() <= threads
    finally:
        for s in socks:
            s.close()
    assert sorted(replies) == list(range(n)), f"{n - len(replies)} dripping sockets got no reply"
    for reply, _ in replies.values():
        assert _status_of(reply) == 408 and b"did not arrive within 2 s" in reply
    assert max(t for _, t in replies.values()) < 2.0 + 2.0  # the deadline, plus slack for 2 busy cores


@pytest.mark.parametrize("server", [{"timeout": 1.0, "workers": 2, "max_connections": 4}], indirect=True)
def test_connections_beyond_the_cap_wait_and_are_served_after_the_drippers_go(server):
    _served_once(server)
    threads = threading.active_count()
    socks = [socket.create_connection(server.server_address, timeout=5) for _ in range(4)]
    try:
        for s in socks:
            s.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
        time.sleep(0.2)  # the loop has accepted all four: the cap is reached
        start = time.monotonic()
        with urllib.request.urlopen(f"{server.base}/health", timeout=10) as r:  # waits in the listen backlog
            assert json.loads(r.read())["ok"]
        waited = time.monotonic() - start
        # served once the drippers' deadline (1 s) and their 408s' linger (LINGER) freed a place
        assert 0.3 < waited < 1.0 + LINGER + 2.0, waited
        assert threading.active_count() <= threads
        for s in socks:
            assert _status_of(s.recv(4096)) == 408
    finally:
        for s in socks:
            s.close()


@pytest.mark.parametrize("server", [{"max_body": 1000}], indirect=True)
def test_an_oversized_body_gets_a_413_that_the_client_reads(server):
    body = bytes(4 << 20)  # more than the loopback buffers hold: the server must read it to be heard
    request = urllib.request.Request(f"{server.base}/search?k=1", data=body, method="POST")
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(request, timeout=10)
    assert e.value.code == 413
    assert "at most 1000 bytes" in json.loads(e.value.read())["error"]
    # a client that asks before sending (curl does) hears the 413 at once, and sends nothing
    reply = _raw(
        server,
        b"POST /search?k=1 HTTP/1.1\r\nHost: localhost\r\nContent-Length: 1000000000\r\n"
        b"Expect: 100-continue\r\n\r\n",
    )
    assert _status_of(reply) == 413 and b"100 Continue" not in reply
    # a body within the limit is asked for ("100 Continue") and answered
    with socket.create_connection(server.server_address, timeout=5) as s:
        png = _png((20, 10))
        assert len(png) < 1000
        s.sendall(
            b"POST /search?k=1 HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n"
            b"Expect: 100-continue\r\n\r\n" % len(png)
        )
        assert s.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        s.sendall(png)
        reply = _until_closed(s)
    assert _status_of(reply) == 200 and b'"20x10"' in reply


def test_a_body_arriving_in_pieces_is_read_whole_though_it_holds_a_blank_line(server):
    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("note", "one\r\n\r\ntwo")  # the bytes that end a request head, inside the body
    buf = io.BytesIO()
    Image.new("RGB", (7, 5)).save(buf, format="PNG", pnginfo=info)
    body = buf.getvalue()
    cut = body.index(b"\r\n\r\n") + 2
    with socket.create_connection(server.server_address, timeout=5) as s:
        s.sendall(b"POST /search?k=1 HTTP/1.1\r\nHost: localhost\r\nContent-Length: %d\r\n\r\n" % len(body))
        for piece in (body[:cut], body[cut:]):
            time.sleep(0.05)  # separate reads on the server
            s.sendall(piece)
        reply = _until_closed(s)
    assert _status_of(reply) == 200 and b'"7x5"' in reply


def test_a_head_over_the_limit_gets_a_431(server):
    reply = _raw(server, b"GET /health HTTP/1.1\r\nX-Big: " + b"a" * (80 << 10) + b"\r\n\r\n")
    assert _status_of(reply) == 431 and b'"error"' in reply
    with urllib.request.urlopen(f"{server.base}/health", timeout=5) as r:
        assert r.status == 200  # and the server goes on


def test_bad_pool_settings_are_one_line(server):
    with pytest.raises(UsageError, match="workers"):
        make_server(StubSearcher(), "127.0.0.1", 0, workers=0)
    with pytest.raises(UsageError, match="timeout"):
        make_server(StubSearcher(), "127.0.0.1", 0, timeout=0)


def test_host_header_must_be_this_server(server):
    port = server.server_address[1]
    for host, status in (
        (f"127.0.0.1:{port}", 200),
        (f"localhost:{port}", 200),
        ("localhost", 200),
        (f"evil.example:{port}", 403),
        ("127.0.0.1.nip.io", 403),
        ("10.0.0.1", 403),
        ("", 403),
    ):
        reply = _raw(server, f"GET /health HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        assert reply.startswith(f"HTTP/1.0 {status}".encode()) or reply.startswith(
            f"HTTP/1.1 {status}".encode()
        ), (host, reply[:60])


def test_malformed_content_length_is_a_400(server):
    for value in (b"abc", b"1e3", b"-5"):
        reply = _raw(
            server, b"POST /search?k=1 HTTP/1.1\r\nHost: localhost\r\nContent-Length: " + value + b"\r\n\r\n"
        )
        status = reply.split(b"\r\n", 1)[0]
        assert status.split()[1] in (b"400", b"413"), reply[:80]
        assert b'"error"' in reply
    assert (
        b" 400 "
        in _raw(server, b"POST /search HTTP/1.1\r\nHost: localhost\r\nContent-Length: x\r\n\r\n")[:20]
    )


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


def test_the_cli_passes_the_pool_flags_and_refuses_bad_ones_before_loading(monkeypatch, capsys, tmp_path):
    from mmalign import cli
    from mmalign.search import serve as serve_mod

    monkeypatch.chdir(tmp_path)
    (tmp_path / "i").mkdir()
    (tmp_path / "i" / "index.json").write_text("{}")  # the CLI checks the index folder before loading
    (tmp_path / "m").mkdir()  # and that the model path exists
    seen = {}
    monkeypatch.setattr(serve_mod, "Searcher", lambda *a: seen.setdefault("searcher", StubSearcher()))
    monkeypatch.setattr(
        serve_mod, "make_server", lambda searcher, host, port, **kw: seen.update(kw) or _Stopped()
    )
    assert (
        cli.main(
            [
                "serve",
                "--index",
                "i",
                "--model",
                "m",
                "--timeout",
                "3",
                "--workers",
                "2",
                "--max-connections",
                "5",
                "--max-per-client",
                "3",
            ]
        )
        == 0
    )
    assert (seen["timeout"], seen["workers"], seen["max_connections"], seen["max_per_client"]) == (
        3.0,
        2,
        5,
        3,
    )
    seen.clear()
    for flags in (
        ["--workers", "0"],
        ["--timeout", "inf"],
        ["--max-connections", "-1"],
        ["--max-per-client", "0"],
    ):
        assert cli.main(["serve", "--index", "i", "--model", "m", *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and flags[0] in err[0], err
        assert "searcher" not in seen  # refused before the model was loaded


class _Stopped:
    server_address = ("127.0.0.1", 0)

    def serve_forever(self):
        pass

    def server_close(self):
        pass


def test_queries_run_at_once_no_lock_around_the_searcher():
    """Two text queries meet inside the searcher: with a lock around it the second would wait
    for the first, which waits for the second (the barrier times out)."""
    meet = threading.Barrier(2, timeout=10)

    class Meeting(StubSearcher):
        def text(self, text, k, against, dedupe=True):
            meet.wait()  # both requests are inside the searcher at once
            return super().text(text, k, against, dedupe)

    srv = make_server(Meeting(), "127.0.0.1", 0, workers=2, access_log=lambda line: None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_address[1]}"
    answers: list = []

    def ask(word):
        with urllib.request.urlopen(f"{base}/search?text={word}&k=1", timeout=20) as r:
            answers.append(json.loads(r.read())["hits"][0]["caption"])

    try:
        threads = [threading.Thread(target=ask, args=(w,)) for w in ("one", "two")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert sorted(answers) == ["one", "two"] and not meet.broken
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_full_query_queue_is_a_503_with_retry_after():
    """The batcher refuses a query when its queue is full (Overloaded): the client gets a 503
    it can retry, not a dropped connection or a 500."""
    from mmalign.search.batcher import Overloaded

    class Full(StubSearcher):
        def text(self, text, k, against, dedupe=True):
            raise Overloaded("256 queries are already waiting; try again")

    srv = make_server(Full(), "127.0.0.1", 0, access_log=lambda line: None)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(f"http://127.0.0.1:{srv.server_address[1]}/search?text=a&k=1", timeout=20)
        assert err.value.code == 503 and err.value.headers["Retry-After"] == "1"
        assert json.loads(err.value.read()) == {"error": "256 queries are already waiting; try again"}
    finally:
        srv.shutdown()
        srv.server_close()
