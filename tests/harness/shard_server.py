"""A shard server on 127.0.0.1 for the tests of remote reading (training's loader, curate).

GET/HEAD of the files under ``server.root``, with Range ``bytes=A-[B]`` unless ``ranges`` is
off (then the whole file, as a server without range support answers). Faults, set by a test:

- ``server.fail[name] = k``: 503 to the next k requests for ``name`` (-1: always);
- ``server.cut[name] = k``: the next k responses for ``name`` end half-way through the body;
- ``server.cut_at[name] = b``: every response for ``name`` ends at byte ``b`` of the file (a
  proxy that always drops the connection there), its Content-Length announcing the whole body,
  or none at all when ``name`` is in ``server.no_length`` (a close-delimited body);
- ``server.endless``: names streamed for ever (valid tar members, no length) until the client leaves;
- ``server.held``: while ``server.gate`` is clear, a name in it answers its first request
  (a start-up probe) and holds every later one until the gate is set, so a client can be
  killed between two shards.

``server.requests`` lists ``(name, Range header)`` in arrival order.
"""

from __future__ import annotations

import contextlib
import re
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
        srv, name = self.server, self.path.lstrip("/")
        with srv.lock:
            srv.requests.append((name, self.headers.get("Range")))
            later = sum(n == name for n, _ in srv.requests) > 1
            failing, cutting = srv.fail.get(name, 0), srv.cut.get(name, 0)
            if failing > 0:
                srv.fail[name] = failing - 1
            if cutting > 0:
                srv.cut[name] = cutting - 1
        if later and name in srv.held:
            srv.gate.wait(timeout=120)
        if failing:
            self.send_error(503)
            return
        if name in srv.endless:
            return self._endless(head)
        path = srv.root / name
        if not path.is_file():
            self.send_error(404)
            return
        data = path.read_bytes()
        match = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "") if srv.ranges else None
        with contextlib.suppress(OSError):  # a client that stops early, or was killed while it waited
            if match:
                start = int(match[1])
                end = min(int(match[2]) if match[2] else len(data) - 1, len(data) - 1)
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = data[start : end + 1]
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            else:
                body = data
                self.send_response(200)
            if name not in srv.no_length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if name in srv.cut_at:
                first = start if match else 0
                body = body[: max(0, srv.cut_at[name] - first)]
            if not head:
                self.wfile.write(body[: len(body) // 2] if cutting else body)

    def _endless(self, head: bool) -> None:
        import tarfile

        with contextlib.suppress(OSError):  # ends when the client closes
            self.send_response(200)
            self.end_headers()
            i = 0
            while not head and i < 10_000_000:  # bounded all the same: ~10 GB
                for ext in ("txt", "cls"):  # one sample: two members, never an end-of-archive block
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = 4
                    self.wfile.write(info.tobuf(tarfile.USTAR_FORMAT) + b"abcd".ljust(512, b"\0"))
                i += 1


@contextlib.contextmanager
def serve(root: Path, ranges: bool = True):
    """The files under ``root`` at ``server.url``; the gate starts set (nothing held)."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    server.handle_error = lambda request, address: None  # a client closing early is no test failure
    server.root, server.ranges, server.lock = Path(root), ranges, threading.Lock()
    server.requests, server.fail, server.cut, server.held = [], {}, {}, set()
    server.cut_at, server.no_length, server.endless = {}, set(), set()
    server.gate = threading.Event()
    server.gate.set()
    server.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.gate.set()
        server.shutdown()
        server.server_close()
