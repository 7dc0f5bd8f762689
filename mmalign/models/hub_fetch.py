"""Models by name, the network side of :mod:`mmalign.models.hub`: a parsed name, the one-line
errors of a name that is not there, and the downloads into huggingface_hub's cache (bounded: one
connection probe first, since huggingface_hub alone retries a dead network for ~25 s)."""

from __future__ import annotations

import difflib
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from mmalign.errors import ConfigError, UsageError
from mmalign.models.pretrained_list import cached_file, hub_cache, registry

log = logging.getLogger(__name__)

TAG, OPEN_CLIP_HUB, TRANSFORMERS = "ARCH/TAG", "hf-hub", "transformers"  # Name.form
TEXT_TOWER = "text tower"  # Name.form of a Hugging Face text model an open_clip architecture names
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class Name:
    """A parsed model name."""

    text: str  # as written
    form: str  # TAG, OPEN_CLIP_HUB or TRANSFORMERS
    repo: str  # ORG/NAME on the hub
    arch: str | None = None  # TAG: open_clip's architecture
    tag: str | None = None  # TAG: the tag, open_clip's spelling


def offline() -> bool:
    """Downloads are off (``HF_HUB_OFFLINE`` or ``TRANSFORMERS_OFFLINE``), read now."""
    return any(
        os.environ.get(v, "").strip().upper() in _TRUE for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


# ---------------------------------------------------------------- errors


def fail(key: str, message: str) -> Exception:
    """The one-line error of ``key``: a UsageError for a flag, a ConfigError for a config key."""
    if key.startswith("-"):
        return UsageError(f"{key}: {message}")
    return ConfigError(f"config key '{key}': {message}")


def _path_too(name: Name) -> str:
    """An ``ORG/NAME`` may have been meant as a relative path: say that there is none."""
    return "no such local path, and " if name.form == TRANSFORMERS else ""


def _fetch_hint(name: Name) -> str:
    """The command that fetches ``name`` on a connected machine."""
    if name.form == TEXT_TOWER:  # not a model mmalign loads by itself: huggingface_hub's own command
        return f"`hf download {name.repo}`"
    return f"`mmalign models --fetch {name.text}` (or `hf download {name.repo}`)"


def not_cached(name: Name, key: str, what: str, why: str = "downloads are off (HF_HUB_OFFLINE)") -> Exception:
    return fail(
        key,
        f"{name.text}: {_path_too(name)}not in the Hugging Face cache {hub_cache()} ({what}); {why}; on a "
        f"connected machine with the same HF_HOME run {_fetch_hint(name)}",
    )


def check_reachable(name: Name, key: str, what: str) -> None:
    """One bounded connection to the hub before a download: huggingface_hub retries a dead
    network for ~25 s; this says it in one line at once (a dead route: after TIMEOUT_S)."""
    import socket
    from urllib.parse import urlsplit

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlsplit(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    if (url.hostname, port) in _REACHED:
        return
    try:
        socket.create_connection((url.hostname or "", port), timeout=TIMEOUT_S).close()
    except OSError as e:
        raise not_cached(
            name, key, what, f"the hub ({endpoint}) cannot be reached ({e.strerror or e})"
        ) from None
    _REACHED.add((url.hostname, port))
    print(f"mmalign: downloading {name.text} into {hub_cache()} ...", file=sys.stderr, flush=True)


TIMEOUT_S = 5.0  # the reachability probe's connect timeout
_REACHED: set = set()  # (host, port) reached once by this process


def _fetch_failed(name: Name, key: str, e: Exception) -> Exception:
    """A download that did not happen, as one line by its cause."""
    from huggingface_hub import errors as hf_errors

    cause = (str(e).strip().splitlines() or [""])[0][:200]
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if isinstance(e, hf_errors.GatedRepoError):
        why = f"{name.repo} is gated: accept its terms on the hub and log in (`hf auth login`)"
    elif isinstance(e, hf_errors.RepositoryNotFoundError):
        why = f"the hub has no repository {name.repo} (or it is private: `hf auth login`){arch_hint(name)}"
    elif isinstance(e, hf_errors.RemoteEntryNotFoundError):
        why = f"{name.repo} has no such file ({cause})"
    elif isinstance(e, hf_errors.HfHubHTTPError):
        why = f"the hub ({endpoint}) answered {type(e).__name__}: {cause}"
    elif isinstance(e, OSError):  # a connection lost midway, a timeout, offline mode set at its import
        why = (
            f"the hub ({endpoint}) could not be reached ({type(e).__name__}: {cause[:80]}); set "
            f"HF_HUB_OFFLINE=1 to use the cache {hub_cache()} alone, or fetch it on a connected machine "
            f"with {_fetch_hint(name)}"
        )
    else:
        why = f"{type(e).__name__}: {cause}"
    return fail(key, f"{name.text} could not be downloaded: {why}")


def arch_hint(name: Name) -> str:
    """For an ``ORG/NAME`` that may be a mistyped open_clip ``ARCH/TAG``: the close architectures."""
    org = name.repo.split("/")[0]
    by_lower = {a.lower(): a for a in registry()}  # open_clip's names are case-sensitive; a hint need not be
    close = [by_lower[c] for c in difflib.get_close_matches(org.lower(), list(by_lower), n=3, cutoff=0.75)]
    return f"; no open_clip architecture is named {org} (close: {', '.join(close)})" if close else ""


# ---------------------------------------------------------------- downloads


def _hub_download(repo: str, filename: str) -> Path:
    from huggingface_hub import hf_hub_download

    log.info("downloading %s of %s into %s", filename, repo, hub_cache())
    endpoint = (
        os.environ.get("HF_ENDPOINT") or None
    )  # now, as the cache: huggingface_hub read it at its import
    return Path(hf_hub_download(repo, filename, cache_dir=str(hub_cache()), endpoint=endpoint))


def download(name: Name, key: str, repo: str, filename: str) -> Path:
    try:
        return _hub_download(repo, filename)
    except Exception as e:
        raise _fetch_failed(name, key, e) from None


def first_file(name: Name, key: str, repo: str, names: list[str] | tuple[str, ...]) -> Path | None:
    """The first of ``names`` that the cache holds, else (online) the first the hub has, as
    open_clip tries them; None when offline and none is cached, or the hub has none of them."""
    from huggingface_hub import errors as hf_errors

    cache = hub_cache()
    for n in names:
        found = cached_file(cache, repo, n)
        if found is not None:
            return found
    if offline():
        return None
    check_reachable(name, key, f"{repo}, file {' or '.join(names)}")
    for n in names:
        try:
            return _hub_download(repo, n)
        except hf_errors.RemoteEntryNotFoundError:
            continue  # open_clip's order: the next name
        except Exception as e:
            raise _fetch_failed(name, key, e) from None
    return None


def maybe_download(name: Name, key: str, repo: str, filename: str) -> None:
    """``filename`` of ``repo`` into the cache when the repository has it."""
    from huggingface_hub import errors as hf_errors

    try:
        _hub_download(repo, filename)
    except hf_errors.RemoteEntryNotFoundError:
        pass
    except Exception as e:
        raise _fetch_failed(name, key, e) from None
