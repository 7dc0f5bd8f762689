"""``mmalign serve --index``: several indexes in one server, each under a name.

``--index NAME=DIR`` (repeated) serves ``DIR`` as ``NAME``; a plain ``--index DIR`` is named
after the directory (``runs/x/laion`` -> ``laion``).  The first is the default: our routes
take ``&index=NAME`` and clip-retrieval's ``indice_name``; ``/indices-list`` lists the names in
order.  Light (no torch): the command line checks its flags before the model loads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from mmalign.errors import UsageError

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


def parse_indexes(values: list[str] | str) -> list[tuple[str, str]]:
    """``--index`` values -> [(name, dir)] in order; a name given twice is one line, exit 2."""
    if isinstance(values, str):
        values = [values]
    out: list[tuple[str, str]] = []
    for value in values:
        name, sep, path = value.partition("=")
        if sep and NAME.fullmatch(name) and not os.path.isdir(value):
            if not path:
                raise UsageError(f"--index {value}: give NAME=DIR (the directory is missing)")
        else:
            path = value
            name = Path(os.path.abspath(value)).name or "default"
            if not NAME.fullmatch(name):
                raise UsageError(
                    f"--index {value}: the directory's name {name!r} cannot name an index; "
                    "give NAME=DIR (letters, digits, _ . -)"
                )
        if any(name == seen for seen, _ in out):
            raise UsageError(f"--index: two indexes are named {name!r}; name them with NAME=DIR")
        out.append((name, path))
    if not out:
        raise UsageError("--index: give at least one index directory")
    return out


def open_searchers(indexes, model_dir, factory, *, mmap: bool = False) -> dict:
    """``--index`` values -> {name: ``factory(dir, model)``} (a Searcher); the first loads the
    model, the others share it."""
    import inspect

    if mmap and "mmap" not in inspect.signature(factory).parameters:
        raise UsageError("--mmap: this version's Searcher cannot memory-map indexes yet")
    searchers: dict = {}
    for i, (name, index_dir) in enumerate(parse_indexes(indexes)):
        model = model_dir if i == 0 else None
        searchers[name] = factory(index_dir, model, mmap=True) if mmap else factory(index_dir, model)
    first = next(iter(searchers.values()))
    for name, s in searchers.items():
        if s.dim != first.dim:
            raise UsageError(
                f"--index {name}: its vectors have dim {s.dim}, the first index's {first.dim}; "
                "every index served together must come from the one --model"
            )
    return searchers
