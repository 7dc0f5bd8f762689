"""``mmalign serve``: a small HTTP front end to :class:`mmalign.search.searcher.Searcher` (stdlib only).

    GET  /                                       -> a search page (HTML, self-contained)
    GET  /health[?index=NAME]                    -> {"ok": true, "dim": D, "indexes": ["image", "text"], ...}
    GET  /search?text=a+red+circle&k=10[&against=image|text][&dedupe=false][&index=NAME]   -> JSON hits
    GET  /search?key=cat_0001&k=10[&against=...][&dedupe=...]  -> hits like an indexed item's image
    POST /search?k=10[&against=...][&dedupe=...]   body = image bytes           -> JSON hits
    GET  /thumb?row=N[&size=128][&index=NAME]    -> a JPEG thumbnail of a hit's image, read from its shard
    GET  /indices-list, POST /knn-service, POST /metadata   -> clip-retrieval's back-end protocol
                                                    (:mod:`mmalign.search.serve_knn`)

``against`` picks the index searched: ``image`` (default, one hit per image) or ``text``
(one per caption; identical captions are folded into their best-scoring copy unless
``dedupe=false``).  Hits are ``{"rank", "key", "caption", "score", "row", "source_path", ...}``
(the searcher's :class:`Hit`).  Several indexes may be served (``{name: Searcher}``); ``index``
names one (default: the first).  One searcher holds the model (the first that has one): the
others' queries are embedded by it, so the model loads once.

Bound to 127.0.0.1 unless told otherwise: there is no authentication.  Requests are
bounded: the query text (``max_text`` characters), ``k`` (``max_k``; clip-retrieval's counts
are clamped to it, said in a header), the body (``max_body`` bytes, refused from its
Content-Length before anything is read), the image's pixels (``max_pixels``) and shape (at
most ``image_shape.MAX_ASPECT``:1), both read from its header before it is decoded, and a
thumbnail's side (``max_thumb``) and source image (``max_body`` bytes).  Thumbnails show
dataset images, so they are only served to a loopback client, whatever the bind address.
``image_url`` queries fetch only from ``allow_url_queries`` hosts (:mod:`serve_fetch`).

Connections are read by one thread and answered by a fixed pool of ``workers``
(:mod:`mmalign.search.serve_loop`): a slow or idle client holds a socket, never a thread.  A
request must arrive whole within ``timeout`` seconds (else 408) and be taken by a worker
within ``timeout`` more (else 503, never run); a request taken is answered however long it
takes.  A body over ``max_body`` gets a 413 the client can read, two ``Content-Length``
headers or a ``Transfer-Encoding`` a 400, at most ``max_connections`` are open at once (more
wait in the listen backlog) and at most ``max_per_client`` from one address (more get a 429).
No lock is held around the model or the indexes: the searcher is safe to call from many
threads, so workers embed and search at once.  A ``Host`` header other than the bound
address or localhost is refused (a web page cannot reach the server through a DNS name
rebound to 127.0.0.1), and so is a request from another web page than the server's own
unless ``cors`` lists its origin (:mod:`serve_origin`).
Each request writes one access-log line (client, method, path, status, milliseconds)
to stderr, or to the ``access_log`` callable given to :func:`make_server`.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from urllib.parse import parse_qs, urlsplit

from mmalign.errors import UsageError, UserError
from mmalign.search.searcher import MAX_QUERY_PIXELS, Overloaded, Searcher
from mmalign.search.serve_clip import ClipRetrievalRoutes
from mmalign.search.serve_fetch import parse_hosts
from mmalign.search.serve_images import query_image, thumbnail
from mmalign.search.serve_indexes import open_searchers, parse_indexes
from mmalign.search.serve_key import key_vector
from mmalign.search.serve_loop import PooledHTTPServer, PooledRequestHandler, printable
from mmalign.search.serve_origin import (
    Refused,
    check_host,
    check_origin,
    cors_headers,
    is_loopback,
    parse_cors,
    preflight_headers,
)
from mmalign.search.serve_page import PAGE


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)  # sys.stderr looked up per line: it may be replaced


class _Handler(ClipRetrievalRoutes, PooledRequestHandler):
    searchers: dict
    names: list
    encoder: Searcher  # the searcher that holds the model (embeds every index's queries)
    max_k: int
    max_text: int
    max_body: int
    max_pixels: int
    max_thumb: int
    cors: tuple
    allow_urls: frozenset
    fetch_timeout: float
    access_log: Callable[[str], None]

    def log_message(self, fmt, *args):  # http.server's own lines are replaced by one access line per request
        pass

    def handle_one_request(self):
        start = time.monotonic()
        self._status, self.command, self.path, self._undelivered = None, None, None, None
        self._cors: dict = {}
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
        for name, value in {**self._cors, **(headers or {})}.items():
            self.send_header(name, value)
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def _reply(self, status: int, payload, headers: dict | None = None) -> None:
        self._send(
            status,
            "application/json",
            json.dumps(payload).encode("utf-8"),
            {"X-Content-Type-Options": "nosniff", **(headers or {})},
        )

    def _params(self) -> tuple[str, dict]:
        parts = urlsplit(self.path)
        # a blank value is as good as absent (a form's empty field), but `key=` is a key query's mistake
        pairs = parse_qs(parts.query, keep_blank_values=True).items()
        return parts.path, {k: v[-1] for k, v in pairs if v[-1] or k == "key"}

    def _bound(self) -> str:
        address = self.server.server_address  # (host, port, ...) for the TCP servers we run
        return str(address[0] if isinstance(address, tuple) else address)

    def _allow_origin(self) -> str | None:
        """The Host check, then the Origin check; the CORS origin to answer with (None: none)."""
        check_host(self.headers.get("Host", ""), self._bound())
        return check_origin(
            self.headers.get("Origin"),
            self.headers.get("Host", ""),
            self.cors,
            referer=self.headers.get("Referer"),
            fetch_mode=self.headers.get("Sec-Fetch-Mode"),
        )

    def _index(self, params: dict) -> tuple[str, Searcher]:
        name = params.get("index") or self.names[0]
        if name not in self.searchers:
            raise Refused(404, f"no index named {printable(name, 100)!r} (have {', '.join(self.names)})")
        return name, self.searchers[name]

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
                self._cors = cors_headers(self._allow_origin())
                route()
            except Refused as e:
                self._reply(e.status, {"error": str(e)})
            except UserError as e:
                self._reply(400, {"error": str(e)})
            except Overloaded as e:  # the batcher's queue is full: back off, nothing was run
                self._reply(503, {"error": str(e)}, {"Retry-After": "1"})
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

    def do_OPTIONS(self):
        self._handle(self._preflight)

    def _preflight(self) -> None:
        """A CORS preflight: a page from a ``--cors`` origin asks before a non-simple request."""
        allow = self._allow_origin()
        if allow is None:
            raise Refused(403, "a preflight needs an Origin the server accepts (--cors)")
        self._send(204, "text/plain", b"", preflight_headers(allow))

    # ------------------------------------------------------------ our own routes

    def _text_hits(self, searcher, text: str, k: int, against: str, dedupe: bool):
        if searcher is self.encoder or getattr(searcher, "source", None) is not None:
            return searcher.text(text, k, against, dedupe=dedupe)
        return searcher.search_vectors(self.encoder.encode_text([text]), k, against, dedupe)[0]

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
        if path == "/indices-list":
            return self._reply(200, list(self.names))
        name, searcher = self._index(params)
        if path == "/health":
            return self._reply(
                200,
                {
                    "ok": True,
                    "dim": searcher.dim,
                    "indexes": sorted(searcher.indexes),
                    "index": name,
                    "indices": list(self.names),
                },
            )
        if path == "/thumb":
            return self._thumb(searcher, params)
        if path != "/search":
            return self._reply(404, {"error": f"no route {printable(path, 100)}"})
        if "key" in params:
            return self._by_key(searcher, params)
        text = params.get("text", "")
        if not text or len(text) > self.max_text:
            raise UsageError(f"text must be 1..{self.max_text} characters")
        k, against = self._k_against(params)
        hits = self._text_hits(searcher, text, k, against, self._dedupe(params))
        return self._reply(200, {"query": text, "hits": [asdict(h) for h in hits]})

    def _by_key(self, searcher, params: dict) -> None:
        """ "More like this": the indexed item's own image vector is the query (no model needed)."""
        key = params["key"]
        if not key or len(key) > self.max_text:
            raise UsageError(f"key must be 1..{self.max_text} characters")
        if "text" in params:
            raise UsageError("give text or key, not both")
        k, against = self._k_against(params)
        dedupe = self._dedupe(params)
        vector = key_vector(searcher, key)  # None: no such key (safe from many threads)
        if vector is None:
            raise Refused(404, f"no indexed image has key {printable(key, 100)!r}")
        hits = searcher.search_vectors(vector[None], k, against, dedupe)[0]
        return self._reply(200, {"key": key, "hits": [asdict(h) for h in hits]})

    def _thumb(self, searcher, params: dict) -> None:
        if not is_loopback(str(self.client_address[0])):
            raise Refused(403, "thumbnails are served to this machine only")
        try:
            row, size = int(params.get("row", "")), int(params.get("size", 128))
        except ValueError:
            raise UsageError("row and size must be integers") from None
        if not 16 <= size <= self.max_thumb:
            raise UsageError(f"size must be in [16, {self.max_thumb}]")
        jpeg = thumbnail(searcher, row, size, self.max_body, self.max_pixels)
        return self._send(200, "image/jpeg", jpeg, {"Cache-Control": "private, max-age=600"})

    def _body(self, what: str) -> bytes:
        raw = self.headers.get("Content-Length") or "0"
        try:
            length = int(raw)
        except ValueError:
            self.close_connection = True
            raise UsageError(f"Content-Length {raw[:40]!r} is not a number") from None
        if length == 0 and what == "the request body":
            raise UsageError("the request needs a JSON body")
        if not 0 < length <= self.max_body:
            self.close_connection = True
            raise Refused(413, f"{what} must be 1..{self.max_body} bytes")
        data = self.rfile.read(length)
        if len(data) < length:
            self.close_connection = True
            raise UsageError(f"body ended after {len(data)} of {length} bytes")
        return data

    def _post(self) -> None:
        path, params = self._params()
        if path == "/knn-service":
            return self._knn(self._body("the request body"))
        if path == "/metadata":
            return self._metadata(self._body("the request body"))
        if path != "/search":
            self.close_connection = True  # the unread body must not be parsed as a next request
            return self._reply(404, {"error": f"no route {printable(path, 100)}"})
        name, searcher = self._index(params)
        raw = self.headers.get("Content-Length") or "0"
        if raw.isdigit() and not 0 < int(raw) <= self.max_body:  # refused before k is looked at
            self.close_connection = True
            raise Refused(413, f"image body must be 1..{self.max_body} bytes")
        k, against = self._k_against(params)
        dedupe = self._dedupe(params)
        image = query_image(self._body("image body"), self.max_pixels, "body")
        if searcher is self.encoder or getattr(searcher, "source", None) is not None:
            hits = searcher.image(image, k, against, dedupe=dedupe)
        else:
            hits = searcher.search_vectors(self.encoder.encode_image([image]), k, against, dedupe)[0]
        return self._reply(200, {"hits": [asdict(h) for h in hits]})


