"""``mmalign serve``: a small HTTP front end to :class:`mmalign.search.Searcher` (stdlib only).

    GET  /search?text=a+red+circle&k=10[&against=image|text]   -> JSON hits
    POST /search?k=10[&against=...]   body = image bytes        -> JSON hits
    GET  /health                                                 -> {"ok": true, "dim": D, ...}

Bound to 127.0.0.1 unless told otherwise: there is no authentication.  Requests are
bounded: the query text (``max_text`` characters), ``k`` (``max_k``) and the image
body (``max_body`` bytes, refused from its Content-Length before anything is read).
One request at a time (``HTTPServer``, not threaded): the model is not shared
across threads.
"""

from __future__ import annotations

import io
import json
from dataclasses import asdict
from http.server import BaseHTTPRequestHandler, HTTPServer
from urllib.parse import parse_qs, urlsplit

from mmalign.config import ConfigError
from mmalign.search import Searcher


class _Handler(BaseHTTPRequestHandler):
    searcher: Searcher
    max_k: int
    max_text: int
    max_body: int

    def log_message(self, fmt, *args):  # quiet by default; the CLI prints the address
        pass

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _params(self) -> tuple[str, dict]:
        parts = urlsplit(self.path)
        return parts.path, {k: v[-1] for k, v in parse_qs(parts.query).items()}

    def _k_against(self, params: dict) -> tuple[int, str]:
        try:
            k = int(params.get("k", 10))
        except ValueError:
            raise ConfigError("k must be an integer") from None
        if not 1 <= k <= self.max_k:
            raise ConfigError(f"k must be in [1, {self.max_k}]")
        return k, params.get("against", "image")

    def do_GET(self):
        path, params = self._params()
        try:
            if path == "/health":
                return self._reply(200, {"ok": True, "dim": self.searcher.dim,
                                         "indexes": sorted(self.searcher.indexes)})
            if path != "/search":
                return self._reply(404, {"error": f"no route {path}"})
            text = params.get("text", "")
            if not text or len(text) > self.max_text:
                raise ConfigError(f"text must be 1..{self.max_text} characters")
            k, against = self._k_against(params)
            hits = self.searcher.text(text, k, against)
            return self._reply(200, {"query": text, "hits": [asdict(h) for h in hits]})
        except ConfigError as e:
            return self._reply(400, {"error": str(e)})

    def do_POST(self):
        from PIL import Image

        path, params = self._params()
        try:
            if path != "/search":
                return self._reply(404, {"error": f"no route {path}"})
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= self.max_body:
                self.close_connection = True  # the unread body must not be parsed as a next request
                return self._reply(413, {"error": f"image body must be 1..{self.max_body} bytes"})
            k, against = self._k_against(params)
            data = self.rfile.read(length)
            try:
                image = Image.open(io.BytesIO(data))
                image.load()
            except Exception as e:  # PIL raises many types for broken files
                raise ConfigError(f"body is not a readable image ({type(e).__name__})") from None
            hits = self.searcher.image(image, k, against)
            return self._reply(200, {"hits": [asdict(h) for h in hits]})
        except ConfigError as e:
            return self._reply(400, {"error": str(e)})


def make_server(searcher: Searcher, host: str = "127.0.0.1", port: int = 8765, *, max_k: int = 100,
                max_text: int = 1000, max_body: int = 8 << 20) -> HTTPServer:
    """An ``HTTPServer`` (port 0 = any free port); call ``serve_forever()`` on it."""
    handler = type("Handler", (_Handler,), {"searcher": searcher, "max_k": int(max_k), "max_text": int(max_text),
                                            "max_body": int(max_body)})
    return HTTPServer((host, int(port)), handler)


def serve(index_dir, model_dir, host: str = "127.0.0.1", port: int = 8765, max_k: int = 100) -> None:
    server = make_server(Searcher(index_dir, model_dir), host, port, max_k=max_k)
    print(f"serving {index_dir} on http://{host}:{server.server_address[1]}/search?text=...&k=10 (Ctrl-C stops)")
    try:
        server.serve_forever()
    finally:
        server.server_close()
