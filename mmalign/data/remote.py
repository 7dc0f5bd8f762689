"""Remote shard specs: ``pipe:CMD``, ``http(s)://`` URLs and fsspec URLs (``s3://``, ``gs://``, ...).

A remote shard is read through :class:`RemoteFile`, a read-only file whose ``seek`` is
lazy, so the tar reader (:mod:`mmalign.data.tario`) works on it unchanged:

* **http(s)**: a seek that is not served from the last bytes read re-requests the shard
  with ``Range: bytes=OFFSET-``.  A server that answers 206 is read from the offset; one
  that answers 200 (no range support) is read from its start and the bytes before the
  offset are discarded.  Exact resume therefore works on both; which one is logged once
  per process and kind.
* **pipe:CMD**: the command's stdout is the tar (as in webdataset); a seek backwards
  re-runs the command and discards up to the offset.
* **fsspec**: the backend's own seekable file (ranged reads); a missing backend is a
  one-line ``ConfigError`` naming the package to install.

Transient failures (connection errors, timeouts, HTTP 5xx/408/429, a cut response, a
command that exits non-zero) are retried with exponential backoff, resuming at the byte
where reading stopped; after ``retries`` failures without progress the read raises
``OSError`` and the stream counts the shard as ``unreadable_shard``, as for local files.
A stream that ends cleanly but before the tar's end-of-archive blocks (a body without a
length, or a pipe, cut short) is a ``truncated_tar`` skip (:class:`RemoteFile`).
Every wait on the network or on a command has a timeout.
"""

from __future__ import annotations

import http.client
import logging
import os
import select
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("mmalign.data")

CHUNK = 1 << 20  # largest single read from a remote stream
WINDOW = (
    64 << 10
)  # the last bytes read are kept: a short seek back (the tar reader's lookahead) costs nothing
SKIP = 4 << 20  # forward gaps up to this are read and dropped rather than re-requested
MAX_BACKOFF = 60.0  # seconds; the backoff doubles up to this

# Packages that provide fsspec's backends for the common schemes (named in the error when missing).
BACKENDS = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
}


@dataclass(frozen=True)
class RemoteOptions:
    """How remote shards are waited for (``data.remote_retries``, ``_backoff``, ``_timeout``)."""

    retries: int = 5  # failures in a row (without a byte of progress) before a shard is given up
    backoff: float = 1.0  # seconds before the first retry; doubles for each further one
    timeout: float = 60.0  # seconds any single network or command wait may take


class PermanentError(OSError):
    """A failure that retrying cannot fix (HTTP 404, a missing object): not retried."""


def kind_of(url: str) -> str:
    """``local`` | ``pipe`` | ``http`` | ``fsspec``."""
    if url.startswith("pipe:"):
        return "pipe"
    if "://" not in url:
        return "local"
    scheme = url.split("://", 1)[0].lower()
    if scheme in ("http", "https"):
        return "http"
    return "local" if scheme == "file" else "fsspec"


def local_path(url: str) -> str:
    return url[len("file://") :] if url.startswith("file://") else url


def is_gzip_name(url: str) -> bool:
    """A ``.tar.gz``/``.tgz`` shard by its name (query strings ignored; a pipe's output is sniffed instead)."""
    if url.startswith("pipe:"):
        return False
    return url.split("?", 1)[0].endswith((".gz", ".tgz"))


def check_backend(url: str, what: str) -> None:
    """A one-line ConfigError when ``url``'s fsspec backend (or fsspec itself) is not installed."""
    from mmalign.config import ConfigError

    scheme = url.split("://", 1)[0].lower()
    try:
        import fsspec
        from fsspec.registry import known_implementations
    except ImportError:
        package = BACKENDS.get(scheme)
        need = (
            f"fsspec and {package} (pip install fsspec {package})"
            if package
            else "fsspec (pip install fsspec)"
        )
        raise ConfigError(f"config key '{what}': {scheme}:// shards need {need}") from None
    try:
        fsspec.get_filesystem_class(scheme)
    except ImportError:
        known = known_implementations.get(scheme, {})
        package = BACKENDS.get(scheme) or known.get("class", scheme).split(".")[0]
        raise ConfigError(
            f"config key '{what}': {scheme}:// shards need the package {package} (pip install {package})"
        ) from None
    except ValueError:
        raise ConfigError(
            f"config key '{what}': unknown protocol {scheme}:// in {url} "
            "(local paths, pipe:CMD, http(s):// or an fsspec protocol)"
        ) from None


