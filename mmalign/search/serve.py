"""``mmalign serve``: a small HTTP front end to :class:`mmalign.search.searcher.Searcher` (stdlib only).

    GET  /                                       -> a search page (HTML, self-contained)
    GET  /health                                 -> {"ok": true, "dim": D, "indexes": ["image", "text"]}
    GET  /search?text=a+red+circle&k=10[&against=image|text][&dedupe=false]   -> JSON hits
    GET  /search?key=cat_0001&k=10[&against=...][&dedupe=...]  -> hits like an indexed item's image
    POST /search?k=10[&against=...][&dedupe=...]   body = image bytes           -> JSON hits
    GET  /thumb?row=N[&size=128]                 -> a JPEG thumbnail of a hit's image, read from its shard

``against`` picks the index searched: ``image`` (default, one hit per image) or ``text``
(one per caption; identical captions are folded into their best-scoring copy unless
``dedupe=false``).  Hits are ``{"rank", "key", "caption", "score", "row", "source_path"}``.

Bound to 127.0.0.1 unless told otherwise: there is no authentication.  Requests are
bounded: the query text (``max_text`` characters), ``k`` (``max_k``), the image body
(``max_body`` bytes, refused from its Content-Length before anything is read), the
image's pixels (``max_pixels``) and shape (at most ``image_shape.MAX_ASPECT``:1), both
read from its header before it is decoded, and a
thumbnail's side (``max_thumb``) and source image (``max_body`` bytes).  Thumbnails show
dataset images, so they are only served to a loopback client, whatever the bind address.

Connections are read by one thread and answered by a fixed pool of ``workers``
(:mod:`mmalign.search.serve_loop`): a slow or idle client holds a socket, never a thread.  A
request must arrive whole within ``timeout`` seconds (else 408) and be taken by a worker
within ``timeout`` more (else 503, never run); a request taken is answered however long it
takes.  A body over ``max_body`` gets a 413 the client can read, two ``Content-Length``
headers or a ``Transfer-Encoding`` a 400, at most ``max_connections`` are open at once (more
wait in the listen backlog) and at most ``max_per_client`` from one address (more get a 429).  The model and the FAISS indexes sit behind one lock
(queries are short; images are decoded before taking it).  A ``Host`` header other than
the bound address or localhost is refused: a web page cannot reach the server through a DNS name rebound to 127.0.0.1.
Each request writes one access-log line (client, method, path, status, milliseconds)
to stderr, or to the ``access_log`` callable given to :func:`make_server`.
"""

from __future__ import annotations

import io
import ipaddress
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from urllib.parse import parse_qs, urlsplit

from mmalign.errors import UsageError, UserError
from mmalign.search.searcher import MAX_QUERY_PIXELS, ImageUnavailable, Searcher
from mmalign.search.serve_key import key_vector
from mmalign.search.serve_loop import PooledHTTPServer, PooledRequestHandler, printable
from mmalign.search.serve_page import PAGE

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


