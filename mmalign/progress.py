"""Progress a user can see: a tqdm bar on a terminal, readable lines everywhere else.

A bar only renders on a terminal; in a log file, a pipe or a job scheduler's output
tqdm's carriage returns pile up into one unreadable line.  So off a terminal, long
loops print one plain line at most every ``every_s`` seconds, and training prints
one line per ``train.log_every`` (step, loss, lr, scale, samples/s, ETA) in the
manner of open_clip's training script.

A terminal of zero width (``script -q -c CMD /dev/null``, some CI and job consoles: a
pseudo-terminal nobody sized) or of unknown width counts as no terminal: tqdm draws
its bar in 0 columns there, i.e. nothing at all, so :func:`use_bar` sends such output
to the plain lines.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Generator, Iterable, Iterator

from tqdm import tqdm


def is_terminal(stream=None) -> bool:
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def terminal_columns(stream=None) -> int | None:
    """The width of the terminal behind ``stream`` (default stderr, where tqdm draws); None
    when it has no file descriptor or the size cannot be read."""
    stream = sys.stderr if stream is None else stream
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, ValueError, OSError):  # no fileno (a replaced stream), closed, not a tty
        return None


def use_bar(stream=None) -> bool:
    """Whether a tqdm bar can be seen on ``stream``: a terminal with a known, non-zero width.
    Everywhere else progress goes out as plain lines."""
    return is_terminal(stream) and (terminal_columns(stream) or 0) > 0


class Counted:
    """An iterator that states how many items it has left (``operator.length_hint``), so a
    loop over a generator can still show a total and an ETA. The count is the source's
    word (rows in a table, files in a folder), not checked."""

    def __init__(self, items: Iterable, count: int):
        self._items, self._left = iter(items), int(count)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self):
        item = next(self._items)
        self._left = max(self._left - 1, 0)
        return item

    def __length_hint__(self) -> int:
        return self._left


def duration(seconds: float) -> str:
    """``H:MM:SS`` (``D days, H:MM:SS`` past a day); ``?`` when unknown."""
    if seconds != seconds or seconds in (float("inf"), float("-inf")) or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    text = f"{rest // 3600}:{rest % 3600 // 60:02d}:{rest % 60:02d}"
    return f"{days} days, {text}" if days else text


def track(
    items: Iterable,
    desc: str,
    *,
    total: int | None = None,
    unit: str = "it",
    enabled: bool = True,
    every_s: float = 10.0,
    out=None,
) -> Generator:
    """``items`` with progress: a tqdm bar on a terminal, else a line every ``every_s`` seconds
    and one at the end (``mmalign: <desc>: N <unit> [of T] (R/s)``)."""
    if not enabled:
        yield from items
        return
    if use_bar():
        yield from tqdm(items, desc=desc, total=total, unit=unit, dynamic_ncols=True, leave=False)
        return
    out = sys.stdout if out is None else out
    start = last = time.time()
    n = 0

    def line(final: bool) -> str:
        elapsed = time.time() - start
        of = f" of {total}" if total else ""
        rate = f" ({n / elapsed:.1f}/s)" if elapsed > 0 else ""
        eta = ""
        if total and not final and n:
            eta = f", ETA {duration((total - n) * elapsed / n)}"
        return f"mmalign: {desc}: {n}{of} {unit}{rate}{eta}" + (
            f", done in {duration(elapsed)}" if final else ""
        )

    for item in items:
        yield item
        n += 1
        if time.time() - last >= every_s:
            last = time.time()
            print(line(False), file=out, flush=True)
    print(line(True), file=out, flush=True)


def train_line(step: int, steps: int, record: dict, eta_s: float | None) -> str:
    """One readable training line (open_clip style): step, loss, lr, scale, samples/s, ETA
    (``warming up`` while ``eta_s`` is None: no estimate from the set-up steps)."""
    width = len(str(steps))
    parts = [
        f"step {step:>{width}}/{steps} ({100 * step / steps:3.0f}%)",
        f"loss {record['loss']:.4f}",
        f"lr {record['lr']:.3e}",
    ]
    if "logit_scale" in record:
        parts.append(f"scale {record['logit_scale']:.2f}")
    parts.append(f"samples/s {record['samples_per_s']:.1f}")
    if record.get("skipped_steps"):
        parts.append(f"skipped {record['skipped_steps']}")
    parts.append("warming up" if eta_s is None else f"ETA {duration(eta_s)}")
    return "  ".join(parts)
