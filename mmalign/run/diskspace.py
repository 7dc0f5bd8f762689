"""Checkpoint writes on a filesystem that fills up.

Two things go wrong on a full disk without this module:

* torch's writer reports ``ENOSPC`` as ``RuntimeError: [enforce fail at inline_container.cc]
  . unexpected pos 576 vs 534``: the disk is never named, and the cut ``*.tmp`` save stays
  behind, so the disk stays full;
* under several ranks the rank whose write fails leaves the save while the others wait for
  it in a barrier, until ``dist.timeout_s`` (DeepSpeed's own save ends in a barrier too).

So every file of a save is written through a Python file object (``ENOSPC`` then arrives
as ``OSError`` with its errno), DeepSpeed's writer records a failure instead of raising it
(:func:`deferred_engine_writes`: its save runs on to its closing barrier on every rank),
and :mod:`mmalign.run.checkpoint` agrees on the failures of all ranks before it removes the
partial save and raises :class:`CheckpointWriteError` (one line: the path, the reason, the
free space).  :class:`SpaceWatch` warns, once, when the next save will not fit.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from mmalign.errors import RunStopped, UserError
from mmalign.layout import ds_adapter

log = logging.getLogger("mmalign.run.train")

# errnos that mean "this filesystem cannot take the bytes", named in the user's words
_FULL = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded"}
# torch's C++ stream writer loses the errno; these are its messages for a failed write
_TORCH_WRITER = ("unexpected pos", "PytorchStreamWriter failed", "inline_container", "iostream error")


class CheckpointWriteError(RunStopped):
    """A checkpoint could not be written (a full disk, a quota, an I/O error): one line; the
    run stops with exit status 1 and its last complete checkpoint intact."""


def size_text(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def free_bytes(path: Path) -> int | None:
    """Free bytes for an unprivileged writer on ``path``'s filesystem (its nearest existing
    parent); None where it cannot be read."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            try:
                return shutil.disk_usage(candidate).free
            except OSError:
                return None
    return None


def tree_bytes(path: Path | None) -> int:
    """The bytes of the files under ``path`` (0 for None or a missing directory)."""
    if path is None or not path.is_dir():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def save_torch(obj, path: Path, **kwargs) -> None:
    """``torch.save`` through a Python file, so that a full disk is ``OSError(ENOSPC)``
    (torch's own writer of a path turns it into "unexpected pos")."""
    with open(path, "wb") as f:
        torch.save(obj, f, **kwargs)