def check_pool(timeout: float, workers: int, max_connections: int, max_per_client: int = 1) -> None:
    if workers < 1 or max_connections < 1 or not 0 < timeout < float("inf"):
        raise UsageError(
            f"serve: --workers ({workers}) and --max-connections ({max_connections}) must be >= 1 "
            f"and --timeout ({timeout}) a finite number > 0"
        )
    if max_per_client < 1:
        raise UsageError(f"serve: --max-per-client ({max_per_client}) must be >= 1")


def _named(searchers) -> dict:
    """A searcher or {name: searcher} -> {name: searcher}; a lone one is named after its directory."""
    if isinstance(searchers, Mapping):
        if not searchers:
            raise UsageError("serve: no index to serve")
        return dict(searchers)
    index_dir = getattr(searchers, "index_dir", None)
    name = parse_indexes([str(index_dir)])[0][0] if index_dir is not None else "default"
    return {name: searchers}


def make_server(
    searcher,
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
    cors: str | None = None,
    allow_url_queries: str | None = None,
) -> PooledHTTPServer:
    """An HTTP server (port 0 = any free port); call ``serve_forever()`` on it.
    ``searcher``: a :class:`Searcher`, or ``{name: Searcher}`` (the first is the default; the
    first holding a model embeds every index's queries).
    ``timeout``: the seconds a request has to arrive whole, to wait for a worker, and its reply
    to be written (and an ``image_url`` to be fetched); ``workers``: the threads that answer
    requests; ``max_connections``: open at once; ``max_per_client``: open at once from one
    client address.  ``cors``: the origins (comma-separated, or ``*``) whose pages may call the
    server; ``allow_url_queries``: the hosts ``image_url`` may fetch from (comma-separated).
    ``access_log`` receives one line per request (default: stderr)."""
    check_pool(timeout, workers, max_connections, max_per_client)
    searchers = _named(searcher)
    first = next(iter(searchers.values()))
    encoder = next((s for s in searchers.values() if getattr(s, "source", None) is not None), first)
    log_lock = threading.Lock()
    write = access_log or _stderr_line

    def log_line(line: str) -> None:
        with log_lock:  # whole lines from concurrent threads
            write(line)

    handler = type(
        "Handler",
        (_Handler,),
        {
            "searchers": searchers,
            "names": list(searchers),
            "encoder": encoder,
            "max_k": int(max_k),
            "max_text": int(max_text),
            "max_body": int(max_body),
            "max_pixels": int(max_pixels),
            "max_thumb": int(max_thumb),
            "cors": parse_cors(cors),
            "allow_urls": parse_hosts(allow_url_queries),
            "fetch_timeout": float(timeout),
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
    mmap: bool = False,
    cors: str | None = None,
    allow_url_queries: str | None = None,
) -> None:
    """``index_dir``: a directory, or ``--index`` values (``DIR`` or ``NAME=DIR``, repeated)."""
    check_pool(
        timeout, workers, max_connections, max_per_client
    )  # before the model loads: a bad flag fails at once
    parse_cors(cors), parse_hosts(allow_url_queries), parse_indexes(index_dir)
    searchers = open_searchers(index_dir, model_dir, Searcher, mmap=mmap)
    server = make_server(
        searchers,
        host,
        port,
        max_k=max_k,
        timeout=timeout,
        workers=workers,
        max_connections=max_connections,
        max_per_client=max_per_client,
        cors=cors,
        allow_url_queries=allow_url_queries,
    )
    base = f"http://{host}:{server.server_address[1]}"
    listed = ", ".join(f"{name}={getattr(s, 'index_dir', '?')}" for name, s in searchers.items())
    print(
        f"serving {listed}: search page {base}/ , JSON {base}/search?text=...&k=10 , "
        f"clip-retrieval back {base} (Ctrl-C stops)",
        flush=True,
    )
    try:
        server.serve_forever()
    finally:
        server.server_close()
