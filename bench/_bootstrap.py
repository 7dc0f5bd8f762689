"""Puts the repository root on ``sys.path``: the one place in bench/ that changes it.

``python bench/x.py`` puts bench/, not the repository root, on ``sys.path``, so ``bench``,
``tests`` (the naive references) and a checkout's ``mmalign`` would not import.  Every script
starts with ``import _bootstrap`` (found beside it, in bench/), then imports ``bench.harness``.
Modules that are only imported (bench/gpu_step.py, bench/cifar10_runs.py, ...) do not need it.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def put_first(path: Path | str) -> None:
    """Make ``path`` the first entry of ``sys.path`` (bench/step.py --tree imports another checkout)."""
    entry = str(Path(path).resolve())
    if entry in sys.path:
        sys.path.remove(entry)
    sys.path.insert(0, entry)


if str(ROOT) not in sys.path:
    put_first(ROOT)