class _Refused(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def _host_name(header: str) -> str:
    """``Host`` header -> the name without port or IPv6 brackets, lower case."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def _is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket reports 127.0.0.1 as ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # sys.stderr looked up per line: it may be replaced


class _Handler(PooledRequestHandler):
    searcher: Searcher
    lock: threading.Lock
    max_k: int
    max_text: int
    max_body: int
    max_pixels: int
    max_thumb: int
    access_log: Callable[[str], None]

    def log_message(self, fmt, *args):  # http.server's own lines are replaced by one access line per request
        pass

    def handle_one_request(self):
        start = time.monotonic()
        self._status, self.command, self.path, self._undelivered = None, None, None, None
        super().handle_one_request()
        if self.command is None and self._status is None:
            return  # the client closed or stalled before sending a request
        ms = 1000 * (time.monotonic() - start)
        # a reply that could not be written is said so: the status is what was meant, not what was seen
        note = f" (reply not delivered: {self._undelivered})" if self._undelivered else ""
        self.access_log(
            f"{self.client_address[0]} {printable(self.command or '-')} "
            f"{printable(self.path or '-')} {self._status or '-'} {ms:.1f} ms{note}"
        )

    def send_response(self, code, message=None):
        self._status = code
        super().send_response(code, message)

    def _send(self, status: int, content_type: str, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _reply(self, status: int, payload: dict) -> None:
        self._send(
            status,
            "application/json",
            json.dumps(payload).encode("utf-8"),
            {"X-Content-Type-Options": "nosniff"},
        )

    def _params(self) -> tuple[str, dict]:
        parts = urlsplit(self.path)
        # a blank value is as good as absent (a form's empty field), but `key=` is a key query's mistake
        pairs = parse_qs(parts.query, keep_blank_values=True).items()
        return parts.path, {k: v[-1] for k, v in pairs if v[-1] or k == "key"}

    def _check_host(self) -> None:
        name = _host_name(self.headers.get("Host", ""))
        address = self.server.server_address  # (host, port, ...) for the TCP servers we run
        bound = str(address[0] if isinstance(address, tuple) else address).lower()
        wildcard = bound in ("0.0.0.0", "::")
        # A rebinding attack needs a DNS name: IP literals are only allowed for a wildcard bind.
        if not (name in LOCAL_NAMES or name == bound or (wildcard and _is_ip(name))):
            raise _Refused(403, f"Host {name!r} is not this server (use {bound} or localhost)")

    def _k_against(self, params: dict) -> tuple[int, str]:
        try:
            k = int(params.get("k", 10))
        except ValueError:
            raise UsageError("k must be an integer") from None
        if not 1 <= k <= self.max_k:
            raise UsageError(f"k must be in [1, {self.max_k}]")
        return k, params.get("against", "image")

    def _dedupe(self, params: dict) -> bool:
        value = params.get("dedupe", "true").lower()
        if value not in ("true", "1", "yes", "false", "0", "no"):
            raise UsageError("dedupe must be true or false")
        return value in ("true", "1", "yes")

    def _handle(self, route) -> None:
        try:
            try:
                self._check_host()
                route()
            except _Refused as e:
                self._reply(e.status, {"error": str(e)})
            except UserError as e:
                self._reply(400, {"error": str(e)})
        except (
            TimeoutError,
            ConnectionError,
        ) as e:  # a client that stalled or left (mid-body, or before the reply)
            self.close_connection = True
            self._undelivered = (
                "the client did not read it in time"
                if isinstance(e, TimeoutError)
                else f"the client left ({type(e).__name__})"
            )

    def do_GET(self):
        self._handle(self._get)

    def do_POST(self):
        self._handle(self._post)

    def _get(self) -> None:
        path, params = self._params()
        if path in ("/", "/index.html"):
            # the page's script and style are inline; nothing else may load (no CDN, no frames); blob:
            # images are the user's own uploaded query file, shown beside its results
            return self._send(
                200,
                "text/html; charset=utf-8",
                PAGE.encode("utf-8"),
                {
                    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
                    "style-src 'unsafe-inline'; img-src 'self' blob:; connect-src 'self'; "
                    "frame-ancestors 'none'",
                    "X-Content-Type-Options": "nosniff",
                },
            )
        if path == "/health":
            return self._reply(
                200, {"ok": True, "dim": self.searcher.dim, "indexes": sorted(self.searcher.indexes)}
            )
        if path == "/thumb":
            return self._thumb(params)
        if path != "/search":
            return self._reply(404, {"error": f"no route {path}"})
        if "key" in params:
            return self._by_key(params)
        text = params.get("text", "")
        if not text or len(text) > self.max_text:
            raise UsageError(f"text must be 1..{self.max_text} characters")
        k, against = self._k_against(params)
        dedupe = self._dedupe(params)
        with self.lock:
            hits = self.searcher.text(text, k, against, dedupe=dedupe)
        return self._reply(200, {"query": text, "hits": [asdict(h) for h in hits]})

    def _by_key(self, params: dict) -> None:
        """ "More like this": the indexed item's own image vector is the query (no model needed)."""
        key = params["key"]
        if not key or len(key) > self.max_text:
            raise UsageError(f"key must be 1..{self.max_text} characters")
        if "text" in params:
            raise UsageError("give text or key, not both")
        k, against = self._k_against(params)
        dedupe = self._dedupe(params)
        with self.lock:
            vector = key_vector(self.searcher, key)  # None: no such key
            if vector is None:
                raise _Refused(404, f"no indexed image has key {printable(key, 100)!r}")
            hits = self.searcher.search_vectors(vector[None], k, against, dedupe)[0]
        return self._reply(200, {"key": key, "hits": [asdict(h) for h in hits]})

    def _thumb(self, params: dict) -> None:
        from PIL import Image

        from mmalign.data.shards import BadSample, open_image

        if not _is_loopback(str(self.client_address[0])):
            raise _Refused(403, "thumbnails are served to this machine only")
        try:
            row, size = int(params.get("row", "")), int(params.get("size", 128))
        except ValueError:
            raise UsageError("row and size must be integers") from None
        if not 16 <= size <= self.max_thumb:
            raise UsageError(f"size must be in [16, {self.max_thumb}]")
        try:
            data = self.searcher.image_bytes(row, self.max_body)  # no model or index: no lock
            image = open_image(data, self.max_pixels)  # the pixel count is checked before decoding
        except ImageUnavailable as e:
            raise _Refused(404, str(e)) from None
        except BadSample as e:
            raise _Refused(404, f"row {row}: the stored image is not readable ({e.reason})") from None
        image = image.convert("RGB")
        image.thumbnail((size, size), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=85)
        return self._send(200, "image/jpeg", buf.getvalue(), {"Cache-Control": "private, max-age=600"})

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
            raise UsageError(f"Content-Length {raw[:40]!r} is not a number") from None
        if not 0 < length <= self.max_body:
            self.close_connection = True
            raise _Refused(413, f"image body must be 1..{self.max_body} bytes")
        k, against = self._k_against(params)
        dedupe = self._dedupe(params)
        data = self.rfile.read(length)
        if len(data) < length:
            self.close_connection = True
            raise UsageError(f"body ended after {len(data)} of {length} bytes")
        try:
            image = open_image(data, self.max_pixels)  # the pixel count is checked before decoding
        except BadSample as e:
            if e.reason == "decompression_bomb":
                raise _Refused(413, f"image has too many pixels ({e}); at most {self.max_pixels}") from None
            if e.reason == "extreme_aspect":  # a resize would blow it up: refused from its header
                raise _Refused(413, f"image is too thin ({e})") from None
            raise UsageError(f"body is not a readable image ({e.reason})") from None
        with self.lock:
            hits = self.searcher.image(image, k, against, dedupe=dedupe)
        return self._reply(200, {"hits": [asdict(h) for h in hits]})


def check_pool(timeout: float, workers: int, max_connections: int, max_per_client: int = 1) -> None:
    if workers < 1 or max_connections < 1 or not 0 < timeout < float("inf"):
        raise UsageError(
            f"serve: --workers ({workers}) and --max-connections ({max_connections}) must be >= 1 "
            f"and --timeout ({timeout}) a finite number > 0"
        )
    if max_per_client < 1:
        raise UsageError(f"serve: --max-per-client ({max_per_client}) must be >= 1")


def make_server(
    searcher: Searcher,
    host: str = "127.0.0.1",
    port: int = 8765,
    *,
    max_k: int = 100,
    max_text: int = 1000,
    max_body: int = 8 << 20,
    max_pixels: int = MAX_QUERY_PIXELS,
    max_thumb: int = 256,
    timeout: float = 10.0,
    workers: int = 8,
    max_connections: int = 256,
    max_per_client: int = 32,
    access_log: Callable[[str], None] | None = None,
) -> PooledHTTPServer:
    """An HTTP server (port 0 = any free port); call ``serve_forever()`` on it.
    ``timeout``: the seconds a request has to arrive whole, to wait for a worker, and its reply
    to be written; ``workers``: the threads that answer requests; ``max_connections``: open at
    once; ``max_per_client``: open at once from one client address.
    ``access_log`` receives one line per request (default: stderr)."""
    check_pool(timeout, workers, max_connections, max_per_client)
    log_lock = threading.Lock()
    write = access_log or _stderr_line

    def log_line(line: str) -> None:
        with log_lock:  # whole lines from concurrent threads
            write(line)

    handler = type(
        "Handler",
        (_Handler,),
        {
            "searcher": searcher,
            "lock": threading.Lock(),
            "max_k": int(max_k),
            "max_text": int(max_text),
            "max_body": int(max_body),
            "max_pixels": int(max_pixels),
            "max_thumb": int(max_thumb),
            "access_log": staticmethod(log_line),
        },
    )
    try:
        return PooledHTTPServer(
            (host, int(port)),
            handler,
            workers=workers,
            max_connections=max_connections,
            timeout=timeout,
            max_body=max_body,
            max_per_client=max_per_client,
            access_log=log_line,
        )
    except (OSError, OverflowError) as e:
        why = getattr(e, "strerror", None) or e
        raise UsageError(f"--host/--port: cannot listen on {host}:{port} ({why})") from None


def serve(
    index_dir,
    model_dir,
    host: str = "127.0.0.1",
    port: int = 8765,
    max_k: int = 100,
    *,
    timeout: float = 10.0,
    workers: int = 8,
    max_connections: int = 256,
    max_per_client: int = 32,
) -> None:
    check_pool(
        timeout, workers, max_connections, max_per_client
    )  # before the model loads: a bad flag fails at once
    server = make_server(
        Searcher(index_dir, model_dir),
        host,
        port,
        max_k=max_k,
        timeout=timeout,
        workers=workers,
        max_connections=max_connections,
        max_per_client=max_per_client,
    )
    base = f"http://{host}:{server.server_address[1]}"
    print(
        f"serving {index_dir}: search page {base}/ , JSON {base}/search?text=...&k=10 (Ctrl-C stops)",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