def _chain(error: BaseException | None) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def write_reason(error: BaseException) -> str | None:
    """What stopped a write, in a few words (``no space left on device``); None when
    ``error`` is not a failed write (a bug, an interrupt: reported as it is)."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno is not None:
            return _FULL.get(e.errno) or (e.strerror or str(e)).lower()
    text = str(error)
    if isinstance(error, RuntimeError) and any(mark in text for mark in _TORCH_WRITER):
        return f"the write failed ({text.strip().splitlines()[0][:120]})"
    return None


@contextlib.contextmanager
def deferred_engine_writes(engine, failures: list):
    """While DeepSpeed saves: each file its checkpoint engine writes goes through
    :func:`save_torch`, and a failed write is appended to ``failures`` (its partial file
    removed) instead of raised, so that DeepSpeed's save still reaches its closing barrier
    on this rank.  An engine without DeepSpeed's checkpoint writer
    (:func:`mmalign.layout.ds_adapter.checkpoint_writer`) is left as it is."""
    found = ds_adapter.checkpoint_writer(engine)
    if found is None:
        yield
        return
    # DeepSpeed's torch writer, rewritten through a Python file; any other writer keeps its own
    writer: Any  # DeepSpeed's checkpoint engine (ds_adapter checked that its save is callable)
    writer, zipfile = found
    original = writer.save

    def save(state_dict, path):
        if failures:  # one failure is enough: the save is dropped, write nothing more
            return
        try:
            if zipfile is None:  # another checkpoint engine: its own writer
                original(state_dict, path)
            else:
                save_torch(state_dict, Path(path), _use_new_zipfile_serialization=zipfile)
        except Exception as e:  # noqa: BLE001 - recorded; the caller agrees on it with every rank
            failures.append(e)
            Path(path).unlink(missing_ok=True)

    with ds_adapter.shadowed(writer, "save", save):
        yield


class SpaceWatch:
    """Before each save (rank 0): whether the filesystem holds one more checkpoint of the size
    of the last one; one warning per run directory when it does not (the save is still tried:
    the size is an estimate)."""

    def __init__(self) -> None:
        self._warned: set[Path] = set()

    def check(self, base: Path, last: Path | None, step: int) -> str | None:
        """The warning line (printed and logged), or None."""
        need, free = tree_bytes(last), free_bytes(base)
        if base in self._warned or last is None or not need or free is None or free >= need:
            return None
        self._warned.add(base)
        line = (
            f"mmalign: warning: {size_text(free)} free on the filesystem of {base}, and the last checkpoint "
            f"({last.name}) took {size_text(need)}: the save of step {step} will probably not fit"
        )
        print(line, flush=True)
        log.warning("%s", line)
        return line


# one per process: a run warns once, however many saves follow
space_watch = SpaceWatch()


# ------------------------------------------------- the run's other writes (final/, logs, eval json)

# what a writer that is not Python's own says of a full or read-only disk (safetensors' Rust writer)
_TEXT_REASONS = (
    ("no space left on device", "no space left on device"),
    ("os error 28", "no space left on device"),
    ("disk quota exceeded", "disk quota exceeded"),
    ("os error 122", "disk quota exceeded"),
    ("read-only file system", "read-only file system"),
    ("os error 30", "read-only file system"),
)
_STOPPING = {errno.ENOSPC, errno.EDQUOT, errno.EROFS}


class RunWriteError(RunStopped):
    """A file of the run other than a checkpoint (``final/``, metrics.jsonl, TensorBoard, an eval
    json) could not be written: one line, exit status 1, the last checkpoint intact."""


def _stopping_reason(error: BaseException) -> tuple[str, str | None] | None:
    """(reason, file name or None) when ``error`` is a write that a full, over-quota or
    read-only filesystem refused; None for anything else (reported as it is)."""
    for e in _chain(error):
        if isinstance(e, OSError) and e.errno in _STOPPING:
            return _FULL.get(e.errno, "read-only file system"), e.filename
    text = str(error).lower()
    for mark, reason in _TEXT_REASONS:
        if mark in text:
            return reason, None
    return None


def run_write_error(error: BaseException, out: Path, what: str | None = None) -> RunWriteError | None:
    """The one-line :class:`RunWriteError` for ``error`` (a refused write of the run in ``out``;
    ``what`` names it when the error does not), or None when ``error`` is something else."""
    found = _stopping_reason(error)
    if found is None:
        return None
    reason, filename = found
    target = filename or what or f"a file of the run in {out}"
    free = free_bytes(Path(filename).parent if filename else out)
    space = (
        ""
        if reason == "read-only file system"
        else f"; {'?' if free is None else size_text(free)} free on that filesystem"
    )
    latest = out / "checkpoints" / "latest"
    try:
        named = latest.read_text().strip() if latest.is_file() else ""
    except (OSError, UnicodeDecodeError):
        named = ""
    fix = "make the folder writable" if reason == "read-only file system" else "free some space"
    return RunWriteError(
        f"cannot write {target}: {reason}{space}; "
        + (
            f"the last checkpoint, {named}, is intact: {fix}, then continue with --resume latest"
            if named
            else f"no checkpoint of this run is saved: {fix}, then start it again"
        )
    )


@contextlib.contextmanager
def stop_on_refused_write(out: Path, what: str | None = None):
    """Turn a write refused by a full, over-quota or read-only filesystem inside the block into
    :class:`RunWriteError` (one line instead of a traceback); anything else passes unchanged."""
    try:
        yield
    except (RunStopped, UserError):  # already one line
        raise
    except Exception as e:
        # a file's close while a stop unwinds (the same full disk again): the first line stands
        earlier = next((c for c in _chain(e) if isinstance(c, RunStopped)), None)
        stop = (
            earlier
            if earlier is not None and run_write_error(e, Path(out))
            else run_write_error(e, Path(out), what)
        )
        if stop is None:
            raise
        raise stop from None
