"""``fn(i)`` for i < n, each in its own thread: the concurrency tests' runner."""

from __future__ import annotations

import threading


def run_threads(fn, n: int, *, together: bool = False, timeout: float = 60.0) -> list:
    """The results in index order; an exception is returned in its place for the test to look at.
    ``together``: every thread waits at a barrier first, so the calls really overlap."""
    barrier, out = threading.Barrier(n), [None] * n

    def one(i):
        if together:
            barrier.wait()
        try:
            out[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - the test looks at it
            out[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return out
