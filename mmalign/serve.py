"""``mmalign serve``: a small HTTP front end to :class:`mmalign.search.Searcher` (stdlib only).

    GET  /search?text=a+red+circle&k=10[&against=image|text]   -> JSON hits
    POST /search?k=10[&against=...]   body = image bytes        -> JSON hits
    GET  /health                                                 -> {"ok": true, "dim": D, ...}

Bound to 127.0.0.1 unless told otherwise: there is no authentication.  Requests are
bounded: the query text (``max_text`` characters), ``k`` (``max_k``), the image body
(``max_body`` bytes, refused from its Content-Length before anything is read) and the
image's pixels (``max_pixels``, read from its header before it is decoded).

One thread per connection (``ThreadingHTTPServer``), so an idle or slow client cannot
hold up the others; every socket read gives up after ``timeout`` seconds.  The model
and the FAISS indexes sit behind one lock (queries are short; images are decoded
before taking it).  A ``Host`` header other than the bound address or localhost is
refused: a web page cannot reach the server through a DNS name rebound to 127.0.0.1.
"""

from __future__ import annotations

import ipaddress
import json
import threading
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from mmalign.config import ConfigError
from mmalign.search import MAX_QUERY_PIXELS, Searcher

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _host_name(header: str) -> str:
    """``Host`` header -> the name without port or IPv6 brackets, lower case."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


class _Handler(BaseHTTPRequestHandler):
    searcher: Searcher
    lock: threading.Lock
    max_k: int
    max_text: int
    max_body: int
    max_pixels: int
    timeout = 10.0  # seconds per socket read (StreamRequestHandler sets it on the connection)

    def log_message(self, fmt, *args):  # quiet by default; the CLI prints the address
        pass

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _params(self) -> tuple[str, dict]:
        parts = urlsplit(self.path)
        return parts.path, {k: v[-1] for k, v in parse_qs(parts.query).items()}

    def _check_host(self) -> None:
        name = _host_name(self.headers.get("Host", ""))
        bound = str(self.server.server_address[0]).lower()
        wildcard = bound in ("0.0.0.0", "::")
        # A rebinding attack needs a DNS name: IP literals are only allowed for a wildcard bind.
        if not (name in LOCAL_NAMES or name == bound or (wildcard and _is_ip(name))):
            raise _Refused(403, f"Host {name!r} is not this server (use {bound} or localhost)")

    def _k_against(self, params: dict) -> tuple[int, str]:
        try:
            k = int(params.get("k", 10))
        except ValueError:
            raise ConfigError("k must be an integer") from None
        if not 1 <= k <= self.max_k:
            raise ConfigError(f"k must be in [1, {self.max_k}]")
        return k, params.get("against", "image")

    def _handle(self, route) -> None:
        try:
            self._check_host()
            route()
        except _Refused as e:
            self._reply(e.status, {"error": str(e)})
        except ConfigError as e:
            self._reply(400, {"error": str(e)})
        except (TimeoutError, ConnectionError):  # a client that stalled or left mid-body: drop it
            self.close_connection = True

    def do_GET(self):
        self._handle(self._get)

    def do_POST(self):
        self._handle(self._post)

    def _get(self) -> None:
        path, params = self._params()
        if path == "/health":
            return self._reply(200, {"ok": True, "dim": self.searcher.dim, "indexes": sorted(self.searcher.indexes)})
        if path != "/search":
            return self._reply(404, {"error": f"no route {path}"})
        text = params.get("text", "")
        if not text or len(text) > self.max_text:
            raise ConfigError(f"text must be 1..{self.max_text} characters")
        k, against = self._k_against(params)
        with self.lock:
            hits = self.searcher.text(text, k, against)
        return self._reply(200, {"query": text, "hits": [asdict(h) for h in hits]})

    def _post(self) -> None:
        from mmalign.data.shards import BadSample, open_image

        path, params = self._params()
        if path != "/search":
            self.close_connection = True  # the unread body must not be parsed as a next request
            return self._reply(404, {"error": f"no route {path}"})
        raw = self.headers.get("Content-Length") or "0"
        try:
            length = int(raw)
        except ValueError:
            self.close_connection = True
            raise ConfigError(f"Content-Length {raw[:40]!r} is not a number") from None
        if not 0 < length <= self.max_body:
            self.close_connection = True
            raise _Refused(413, f"image body must be 1..{self.max_body} bytes")
        k, against = self._k_against(params)
        data = self.rfile.read(length)
        if len(data) < length:
            self.close_connection = True
            raise ConfigError(f"body ended after {len(data)} of {length} bytes")
        try:
            image = open_image(data, self.max_pixels)  # the pixel count is checked before decoding
        except BadSample as e:
            if e.reason == "decompression_bomb":
                raise _Refused(413, f"image has too many pixels ({e}); at most {self.max_pixels}") from None
            raise ConfigError(f"body is not a readable image ({e.reason})") from None
        with self.lock:
            hits = self.searcher.image(image, k, against)
        return self._reply(200, {"hits": [asdict(h) for h in hits]})


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client never keeps the process alive
    request_queue_size = 128  # listen() backlog (socketserver's default is 5)


def make_server(searcher: Searcher, host: str = "127.0.0.1", port: int = 8765, *, max_k: int = 100,
                max_text: int = 1000, max_body: int = 8 << 20, max_pixels: int = MAX_QUERY_PIXELS,
                timeout: float = 10.0) -> ThreadingHTTPServer:
    """A threaded HTTP server (port 0 = any free port); call ``serve_forever()`` on it."""
    handler = type("Handler", (_Handler,), {
        "searcher": searcher, "lock": threading.Lock(), "max_k": int(max_k), "max_text": int(max_text),
        "max_body": int(max_body), "max_pixels": int(max_pixels), "timeout": float(timeout)})
    try:
        return _Server((host, int(port)), handler)
    except (OSError, OverflowError) as e:
        why = getattr(e, "strerror", None) or e
        raise ConfigError(f"--host/--port: cannot listen on {host}:{port} ({why})") from None


def serve(index_dir, model_dir, host: str = "127.0.0.1", port: int = 8765, max_k: int = 100) -> None:
    server = make_server(Searcher(index_dir, model_dir), host, port, max_k=max_k)
    print(f"serving {index_dir} on http://{host}:{server.server_address[1]}/search?text=...&k=10 (Ctrl-C stops)")
    try:
        server.serve_forever()
    finally:
        server.server_close()
