"""One writer per output folder: an exclusive lock on a run directory (train), a curate ``--out``
or an embed output, so two launches of one command cannot interleave their writes.

The lock is ``DIR/.mmalign.lock``: ``flock`` on an open descriptor (the kernel drops it when
the holder dies, however it dies, so a stale lock frees itself), and the file's content names
the holder (pid, host, command, start time) for the refusal line. A lock file whose holder is
gone is simply taken over; its stale content is only ever read to name a live holder.

Processes a holder starts (``--nproc`` ranks, torchrun workers) inherit the holder's claim
through :data:`ENV` (the resolved folders it holds), so a rank's own ``hold`` of the same folder
is a no-op instead of a refusal by its own launcher.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from mmalign.errors import UsageError

__all__ = ["LOCK_FILE", "ENV", "DirLock", "hold", "holder"]

LOCK_FILE = ".mmalign.lock"
ENV = "MMALIGN_HELD_LOCKS"  # os.pathsep-separated resolved folders an ancestor process holds


def _inherited() -> set[str]:
    return {p for p in os.environ.get(ENV, "").split(os.pathsep) if p}


def holder(directory: str | os.PathLike) -> dict | None:
    """The recorded holder of ``directory``'s lock file (pid, host, command, since), or None."""
    try:
        return json.loads((Path(directory) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None


def _describe(info: dict | None) -> str:
    if not info:
        return "another process (no holder recorded yet)"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("since", 0)))
    return (
        f"{info.get('command', '?')} (pid {info.get('pid', '?')} on {info.get('host', '?')}, since {since})"
    )


class DirLock:
    """Holds ``directory``'s lock from :meth:`acquire` to :meth:`release` (or the process's end)."""

    def __init__(self, directory: str | os.PathLike, what: str):
        self.directory = Path(directory)
        self.what = what  # e.g. "mmalign train": names this holder in another launch's refusal
        self.fd: int | None = None
        self.inherited = False

    def acquire(self) -> DirLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        key = str(self.directory.resolve())
        if key in _inherited():
            self.inherited = True  # an ancestor (our launcher) holds it for us
            return self
        path = self.directory / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise UsageError(
                f"{self.directory}: cannot create its lock file {path} ({e.strerror or e})"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise UsageError(
                    f"{self.directory} is in use by {_describe(holder(self.directory))}; wait for it "
                    f"to end or stop it (one writer per folder)"
                ) from None
            if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                # a file system without locks (some network mounts): the record still names us
                print(
                    f"mmalign: warning: {self.directory} does not support file locks; two launches on it "
                    f"would not be stopped",
                    file=sys.stderr,
                    flush=True,
                )
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            else:
                raise UsageError(f"{self.directory}: cannot lock {path} ({e.strerror or e})") from None
        record = {
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "command": self.what,
            "since": time.time(),
        }
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
        except OSError:
            pass  # the lock holds without its record (a full disk): refusals then name no holder
        self.fd = fd
        os.environ[ENV] = os.pathsep.join(sorted(_inherited() | {key}))  # for the processes we start
        return self

    def release(self) -> None:
        if self.fd is None:
            return
        key = str(self.directory.resolve())
        os.environ[ENV] = os.pathsep.join(sorted(_inherited() - {key}))
        try:
            os.ftruncate(self.fd, 0)  # no holder recorded: the file alone means nothing
        except OSError:
            pass
        os.close(self.fd)  # closing drops the flock
        self.fd = None

    def __enter__(self) -> DirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def hold(directory: str | os.PathLike, what: str) -> DirLock:
    """Take ``directory``'s lock now (a one-line :class:`UsageError` naming the holder when it is
    taken); use as ``with hold(out, "mmalign curate"): ...`` or keep it until the process ends."""
    return DirLock(directory, what).acquire()
