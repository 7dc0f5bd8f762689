"""Who may talk to ``mmalign serve``: the ``Host`` check, the ``Origin`` check and CORS.

* ``Host``: only the bound address or a local name.  A web page cannot reach the server
  through a DNS name it rebinds to 127.0.0.1, since its requests then carry that name.
* ``Origin``: a browser names the page a request comes from (``Origin``, or for a plain GET
  the ``Referer``).  A request from another page than the server's own is refused (403)
  unless ``--cors`` lists that page's origin: a page on the web cannot make a local server
  embed queries or fetch URLs for it, even where the browser would not let it read the
  answer.  A link followed to the search page (a navigation) is not refused.  Clients that
  are not browsers send neither header and are not concerned.
* CORS: for a listed origin, the replies carry ``Access-Control-Allow-Origin`` (that
  origin, or ``*``) and expose the server's own headers; a preflight (``OPTIONS``) is
  answered with the methods and headers allowed.
"""

from __future__ import annotations

import ipaddress
from urllib.parse import urlsplit

from mmalign.errors import UsageError

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
# the replies' own headers a page from another origin may read (clip-retrieval routes' notes)
EXPOSED = ("X-Mmalign-Clamped", "X-Mmalign-Ignored")


class Refused(Exception):
    """A request refused with an HTTP status and a one-line message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def host_name(header: str) -> str:
    """``Host`` header -> the name without port or IPv6 brackets, lower case."""
    host = header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
        return True
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)  # a dual-stack socket reports 127.0.0.1 as ::ffff:127.0.0.1
    return (mapped or ip).is_loopback


def check_host(header: str, bound: str) -> None:
    """Refuse (403) a ``Host`` that is neither ``bound`` nor a local name."""
    name, bound = host_name(header), bound.lower()
    wildcard = bound in ("0.0.0.0", "::")
    # A rebinding attack needs a DNS name: IP literals are only allowed for a wildcard bind.
    if not (name in LOCAL_NAMES or name == bound or (wildcard and is_ip(name))):
        raise Refused(403, f"Host {name!r} is not this server (use {bound} or localhost)")


def parse_cors(value: str | None) -> tuple[str, ...]:
    """``--cors`` -> the allowed origins (``scheme://host[:port]``, or ``*`` for any)."""
    if not value:
        return ()
    origins = tuple(o.strip().rstrip("/") for o in value.split(",") if o.strip())
    for origin in origins:
        if origin != "*" and (
            "://" not in origin
            or origin.split("://", 1)[0] not in ("http", "https")
            or "/" in origin.split("://", 1)[1]
        ):
            raise UsageError(
                f"--cors: {origin!r} is not an origin (scheme://host[:port], e.g. http://localhost:3000, or *)"
            )
    return origins


def _referer_origin(referer: str | None) -> str | None:
    """``scheme://host[:port]`` of a ``Referer`` (browsers send at least that much cross-origin)."""
    if not referer:
        return None
    parts = urlsplit(referer.strip())
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else None


def check_origin(
    origin: str | None,
    host: str,
    allowed: tuple[str, ...],
    referer: str | None = None,
    fetch_mode: str | None = None,
) -> str | None:
    """The ``Access-Control-Allow-Origin`` value for this request (None: same origin or no
    browser); a page from a foreign origin not in ``allowed`` is refused (403).

    The page is the ``Origin`` header, else (a plain GET such as an ``<img>``, which carries
    none) the ``Referer``'s origin; a top-level navigation (``Sec-Fetch-Mode: navigate``: a link
    to the search page) is let through, as it shows the user our page, not theirs."""
    page = origin.strip().rstrip("/") if origin is not None else None
    if page is None:
        if (fetch_mode or "").lower() == "navigate":
            return None
        page = _referer_origin(referer)
        if page is None:
            return None  # not a browser, or one that says nothing: the Host check is what holds
        if page in allowed or "*" in allowed or _own(page, host):
            return None  # an <img> or a link: no CORS headers needed
    if _own(page, host):
        return None  # the server's own page
    if "*" in allowed:
        return "*"
    if page in allowed:
        return page
    raise Refused(
        403,
        f"requests from the page {page[:100]!r} are not accepted (start the server with --cors {page[:100]})",
    )


def _own(page: str, host: str) -> bool:
    host = host.strip().lower()
    return page.lower() in (f"http://{host}", f"https://{host}")


def cors_headers(allow: str | None) -> dict:
    if allow is None:
        return {}
    headers = {"Access-Control-Allow-Origin": allow, "Access-Control-Expose-Headers": ", ".join(EXPOSED)}
    if allow != "*":
        headers["Vary"] = "Origin"  # the answer depends on the asking page
    return headers


def preflight_headers(allow: str) -> dict:
    return {
        **cors_headers(allow),
        "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
        "Access-Control-Allow-Headers": "Content-Type",
        "Access-Control-Max-Age": "600",
    }
