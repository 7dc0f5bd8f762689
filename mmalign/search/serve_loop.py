"""The connection loop of ``mmalign serve``: one thread reads requests, a fixed pool answers them.

A slow client costs the server a socket and a buffer, never a thread.  The thread that
calls :meth:`PooledHTTPServer.serve_forever` accepts connections and reads all of them
without blocking (``selectors``); only a request that has arrived whole (request line,
headers, and the ``Content-Length`` bytes of its body) is handed to one of ``workers``
threads, started once.  So 300 clients dripping one byte a second hold 300 sockets in
one thread, the pool stays free for complete requests, and the thread count never grows.

Deadlines (``timeout`` seconds each):

* a request must arrive whole within ``timeout`` of its connection opening, else the client
  gets a 408 and the connection is closed; a connection that sent nothing is closed without
  a reply;
* a whole request must be taken by a worker within ``timeout`` of being queued, else it gets
  a 503 (the server is busy) and is never run;
* work a worker has taken is never timed out: it runs to completion and is answered; only
  the writing of the reply, from its first byte, must be done within ``timeout`` (a client
  that does not read).  A reply that could not be delivered is said so in the access log.

Bounds: at most ``max_connections`` open connections (more wait in the listen backlog,
``request_queue_size``, until one closes), and at most ``max_per_client`` of them from one
client address: more are answered 429 and closed at once, so one client re-opening hundreds
of sockets cannot hold every place while others wait; a request head of at most ``MAX_HEAD``
bytes (else 431) with at most one ``Content-Length`` and no ``Transfer-Encoding`` (else 400:
two framings of one body are a request-smuggling shape); a body of at most ``max_body``
bytes, else a 413 as soon as the headers are in.  Each reply the loop writes itself (400,
408, 413, 429, 431, 503) carries ``X-Content-Type-Options: nosniff``; all but 429 and 503
are followed by a half-close and a
bounded drain (the rest of the client's input is read and dropped, at most ``DRAIN_BYTES``,
for ``timeout`` s after a 413, ``LINGER`` after the others): closing with unread input would send a TCP
reset, and the client would see a broken pipe instead of the reply.
"""

from __future__ import annotations

import io
import json
import queue
import re
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer

MAX_HEAD = 64 << 10  # request line + headers (http.server's own line limit is 64 KiB)
DRAIN_BYTES = 64 << 20  # after a loop reply: input read and dropped so the client sees the reply
LINGER = 1.0  # seconds a 408 or 431 client has to read it before the close (a 413's: the timeout)
ACCEPT_BATCH = 64  # connections accepted per turn of the loop, at most
HEAD_END = re.compile(rb"\r?\n\r?\n")  # the empty line that ends a request head


def printable(text: str, limit: int = 200) -> str:
    """A request path for the log: bounded, no control characters (no forged log lines)."""
    text = text[:limit] + ("..." if len(text) > limit else "")
    return "".join(c if c.isprintable() else "?" for c in text)


def _headers(head: bytes, name: bytes) -> list[bytes]:
    """Every ``name:`` header's value in a raw request head (case-insensitive), in order."""
    values = []
    for line in head.split(b"\n")[1:]:
        key, sep, value = line.partition(b":")
        if sep and key.strip().lower() == name:
            values.append(value.strip())
    return values


def _header(head: bytes, name: bytes) -> bytes | None:
    """The first ``name:`` header's value in a raw request head (case-insensitive), else None."""
    values = _headers(head, name)
    return values[0] if values else None


def _framing_problem(head: bytes) -> str | None:
    """Why the body's length is ambiguous (two ``Content-Length``, or ``Transfer-Encoding``), or None."""
    lengths = _headers(head, b"content-length")
    if len(lengths) > 1:
        return f"{len(lengths)} Content-Length headers; a request has at most one"
    if _headers(head, b"transfer-encoding"):
        both = " with Content-Length" if lengths else ""
        return f"Transfer-Encoding{both} is not accepted; send the body with one Content-Length"
    return None


def _body_length(head: bytes) -> int:
    """The body the loop waits for. A malformed Content-Length counts as none: the handler
    answers it (400) and closes the connection."""
    value = _header(head, b"content-length")
    return int(value) if value is not None and value.isdigit() else 0


