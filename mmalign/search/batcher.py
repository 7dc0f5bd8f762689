"""A bounded micro-batcher: concurrent callers' items are handled in one call of ``fn``.

    b = Batcher(encode, max_batch=32, max_wait_s=0.003, max_queue=256)
    vector = b.submit("a red circle")     # blocks until its batch is done; thread-safe
    b.close()

One worker thread takes the first waiting item and every item already queued behind it
(up to ``max_batch``); when the previous batch held more than one item (callers are
arriving together) it also waits up to ``max_wait_s`` for more.  A lone caller is thus
never delayed, and under load batches fill while the previous one runs.  It then calls
``fn(items) -> results`` once (``len(results) == len(items)``).  Each caller gets its own result back.  An exception
raised by ``fn`` reaches the callers of that batch only; the worker goes on.

The queue is bounded: a submit that finds ``max_queue`` items waiting raises
:class:`Overloaded` at once (a server answers 503) instead of waiting without bound.
The worker is a daemon thread and also stops on :meth:`close` (or when the batcher is
garbage-collected), so neither a forgotten batcher nor interpreter exit hangs.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

_STOP = object()  # the worker's end-of-queue marker


class Overloaded(RuntimeError):
    """The batcher's queue is full: the caller should back off (HTTP 503)."""


class BatcherClosed(RuntimeError):
    """A submit after :meth:`Batcher.close`."""


def _work(items: queue.Queue, fn: Callable[[list], Sequence], max_batch: int, max_wait_s: float) -> None:
    """The worker loop (a function, not a method: the thread holds no reference to the batcher)."""
    busy = False  # the last batch held more than one item
    while True:
        first = items.get()
        if first is _STOP:
            return
        batch: list[tuple[Any, Future]] = [first]
        deadline = time.monotonic() + (max_wait_s if busy else 0.0)
        stop = False
        while len(batch) < max_batch:
            left = deadline - time.monotonic()
            try:
                item = items.get(timeout=left) if left > 0 else items.get_nowait()
            except queue.Empty:
                break
            if item is _STOP:
                stop = True
                break
            batch.append(item)
        busy = len(batch) > 1
        live = [(x, f) for x, f in batch if f.set_running_or_notify_cancel()]
        if live:
            try:
                results = fn([x for x, _ in live])
                if len(results) != len(live):
                    raise RuntimeError(
                        f"batch function returned {len(results)} results for {len(live)} items"
                    )
            except BaseException as e:  # noqa: BLE001 - handed to this batch's callers, the worker goes on
                for _, f in live:
                    f.set_exception(e)
            else:
                for (_, f), r in zip(live, results):
                    f.set_result(r)
        if stop:
            return


class Batcher:
    """Gathers concurrent :meth:`submit` calls into batches for ``fn`` (one worker thread)."""

    def __init__(
        self,
        fn: Callable[[list], Sequence],
        *,
        max_batch: int = 32,
        max_wait_s: float = 0.003,
        max_queue: int = 256,
        name: str = "mmalign-batcher",
    ):
        if max_batch < 1 or max_queue < 1 or max_wait_s < 0:
            raise ValueError("max_batch and max_queue must be >= 1, max_wait_s >= 0")
        self.max_batch, self.max_wait_s, self.max_queue = int(max_batch), float(max_wait_s), int(max_queue)
        self._items: queue.Queue = queue.Queue(maxsize=self.max_queue)
        self._closed = False
        self._lock = threading.Lock()  # a submit never lands behind the stop marker
        self._thread = threading.Thread(
            target=_work, args=(self._items, fn, self.max_batch, self.max_wait_s), name=name, daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, _stop, self._items)

    def submit(self, item: Any, timeout: float | None = None) -> Any:
        """``fn([..., item, ...])``'s result for ``item``; raises :class:`Overloaded` when the queue is
        full, ``fn``'s exception when its batch failed, ``TimeoutError`` after ``timeout`` seconds."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise BatcherClosed("the batcher is closed")
            try:
                self._items.put_nowait((item, future))
            except queue.Full:
                raise Overloaded(f"{self.max_queue} queries are already waiting; try again") from None
        return future.result(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the worker after the items already queued; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._finalizer.detach()
            _stop(self._items)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> Batcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _stop(items: queue.Queue) -> None:
    """Put the stop marker even when the queue is full (it is bounded for callers, not for us)."""
    with items.mutex:
        items.queue.append(_STOP)
        items.unfinished_tasks += 1
        items.not_empty.notify()
