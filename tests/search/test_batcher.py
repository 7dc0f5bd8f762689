"""The bounded batcher: concurrent items in one call, each caller its own result, errors to
the failing batch only, a full queue refused at once, and a worker that always stops."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time

import pytest

from mmalign.search.batcher import Batcher, BatcherClosed, Overloaded
from tests.harness import ROOT
from tests.harness.threads import run_threads


def test_concurrent_items_share_batches_and_get_their_own_results():
    sizes = []
    gate = threading.Event()

    def square(items):
        gate.wait(5)  # the first batch waits until every caller has queued
        sizes.append(len(items))
        return [x * x for x in items]

    with Batcher(square, max_batch=8, max_wait_s=0.05, max_queue=64) as b:
        threading.Timer(0.3, gate.set).start()
        results = run_threads(b.submit, 20, timeout=10)
    assert results == [i * i for i in range(20)]
    assert sum(sizes) == 20 and max(sizes) == 8 and len(sizes) < 20  # batched, never over max_batch


def test_an_error_reaches_only_the_callers_of_its_batch():
    release = threading.Event()

    def fn(items):
        if items == ["hold"]:
            release.wait(5)  # the worker is busy: the next callers queue up together
        if "bad" in items:
            raise ValueError("boom")
        return [x.upper() for x in items]

    with Batcher(fn, max_batch=1, max_wait_s=0) as b:
        with pytest.raises(ValueError, match="boom"):
            b.submit("bad")
        assert b.submit("ok") == "OK"  # the worker went on
    with Batcher(fn, max_batch=4, max_wait_s=0) as b:
        held = threading.Thread(target=lambda: b.submit("hold"))
        held.start()
        time.sleep(0.2)
        threading.Timer(0.3, release.set).start()
        out = run_threads(lambda i: b.submit("bad" if i == 0 else f"x{i}"), 3, timeout=10)
        held.join(5)
        assert all(isinstance(r, ValueError) for r in out), out  # one batch: all of it failed
        assert b.submit("later") == "LATER"


def test_a_lone_caller_does_not_wait_for_company():
    sizes = []
    with Batcher(lambda items: sizes.append(len(items)) or items, max_batch=64, max_wait_s=2.0) as b:
        start = time.monotonic()
        for i in range(3):
            assert b.submit(i) == i
        assert time.monotonic() - start < 1.0  # batches of one: no wait for company
    assert sizes == [1, 1, 1]


def test_wrong_result_count_is_an_error_not_a_hang():
    with Batcher(lambda items: [], max_batch=1) as b:
        with pytest.raises(RuntimeError, match="0 results for 1"):
            b.submit(1, timeout=5)


def test_a_full_queue_is_refused_at_once():
    release = threading.Event()

    def slow(items):
        release.wait(10)
        return items

    b = Batcher(slow, max_batch=1, max_wait_s=0, max_queue=2)
    taken = threading.Thread(target=b.submit, args=("first",))  # held by the worker
    taken.start()
    time.sleep(0.2)
    waiting = [threading.Thread(target=b.submit, args=(i,)) for i in range(2)]  # fill the queue
    for t in waiting:
        t.start()
    time.sleep(0.2)
    start = time.monotonic()
    with pytest.raises(Overloaded, match="2 queries are already waiting"):
        b.submit("one too many")
    assert time.monotonic() - start < 0.5
    release.set()
    for t in [taken, *waiting]:
        t.join(5)
    b.close()


def test_close_stops_the_worker_and_later_submits_fail():
    b = Batcher(lambda items: items)
    assert b.submit(3) == 3
    b.close()
    assert not b._thread.is_alive()
    with pytest.raises(BatcherClosed):
        b.submit(4)
    b.close()  # idempotent


def test_a_forgotten_batcher_stops_its_worker():
    b = Batcher(lambda items: items)
    thread = b._thread
    del b
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


def test_interpreter_exit_does_not_hang():
    code = (
        "from mmalign.search.batcher import Batcher\n"
        "import time\n"
        "b = Batcher(lambda items: [time.sleep(0.05) or x for x in items])\n"
        "assert b.submit(1) == 1\n"
        "keep = b  # never closed\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
