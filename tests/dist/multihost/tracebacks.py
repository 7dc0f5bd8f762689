"""Which frames of a traceback are mmalign's own.

Told by the package's real location, the directory of ``mmalign.__file__`` resolved, and
never by a substring such as ``/mmalign/``: a checkout made by ``git clone`` is itself a
folder named ``mmalign``, and the venv inside it puts torch under ``.../mmalign/.venv/...``.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path, PurePath

import mmalign

PACKAGE_DIR = Path(mmalign.__file__).resolve().parent

_FILE_LINE = re.compile(r'^\s*File "([^"]+)", line \d+')


@functools.lru_cache(maxsize=4096)
def package_path(filename: str) -> PurePath | None:
    """``filename``'s path inside the package (``engine.py``, ``models/vit.py``), or None for a
    file outside it (torch, the standard library, ``<frozen runpy>``, a test)."""
    try:
        return Path(filename).resolve().relative_to(PACKAGE_DIR)
    except (ValueError, OSError, RuntimeError):
        return None


def own_frames(log: str) -> list[str]:
    """The ``File "...", line N`` lines of ``log`` that point into the package."""
    return [
        line
        for line in log.splitlines()
        if (m := _FILE_LINE.match(line)) is not None and package_path(m.group(1)) is not None
    ]
