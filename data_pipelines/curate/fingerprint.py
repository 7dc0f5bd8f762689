"""What a shard's stored embeddings were computed from, so that a rerun re-embeds a shard that
changed at the same path instead of reusing its old scores.

Each shard's ``OUT/pool/NNNNN.json`` records :func:`fingerprint` of its input as it was read:

- a local file: its size, modification time (ns) and the sha256 of its bytes;
- an http(s) shard: what a HEAD request gives cheaply (``ETag``, ``Content-Length``,
  ``Last-Modified``), when the server sends any of them;
- an fsspec shard: what the file system's ``info`` gives (size, ETag, modification time);
- a ``pipe:`` command: nothing (its output cannot be looked at without running it), so its
  embeddings are reused as they are, and the run says so.

:func:`changed` compares a stored record with the shard now: the cheap fields first, the sha256
only when they agree (a rewrite that kept size and time, as ``cp -p`` or ``rsync -t`` do).
"""

from __future__ import annotations

import hashlib
import os

from mmalign.data.remote import kind_of, local_path

CHUNK = 1 << 20
WORDS = {"mtime_ns": "modification time", "mtime": "modification time", "size": "size"}
HEAD_TIMEOUT_S = 10.0


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _http(url: str) -> dict | None:
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=HEAD_TIMEOUT_S) as r:
            found = {k: r.headers.get(k) for k in ("ETag", "Content-Length", "Last-Modified")}
    except Exception:  # a server without HEAD, or not answering now: nothing to compare, not an error
        return None
    found = {k: v for k, v in found.items() if v}
    return found or None


def _fsspec(url: str) -> dict | None:
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        info = fs.info(path)
    except Exception:  # no backend, no credentials now: nothing to compare
        return None
    found = {
        k: str(info[k])
        for k in ("size", "ETag", "etag", "mtime", "LastModified", "last_modified", "md5Hash", "crc32c")
        if info.get(k) is not None
    }
    return found or None


def fingerprint(url: str, content: bool = True) -> dict | None:
    """The shard's identity now (module docstring); None when nothing cheap identifies it.
    ``content=False``: a local file's size and time only (no read)."""
    kind = kind_of(url)
    if kind == "local":
        path = local_path(url)
        st = os.stat(path)
        out: dict[str, int | str] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
        if content:
            out["sha256"] = sha256_file(path)
        return out
    if kind == "http":
        return _http(url)
    if kind == "fsspec":
        return _fsspec(url)
    return None


def changed(stored: dict | None, url: str) -> str | None:
    """Why the shard at ``url`` is not what ``stored`` (its recorded fingerprint) describes (a
    phrase: "its size changed since it was embedded"), or
    None when it is, or when nothing can tell (a ``pipe:``, a server that gives no header)."""
    if stored is None:
        return None if kind_of(url) == "pipe" else "no record of its input (embedded by an older mmalign)"
    try:
        now = fingerprint(url, content=False)
    except OSError as e:
        return f"it cannot be read now ({e.strerror or e})"
    if now is None:
        return None
    for key in sorted(set(stored) & set(now)):
        if stored[key] != now[key]:
            return f"its {WORDS.get(key, key)} changed since it was embedded"
    if "sha256" in stored and kind_of(url) == "local":
        try:
            if sha256_file(local_path(url)) != stored["sha256"]:
                return "its content changed since it was embedded (same size and time)"
        except OSError as e:
            return f"it cannot be read now ({e.strerror or e})"
    return None
