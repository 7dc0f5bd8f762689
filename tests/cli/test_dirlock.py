"""mmalign.dirlock: one writer per folder; the refusal names the holder; a dead holder's lock is free;
a holder's children inherit its claim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from mmalign.dirlock import ENV, LOCK_FILE, hold, holder
from mmalign.errors import UsageError
from tests.harness import ROOT

HOLD = "import sys, time; from mmalign.dirlock import hold; hold(sys.argv[1], 'mmalign train'); print('held', flush=True); time.sleep(60)"


def _holder_process(directory):
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(directory)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV: ""},
    )
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_holder_is_refused_in_one_line_naming_the_first(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    proc = _holder_process(tmp_path)
    try:
        with pytest.raises(UsageError) as e:
            hold(tmp_path, "mmalign curate")
        msg = str(e.value)
        assert (
            "\n" not in msg and f"pid {proc.pid}" in msg and "mmalign train" in msg and str(tmp_path) in msg
        )
        assert holder(tmp_path)["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()


def test_a_killed_holders_lock_is_stale_and_taken_over(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    proc = _holder_process(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)  # no clean-up ran: its record is still in the file
    proc.wait()
    assert holder(tmp_path)["pid"] == proc.pid
    lock = hold(tmp_path, "mmalign train")
    try:
        assert holder(tmp_path)["pid"] == os.getpid()
    finally:
        lock.release()
    assert (tmp_path / LOCK_FILE).read_text() == ""  # released: no holder recorded


def test_released_lock_can_be_taken_again_and_children_inherit(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with hold(tmp_path, "mmalign train"):
        assert str(tmp_path.resolve()) in os.environ[ENV].split(os.pathsep)
        # a rank started by the holder: its own hold of the folder is a no-op, not a refusal
        child = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from mmalign.dirlock import hold; print(hold(sys.argv[1], 'rank').inherited)",
                str(tmp_path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert child.returncode == 0 and child.stdout.strip() == "True", child.stderr
        # an unrelated launch (no inherited claim) is refused
        other = subprocess.run(
            [
                sys.executable,
                "-c",
                "import sys; from mmalign.dirlock import hold; hold(sys.argv[1], 'x')",
                str(tmp_path),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, ENV: ""},
        )
        assert other.returncode != 0 and "is in use by mmalign train" in other.stderr
    assert ENV not in os.environ or str(tmp_path.resolve()) not in os.environ[ENV]
    t = time.time()
    hold(tmp_path, "again").release()
    assert time.time() - t < 2
