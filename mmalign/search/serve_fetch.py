"""``image_url`` queries: the server fetches an image for a client, from listed hosts only.

A URL given by a client and fetched by the server is a server-side request: left open, it
lets anyone who reaches the server read what the server reaches (a cloud's metadata
address, an intranet page).  So ``image_url`` is off unless ``--allow-url-queries HOSTS``
names the host names that may be fetched, and every hop is checked: the URL's own host,
and each redirect's (a listed host redirecting elsewhere is refused, at most
``MAX_REDIRECTS`` hops).  Only ``http``/``https``, no credentials in the URL, no proxy; the
whole fetch must finish within ``timeout`` seconds and the body be at most ``max_bytes``
(a larger ``Content-Length`` is refused before reading).  Every refusal is one line, 400.
"""

from __future__ import annotations

import re
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

from mmalign.errors import UsageError
from mmalign.search.serve_origin import Refused

MAX_REDIRECTS = 3
CHUNK = 1 << 16
HOST = re.compile(r"[a-z0-9_.-]+|\[[0-9a-f:.]+\]")  # a name or IPv4 address, or a bracketed IPv6 one


def parse_hosts(value: str | None) -> frozenset[str]:
    """``--allow-url-queries`` -> the lower-case host names (empty: ``image_url`` is off)."""
    if not value:
        return frozenset()
    hosts = [h.strip().lower().rstrip(".") for h in value.split(",") if h.strip()]
    for host in hosts:
        if not HOST.fullmatch(host):
            raise UsageError(
                f"--allow-url-queries: {host!r} is not a host name (give names like images.example.com,"
                " comma-separated, no scheme or port)"
            )
    return frozenset(h.strip("[]") for h in hosts)  # urlsplit's hostname drops IPv6 brackets


def _checked(url: str, allowed: frozenset[str]) -> str:
    """The URL if it may be fetched, else :class:`Refused` (400) saying why."""
    if not allowed:
        raise Refused(400, "image_url queries are off (start the server with --allow-url-queries HOSTS)")
    try:
        parts = urlsplit(url)
        host = (parts.hostname or "").lower().rstrip(".")
        parts.port  # noqa: B018  # a malformed port raises here
    except ValueError:
        raise Refused(400, f"image_url {url[:100]!r} is not a URL") from None
    if parts.scheme not in ("http", "https"):
        raise Refused(400, f"image_url must be http or https, not {parts.scheme[:20]!r}")
    if parts.username is not None or parts.password is not None:
        raise Refused(400, "image_url must not carry credentials")
    if host not in allowed:
        raise Refused(
            400,
            f"image_url host {host[:100]!r} is not allowed (allowed: {', '.join(sorted(allowed))})",
        )
    return url


class _Redirects(urllib.request.HTTPRedirectHandler):
    max_redirections = MAX_REDIRECTS

    def __init__(self, allowed: frozenset[str]):
        super().__init__()
        self.allowed = allowed

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        try:
            _checked(newurl, self.allowed)
        except Refused as e:
            raise Refused(400, f"image_url redirected: {e}") from None
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def fetch(url: str, allowed: frozenset[str], max_bytes: int, timeout: float) -> bytes:
    """The body at ``url`` (an allowed host, every redirect too), within ``timeout`` s and ``max_bytes``."""
    _checked(url, allowed)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}), _Redirects(allowed))
    deadline = time.monotonic() + timeout
    request = urllib.request.Request(url, headers={"User-Agent": "mmalign-serve", "Accept": "image/*"})
    try:
        with opener.open(request, timeout=timeout) as reply:
            length = reply.headers.get("Content-Length")
            if length is not None and length.isdigit() and int(length) > max_bytes:
                raise Refused(400, f"image_url: the image is {int(length)} bytes, at most {max_bytes}")
            data = bytearray()
            while chunk := reply.read(CHUNK):
                data += chunk
                if len(data) > max_bytes:
                    raise Refused(400, f"image_url: the image is over {max_bytes} bytes")
                if time.monotonic() > deadline:
                    raise Refused(400, f"image_url: the download took over {timeout:g} s")
    except urllib.error.HTTPError as e:
        raise Refused(400, f"image_url: the host answered HTTP {e.code}") from None
    except urllib.error.URLError as e:
        raise Refused(400, f"image_url: cannot fetch it ({str(e.reason)[:100]})") from None
    except (TimeoutError, OSError) as e:
        raise Refused(400, f"image_url: cannot fetch it ({type(e).__name__})") from None
    if not data:
        raise Refused(400, "image_url: the host sent an empty body")
    return bytes(data)
