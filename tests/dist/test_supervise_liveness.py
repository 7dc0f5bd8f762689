"""``python -m mmalign.dist.supervise`` watches the agent's workers, not only their output (issue 39,
point 7): a far host's worker killed before it could print the lost-contact line left its agent
running (150 s later, still). Now an agent that had workers and has none left, with no
lost-contact line, is ended once ``--idle-limit`` has passed; a restart that starts new
workers within the limit is left alone.

The agent is a stand-in for torchrun: a Python process that starts a silent worker (a child
that prints nothing) and, once that worker is gone, behaves as told. The test kills the worker
with SIGKILL, as the OOM killer or a dying host would. Every wait is bounded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration  # real processes, a browser or a supervisor's timeouts

AGENT = r"""
import os, signal, subprocess, sys, time
mode, pidfile = sys.argv[1], sys.argv[2]
def worker(live_s):  # silent: it never prints the lost-contact line
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({live_s})"], start_new_session=True)
w = worker(120)
open(pidfile, "w").write(f"{os.getpid()} {w.pid}")
w.wait()
if mode == "stuck":  # torchrun retrying a store it cannot reach, deaf to SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for _ in range(1200):
        time.sleep(0.05)
    sys.exit(0)  # not reached when ended
if mode == "restart":  # a new attempt within the limit, which then succeeds
    time.sleep(0.2)
    sys.exit(worker(2.0).wait())
"""

LIMIT_S = 60  # far above what any run here needs, so a hang fails instead of blocking


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _run_killing_the_worker(tmp_path, mode: str, *flags: str):
    """The supervised agent; its worker is SIGKILLed once it runs. Returns (exit status, stderr,
    seconds from the kill to the supervisor's end, (agent pid, worker pid))."""
    pidfile = tmp_path / "pids"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mmalign.dist.supervise",
            *flags,
            "--",
            sys.executable,
            "-c",
            AGENT,
            mode,
            str(pidfile),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + LIMIT_S
        while not (pidfile.is_file() and len(pidfile.read_text().split()) == 2):
            assert time.monotonic() < deadline and proc.poll() is None, "the agent did not start its worker"
            time.sleep(0.05)
        pids = tuple(map(int, pidfile.read_text().split()))
        time.sleep(2)  # the supervisor has seen the worker live (it polls every 0.2 s)
        os.kill(pids[1], signal.SIGKILL)  # no line printed: the supervisor sees no lost-contact report
        killed = time.monotonic()
        _, err = proc.communicate(timeout=LIMIT_S)
        return proc.returncode, err, time.monotonic() - killed, pids
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=LIMIT_S)
        for pid in map(int, pidfile.read_text().split() if pidfile.is_file() else ()):
            try:  # a failed test leaves no stray agent behind
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_an_agent_whose_worker_was_killed_silently_is_ended_within_the_idle_limit(tmp_path):
    code, err, elapsed, (agent, worker) = _run_killing_the_worker(
        tmp_path, "stuck", "--idle-limit", "1", "--kill-after", "1"
    )
    assert code == 1, err
    # 1 s idle limit + 1 s to SIGKILL + polling; the agent alone would run 60 s
    assert elapsed < 15, f"{elapsed:.1f} s"
    lines = [line for line in err.splitlines() if "ending it" in line]
    assert len(lines) == 1 and lines[0].startswith(
        f"mmalign: supervise: the agent (pid {agent}) has had no live worker for 1 s"
    ), err
    assert "without a lost-contact line" in lines[0] and "Traceback" not in err
    assert _gone(agent) and _gone(worker)


def test_a_restart_within_the_idle_limit_is_left_alone(tmp_path):
    code, err, _, _ = _run_killing_the_worker(tmp_path, "restart", "--idle-limit", "1.5")
    assert code == 0 and "ending it" not in err, err  # the agent's own status: its new worker succeeded


def test_the_idle_limit_is_checked_like_the_other_durations():
    res = subprocess.run(
        [sys.executable, "-m", "mmalign.dist.supervise", "--idle-limit", "-2", "torchrun"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and lines == [
        "mmalign: error: --idle-limit must be a number of seconds >= 0, not -2"
    ]


@pytest.mark.parametrize("limit", ["", "--idle-limit=600"])
def test_the_default_and_a_long_limit_leave_a_briefly_idle_agent_alone(tmp_path, limit):
    code, err, _, _ = _run_killing_the_worker(tmp_path, "restart", *([limit] if limit else []))
    assert code == 0 and "ending it" not in err, err