_said: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _said:
        _said.add(key)
        log.info("%s", message)


# ---------------------------------------------------------------- the byte sources


class _HttpStream:
    """One HTTP response body; a body cut short (fewer bytes than Content-Length) raises."""

    def __init__(self, response):
        self.response = response

    def read(self, n: int) -> bytes:
        data = self.response.read(n)
        if not data and n and self.response.length:  # http.client returns b"" on a dropped connection
            raise http.client.IncompleteRead(b"", self.response.length)
        return data

    def close(self) -> None:
        self.response.close()


def _open_http(url: str, start: int, timeout: float):
    """(stream, position it starts at): ``start`` when the server honours the range, else 0."""
    request = urllib.request.Request(url, headers={"Range": f"bytes={start}-"} if start else {})
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as e:
        e.close()
        if e.code == 416:  # the range starts at or past the end: nothing left to read
            return _Empty(), start
        if 400 <= e.code < 500 and e.code not in (408, 425, 429):
            raise PermanentError(f"HTTP {e.code} {e.reason}") from None
        raise
    if start and response.status == 206:
        first = response.headers.get("Content-Range", "").removeprefix("bytes ").split("-", 1)[0]
        if first != str(start):
            response.close()
            raise OSError(f"the server answered range {start}- with Content-Range {first!r}")
        _say_once("http-range", "http(s) shards: seeking (and exact resume) by HTTP range requests")
        return _HttpStream(response), start
    if start:
        _say_once(
            "http-reread",
            "http(s) shards: the server ignores HTTP ranges, so a seek (and exact resume) "
            "re-reads the shard from its start up to the offset",
        )
    return _HttpStream(response), 0


class _Empty:
    def read(self, n: int) -> bytes:
        return b""

    def close(self) -> None:
        pass


class _Pipe:
    """A shell command's stdout, read with a timeout on every wait."""

    def __init__(self, command: str, timeout: float):
        self.command, self.timeout = command, timeout
        # its own process group, so that closing early ends the whole pipeline, not only the shell
        self.proc = subprocess.Popen(
            command, shell=True, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, start_new_session=True
        )
        assert self.proc.stdout is not None  # stdout=PIPE
        self.stdout = self.proc.stdout

    def read(self, n: int) -> bytes:
        fd = self.stdout.fileno()
        ready, _, _ = select.select([fd], [], [], self.timeout)
        if not ready:
            raise TimeoutError(f"no output from the command for {self.timeout:g} s")
        data = os.read(fd, n)
        if not data:
            try:
                code = self.proc.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                raise TimeoutError(
                    f"the command did not exit {self.timeout:g} s after its output ended"
                ) from None
            if code != 0:
                raise OSError(f"the command exited with status {code}")
        return data

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.stdout.close()
        self.proc.wait()


def _open_pipe(command: str, start: int, timeout: float):
    return _Pipe(command, timeout), 0


def note_resume(url: str) -> None:
    """Log, once per process and kind, how a shard of ``url``'s kind is resumed at an offset
    (http(s) is logged by the first range request, when the server's answer says which)."""
    kind = kind_of(url)
    if kind == "pipe":
        _say_once(
            "pipe-reread",
            "pipe: shards: exact resume re-runs the command and discards its output up to the saved offset",
        )
    elif kind == "fsspec":
        _say_once("fsspec-seek", "fsspec shards: exact resume seeks by the backend's ranged reads")


def _open_fsspec(url: str, start: int, timeout: float):
    try:  # the start-up check names a missing backend; a reader that skipped it gets a shard error
        import fsspec

        f = fsspec.open(url, "rb").open()
    except ImportError as e:
        raise PermanentError(f"{url.split('://', 1)[0]}:// needs a package: {e}") from None
    except FileNotFoundError as e:
        raise PermanentError(f"not found: {e}") from None
    if start:
        f.seek(start)
    return f, start


# ---------------------------------------------------------------- the file


