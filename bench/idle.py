"""Benchmarks run on an idle machine: the load-average guard every bench's doc table goes through.

A timing taken while other jobs compete for the cores measures the neighbours as much as the
code, and such tables are not comparable with each other or with idle ones.  So each bench
script that writes a section of docs/*.md does it like this (through bench/harness.py, which
re-exports these names):

    watch = LoadWatch()                          # first thing: 1-minute load average now
    ...                                          # the bench; it prints its table
    write_section(DOC, text, watch, args.allow_loaded)

``write_section`` reads the load again and compares the larger of the two 1-minute load
averages with the cores this process may run on (``os.sched_getaffinity`` where smaller than
``os.cpu_count()``):

- not above the core count: the section is written with a line naming both loads;
- above it, without ``--allow-loaded``: the document is left alone, one line on stderr says
  why, and the script exits with status ``EXIT_LOADED`` (3; distinct from 0 = written,
  1 = a bench failure and 2 = a usage error, so a driver running benches notices);
- above it, with ``--allow-loaded`` (``add_flag`` adds the flag): the section is written and
  says "Taken under load (...): not comparable".

The end reading includes the bench's own runnable threads and processes: a bench that keeps the
cores busy ends near (or, with more workers than cores, above) the core count on an idle
machine.  So the end reading is judged after taking away the bench's own average CPU use over
its run (``os.times()``: this process and the children it has waited for, per wall-clock
second): what is left is the other jobs' share.  The start reading is judged as it is.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from bench import docsection

EXIT_LOADED = 3


def usable_cores() -> int:
    """Cores this process may run on: the affinity mask when it is narrower than the machine."""
    n = os.cpu_count() or 1
    if hasattr(os, "sched_getaffinity"):
        n = min(n, len(os.sched_getaffinity(0)))
    return n


class LoadWatch:
    """The 1-minute load average at the start (construction) and at the end (``stop``) of a bench."""

    def __init__(self) -> None:
        self.cores = usable_cores()
        self.start = os.getloadavg()[0]
        self.end: float | None = None
        self.own = 0.0  # the bench's own average CPU use (cores) over its run, read with the end load
        self._cpu0, self._wall0 = _cpu_seconds(), time.monotonic()

    def stop(self) -> LoadWatch:
        """Read the end load once; later calls keep the first reading."""
        if self.end is None:
            self.end = os.getloadavg()[0]
            wall = time.monotonic() - self._wall0
            self.own = (_cpu_seconds() - self._cpu0) / wall if wall > 0 else 0.0
        return self

    @property
    def loaded(self) -> bool:
        self.stop()
        return max(self.start, self.end - self.own) > self.cores

    def describe(self) -> str:
        """One line for the table's header, e.g. 'load 0.4 at start, 1.9 at end, 2 cores'."""
        self.stop()
        return (
            f"load {self.start:.1f} at start, {self.end:.1f} at end (the bench itself used {self.own:.1f}), "
            f"{self.cores} cores"
        )

    def note(self) -> str:
        """The line a written section carries under its heading."""
        if self.loaded:
            return (
                f"Taken under load ({self.describe()}): not comparable with tables taken on an idle machine."
            )
        return f"Idle machine: {self.describe()} (1-minute load averages)."


def _cpu_seconds() -> float:
    """User + system CPU seconds of this process and its waited-for children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def add_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--allow-loaded",
        action="store_true",
        help="write the doc table even if the 1-minute load average exceeded the core count "
        "(it is then marked 'taken under load'); without it such a run exits with status "
        f"{EXIT_LOADED} and leaves the doc alone",
    )


def write_section(
    doc: Path, text: str, watch: LoadWatch, allow_loaded: bool, title: str = "# Benchmarks", note: bool = True
) -> None:
    """Write ``text`` (a section starting with its ``## `` heading) into ``doc`` with the load note
    under the heading (``note=False``: the text places it itself, e.g. one per subsection), or
    refuse: one line on stderr and ``SystemExit(EXIT_LOADED)``."""
    watch.stop()
    if watch.loaded and not allow_loaded:
        print(
            f"{doc.parent.name}/{doc.name} not written: {watch.describe()}: the machine was loaded, so the table is not "
            "comparable (rerun on an idle machine, or pass --allow-loaded to record it marked as such)",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(EXIT_LOADED)
    if not note:
        docsection.write_section(doc, text, title)
        return
    heading, _, rest = text.partition("\n")
    docsection.write_section(doc, f"{heading}\n\n{watch.note()}\n\n{rest.lstrip(chr(10))}", title)