def _reply_bytes(status: int, message: str) -> bytes:
    body = json.dumps({"error": message}).encode("utf-8")
    return (
        f"HTTP/1.0 {status} {HTTPStatus(status).phrase}\r\nContent-Type: application/json\r\n"
        f"X-Content-Type-Options: nosniff\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode("ascii") + body


def _request_line(data: bytes) -> tuple[str, str]:
    words = data.split(b"\n", 1)[0].decode("latin-1").split()
    return (words[0], words[1]) if len(words) >= 2 else ("-", "-")


class _Conn:
    """One client connection, owned by the loop thread (a worker only borrows its socket)."""

    __slots__ = (
        "sock",
        "address",
        "buf",
        "scanned",
        "head_end",
        "length",
        "deadline",
        "started",
        "state",
        "drained",
        "request",
    )

    def __init__(self, sock: socket.socket, address, now: float, timeout: float):
        self.sock, self.address = sock, address
        self.buf, self.scanned = bytearray(), 0  # bytes received; how far HEAD_END has looked
        # once the head is in: where it ends, the body's length
        self.head_end: int | None = None
        self.length = 0
        self.started, self.deadline = now, now + timeout
        # read -> queued -> busy (a worker took it) -> closed; queued -> expired (503) -> closed;
        # or read -> drain -> closed
        self.state = "read"
        self.drained, self.request = 0, b""

    def request_line(self) -> tuple[str, str]:
        return _request_line(bytes(self.buf[:4096]))


class ReplyWriter(io.RawIOBase):
    """A handler's ``wfile``: the reply must be written within ``timeout`` seconds of its first
    byte (the work before it is not timed: a request taken is answered)."""

    def __init__(self, sock: socket.socket, timeout: float):
        super().__init__()
        self.sock, self.timeout = sock, timeout
        self.deadline: float | None = None

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the reply was not written in time")
        self.sock.settimeout(left)  # sendall's timeout bounds the whole call (Python >= 3.5)
        self.sock.sendall(data)
        return len(data)


class PooledRequestHandler(BaseHTTPRequestHandler):
    """A handler for one request the loop has read whole: ``request`` is (socket, bytes, write timeout)."""

    def setup(self):
        sock, data, timeout = self.request
        self.connection = sock
        self.rfile = io.BytesIO(data)
        self.wfile = ReplyWriter(sock, timeout)

    def handle(self):
        # one request per connection (HTTP/1.0 replies, "Connection: close"): the loop closes it after
        self.handle_one_request()
        self.close_connection = True

    def handle_expect_100(self):
        return True  # the loop has already answered "100 Continue" and read the body


class PooledHTTPServer(HTTPServer):
    """``HTTPServer`` with the loop above in place of one thread per connection."""

    request_queue_size = 128  # listen() backlog (socketserver's default is 5)

    def __init__(
        self,
        address,
        handler,
        *,
        workers: int = 8,
        max_connections: int = 256,
        timeout: float = 10.0,
        max_body: int = 8 << 20,
        max_per_client: int = 32,
        access_log: Callable[[str], None] | None = None,
    ):
        super().__init__(address, handler)  # binds and listens
        self.workers, self.max_connections = int(workers), int(max_connections)
        self.max_per_client = int(max_per_client)
        self._open_from: dict[str, int] = {}  # client address -> its open connections (loop thread)
        self._turned_away = 0  # connections refused for their address's count (logged at powers of two)
        self.request_timeout, self.max_body = float(timeout), int(max_body)  # not socketserver's `timeout`
        self.access_log = access_log or (lambda line: None)
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._claim = threading.Lock()  # a queued request is either taken by a worker or expired by the loop
        self._returned: deque = deque()  # connections whose reply is done, to close (loop thread)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop, self._stopped = threading.Event(), threading.Event()
        self._stopped.set()
        self._accept_after = 0.0  # after a failed accept() (out of descriptors): a pause, not a busy loop

    # ------------------------------------------------------------- the loop thread

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        self._stopped.clear()
        pool = [
            threading.Thread(target=self._work, name=f"serve-worker-{i}", daemon=True)
            for i in range(self.workers)
        ]
        for thread in pool:
            thread.start()
        sel = selectors.DefaultSelector()
        self.socket.setblocking(False)
        sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        conns: set[_Conn] = set()
        accepting = False
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                # at the cap, new connections wait in the listen backlog: no thread, no buffer
                if accepting != (len(conns) < self.max_connections and now >= self._accept_after):
                    accepting = not accepting
                    (
                        sel.register(self.socket, selectors.EVENT_READ, "listen")
                        if accepting
                        else sel.unregister(self.socket)
                    )
                waits = [c.deadline - now for c in conns if c.state != "busy"] + [self._accept_after - now]
                for key, _ in sel.select(max(0.0, min(poll_interval, *waits))):
                    if key.data == "wake":
                        self._take_back(sel, conns)
                    elif key.data == "listen":
                        self._accept(sel, conns)
                    else:
                        try:
                            self._readable(sel, conns, key.data)
                        except OSError:  # one client's socket failing must not stop the loop
                            self._close(sel, conns, key.data)
                self._expire(sel, conns)
        finally:
            for conn in list(conns):
                self._close(sel, conns, conn)
            for _ in pool:
                self._jobs.put(None)
            end = time.monotonic() + self.request_timeout
            for thread in pool:
                thread.join(max(0.0, end - time.monotonic()))
            sel.close()
            self._stop.clear()
            self._stopped.set()

    def _accept(self, sel, conns: set) -> None:
        # at most ACCEPT_BATCH a turn: a client re-opening as fast as it is turned away must not keep
        # the loop from reading the others
        for _ in range(ACCEPT_BATCH):
            if len(conns) >= self.max_connections:
                return
            try:
                sock, address = self.socket.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors, or the client already left: try again shortly
                self._accept_after = time.monotonic() + 0.1
                return
            sock.setblocking(False)
            client = str(address[0])
            if self._open_from.get(client, 0) >= self.max_per_client:
                self._turn_away(sock, client)
                continue
            self._open_from[client] = self._open_from.get(client, 0) + 1
            conn = _Conn(sock, address, time.monotonic(), self.request_timeout)
            conns.add(conn)
            sel.register(sock, selectors.EVENT_READ, conn)

    def _turn_away(self, sock: socket.socket, client: str) -> None:
        """A 429 and a close, at once: this address already holds ``max_per_client`` connections."""
        try:
            sock.send(
                _reply_bytes(
                    429, f"over {self.max_per_client} open connections from {client}; close one and retry"
                )
            )
            sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        sock.close()
        self._turned_away += 1
        n = self._turned_away
        if n & (n - 1) == 0:  # the first, then at powers of two: a churning client cannot flood the log
            self.access_log(
                f"{printable(client)} - - 429 0.0 ms (over {self.max_per_client} open connections "
                f"from one address; {n} turned away so far)"
            )

    def _readable(self, sel, conns: set, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(1 << 16)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # the client closed (or reset) its side
            return self._close(sel, conns, conn)
        if conn.state == "drain":
            conn.drained += len(data)
            if conn.drained > DRAIN_BYTES:
                self._close(sel, conns, conn)
            return
        conn.buf += data
        self._advance(sel, conns, conn)

    def _advance(self, sel, conns: set, conn: _Conn) -> None:
        """Hand the request to a worker once it is whole; refuse it as soon as it cannot be served."""
        if conn.head_end is None:
            found = HEAD_END.search(conn.buf, max(0, conn.scanned - 3))  # (a dripped head is scanned once)
            conn.scanned = len(conn.buf)
            if found is None or found.end() > MAX_HEAD:
                if found is not None or len(conn.buf) > MAX_HEAD:
                    self._refuse(sel, conns, conn, 431, f"the request head is over {MAX_HEAD} bytes")
                return
            conn.head_end, head = found.end(), bytes(conn.buf[: found.end()])
            ambiguous = _framing_problem(head)
            if ambiguous is not None:
                return self._refuse(sel, conns, conn, 400, ambiguous)
            conn.length = _body_length(head)
            if conn.length > self.max_body:
                return self._refuse(
                    sel,
                    conns,
                    conn,
                    413,
                    f"the body must be at most {self.max_body} bytes, this one is {conn.length}",
                )
            expect = _header(head, b"expect")
            if (
                len(conn.buf) < conn.head_end + conn.length
                and expect is not None
                and expect.lower() == b"100-continue"
            ):
                self._send_now(
                    conn, b"HTTP/1.1 100 Continue\r\n\r\n"
                )  # the client waits for it to send the body
        if len(conn.buf) < conn.head_end + conn.length:
            return
        request = bytes(
            conn.buf[: conn.head_end + conn.length]
        )  # anything after it: one request per connection
        conn.state, conn.buf, conn.request = "queued", bytearray(), request
        conn.deadline = time.monotonic() + self.request_timeout  # to be taken by a worker, else a 503
        sel.unregister(conn.sock)
        self._jobs.put((conn, request))

    def _expire(self, sel, conns: set) -> None:
        now = time.monotonic()
        for conn in [c for c in conns if c.state != "busy" and c.deadline <= now]:
            if conn.state == "queued":
                self._too_busy(sel, conns, conn)
            elif conn.state == "read" and conn.buf:
                self._refuse(
                    sel, conns, conn, 408, f"the request did not arrive within {self.request_timeout:g} s"
                )
            else:
                self._close(sel, conns, conn)  # idle, or done draining

    def _refuse(self, sel, conns: set, conn: _Conn, status: int, message: str) -> None:
        """Reply ``status`` from the loop, half-close, then drop the client's input for a while."""
        method, path = conn.request_line()
        self._send_now(conn, _reply_bytes(status, message))
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return self._close(sel, conns, conn)
        # an upload refused early needs the time to finish sending; anything else a moment to read
        linger = self.request_timeout if status == 413 else min(self.request_timeout, LINGER)
        conn.state, conn.deadline, conn.drained = "drain", time.monotonic() + linger, len(conn.buf)
        conn.buf = bytearray()
        self._log(conn, method, path, status)

    def _too_busy(self, sel, conns: set, conn: _Conn) -> None:
        """A 503 for a request no worker took within the timeout: it is never run."""
        with self._claim:
            if conn.state != "queued":
                return  # a worker took it just now
            conn.state = "expired"
        waited = time.monotonic() - conn.deadline + self.request_timeout
        self._send_now(
            conn,
            _reply_bytes(
                503,
                f"the server is busy: the request waited {waited:.1f} s for a worker "
                f"(at most {self.request_timeout:g} s) and was not run; retry later",
            ),
        )
        method, path = _request_line(conn.request)
        self._log(conn, method, path, 503)
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self._close(sel, conns, conn)

    @staticmethod
    def _send_now(conn: _Conn, data: bytes) -> None:
        try:  # a short reply on a socket with nothing queued: the kernel's buffer takes it whole
            conn.sock.send(data)
        except OSError:
            pass  # the client has gone: reading next will say so

    def _log(self, conn: _Conn, method: str, path: str, status: int) -> None:
        ms = 1000 * (time.monotonic() - conn.started)
        self.access_log(f"{conn.address[0]} {printable(method)} {printable(path)} {status} {ms:.1f} ms")

    def _close(self, sel, conns: set, conn: _Conn) -> None:
        if conn.state != "busy":
            try:
                sel.unregister(conn.sock)
            except (KeyError, ValueError):
                pass
        conn.state = "closed"
        if conn in conns:
            conns.discard(conn)
            client = str(conn.address[0])
            left = self._open_from.get(client, 1) - 1
            if left > 0:
                self._open_from[client] = left
            else:
                self._open_from.pop(client, None)
        conn.sock.close()

    def _take_back(self, sel, conns: set) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        while self._returned:
            conn = self._returned.popleft()
            if conn.state == "busy":  # else closed meanwhile (shutdown)
                self._close(sel, conns, conn)

    # ------------------------------------------------------------- the workers

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, request = job
            with self._claim:
                if conn.state != "queued":
                    continue  # it waited too long and the loop answered 503, or the server stopped
                conn.state = "busy"  # taken: from here it runs to completion and is answered
            try:
                conn.sock.setblocking(True)
                self.RequestHandlerClass(
                    (conn.sock, request, self.request_timeout),
                    conn.address,
                    self,  # type: ignore[arg-type]  # typeshed's Self is this server's class
                )
            except OSError:
                pass  # the client left mid-reply, or the loop closed the socket at shutdown
            except Exception:  # a bug in a route must not take a worker with it
                self.handle_error(conn.sock, conn.address)
            self._returned.append(conn)
            try:
                self._wake_w.send(b"\0")
            except OSError:
                pass  # the loop has stopped

    # ------------------------------------------------------------- lifecycle

    def shutdown(self) -> None:
        self._stop.set()
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        self._wake_r.close()
        self._wake_w.close()
