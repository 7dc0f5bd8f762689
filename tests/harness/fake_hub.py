"""A Hugging Face hub on 127.0.0.1 for the tests of downloads by name: the file endpoint
huggingface_hub's ``hf_hub_download`` uses (``HEAD``/``GET /ORG/NAME/resolve/REV/FILE``, with the
``X-Repo-Commit`` / ``ETag`` headers it reads and the ``X-Error-Code`` of a missing repository or
file). ``server.repos[repo_id]`` is a folder of files; ``server.requests`` lists
``(method, path)`` in arrival order. Point a process at it with ``HF_ENDPOINT=server.url``."""

from __future__ import annotations

import contextlib
import hashlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

__all__ = ["serve"]


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.do_GET(head=True)

    def do_GET(self, head=False):
        srv = self.server
        with srv.lock:
            srv.requests.append(("HEAD" if head else "GET", self.path))
        parts = self.path.split("?")[0].lstrip("/").split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            return self._error(404, "EntryNotFound")
        repo, filename = "/".join(parts[:2]), "/".join(parts[4:])
        folder = srv.repos.get(repo)
        if folder is None:
            return self._error(404, "RepoNotFound")
        file = Path(folder) / filename
        if not file.is_file():
            return self._error(404, "EntryNotFound")
        body = file.read_bytes()
        self.send_response(200)
        self.send_header("X-Repo-Commit", hashlib.sha1(repo.encode()).hexdigest())
        self.send_header("ETag", '"' + hashlib.sha256(body).hexdigest() + '"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def _error(self, code: int, kind: str):
        self.send_response(code)
        self.send_header("X-Error-Code", kind)
        self.send_header("X-Error-Message", kind)
        self.send_header("Content-Length", "0")
        self.end_headers()


@contextlib.contextmanager
def serve(repos: dict[str, Path] | None = None):
    """A running fake hub; ``.url``, ``.repos``, ``.requests``."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.repos = dict(repos or {})
    server.requests = []
    server.lock = threading.Lock()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