class RemoteFile:
    """A read-only shard file over a stream that can be (re)opened at an offset.

    ``pos`` is the logical position; ``seek`` only moves it.  A read is served from the
    window of the last bytes read when it can be, else from the open stream (after
    reading and dropping a short forward gap), else from a stream reopened at ``pos``.

    ``needs_end_marker``: the tar reader (:func:`mmalign.data.tario.iter_members`) refuses to take
    the end of a remote stream for the end of the shard unless the tar's end-of-archive blocks
    came first: a body without a length (or a pipe) cut between two members would otherwise
    lose the rest of the shard silently.  The cut is a ``truncated_tar`` skip naming the shard.
    """

    needs_end_marker = True

    def __init__(self, url: str, options: RemoteOptions | None = None):
        self.url, self.kind = url, kind_of(url)
        self.options = options or RemoteOptions()
        self.pos = 0
        self._stream: Any = None  # _HttpStream, _Pipe, _Empty or an fsspec file (which also seeks)
        self._at = 0  # the open stream's position
        self._win, self._lo = bytearray(), 0  # the last bytes read: [lo, lo + len(win))
        self._ranged = self.kind != "pipe"  # False once an http server ignored a range
        self._native_seek = self.kind == "fsspec"
        self.closed = False

    # -- file protocol the tar reader and gzip use

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        if whence == 1:
            offset += self.pos
        elif whence != 0:
            raise OSError("remote shards cannot seek from their end")
        if offset < 0:
            raise ValueError("negative seek position")
        self.pos = offset
        return self.pos

    def read(self, n: int = -1) -> bytes:
        out = bytearray()
        failures = 0
        while n < 0 or len(out) < n:
            want = CHUNK if n < 0 else min(n - len(out), CHUNK)
            if self._lo <= self.pos < self._lo + len(self._win):  # served from the window
                i = self.pos - self._lo
                piece = self._win[i : i + want]
                out += piece
                self.pos += len(piece)
                continue
            try:
                self._position()
                chunk = self._fetch(want) if self._at == self.pos else b""
            except PermanentError:
                self._drop()
                raise
            except (OSError, http.client.HTTPException) as e:  # transient: retry from self.pos
                failures = self._retry(e, failures)
                continue
            if not chunk:
                break  # the end of the shard
            failures = 0
            out += chunk
            self.pos += len(chunk)
        return bytes(out)

    def close(self) -> None:
        self._drop()
        self._win = bytearray()
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals

    def _open(self, start: int):
        t = self.options.timeout
        if self.kind == "http":
            return _open_http(self.url, start, t)
        if self.kind == "pipe":
            return _open_pipe(self.url[len("pipe:") :], start, t)
        return _open_fsspec(self.url, start, t)

    def _fetch(self, n: int) -> bytes:
        chunk = self._stream.read(n)
        self._at += len(chunk)
        self._win += chunk
        if len(self._win) > 2 * WINDOW:  # trimmed now and then, not at every small read
            del self._win[: len(self._win) - WINDOW]
        self._lo = self._at - len(self._win)
        return chunk

    def _position(self) -> None:
        """Bring an open stream to ``pos`` (or to its end, if ``pos`` is past it)."""
        if self._stream is not None and self._at == self.pos:
            return
        if self._stream is not None and self._native_seek:
            self._stream.seek(self.pos)
            self._at = self.pos
            self._win, self._lo = bytearray(), self._at
            return
        gap = self.pos - self._at
        if self._stream is None or gap < 0 or (gap > SKIP and self._ranged):
            self._drop()
            self._stream, self._at = self._open(self.pos)
            self._win, self._lo = bytearray(), self._at  # the window holds bytes of one stream, in order
            if self._at < self.pos:
                self._ranged = False
        while self._at < self.pos:
            if not self._fetch(min(CHUNK, self.pos - self._at)):
                return

    def _drop(self) -> None:
        if self._stream is not None:
            stream, self._stream = self._stream, None
            try:
                stream.close()
            except OSError:
                pass

    def _retry(self, error: Exception, failures: int) -> int:
        self._drop()
        if failures >= self.options.retries:
            raise OSError(f"{type(error).__name__}: {error} (given up after {failures} retries)") from error
        delay = min(self.options.backoff * 2**failures, MAX_BACKOFF)
        log.warning(
            "retrying %s at byte %d in %.3g s after %s: %s",
            self.url,
            self.pos,
            delay,
            type(error).__name__,
            error,
        )
        time.sleep(delay)
        return failures + 1


def probe(url: str, options: RemoteOptions | None = None) -> str | None:
    """None when the shard's first bytes can be read, else why not (start-up check)."""
    try:
        with RemoteFile(url, options) as f:
            f.read(1)
    except (OSError, http.client.HTTPException) as e:
        return f"{type(e).__name__}: {e}"
    return None
