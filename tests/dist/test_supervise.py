"""``python -m mmalign.dist.supervise``: an agent that outlives its workers after they lost contact is
ended within the grace; any other agent is left alone (issue 28, point 5).

The agent here is a stand-in for torchrun: a Python process that starts one worker (a
child printing mmalign's lost-contact line, or not) and then behaves as told: hangs
ignoring SIGTERM (torchrun retrying an unreachable store), hangs until SIGTERM, restarts a
worker, or exits. The two-host version is tests/dist/multihost/test_two_hosts.py. Every wait is
bounded.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.harness import ROOT

pytestmark = pytest.mark.integration  # real processes, a browser or a supervisor's timeouts

LOST = (
    "mmalign: error: lost contact with another rank (a host or process is gone, or the network is split; "
    "collectives wait at most dist.timeout_s={t} s): Connection closed by peer; once every host is back, "
    "relaunch with --resume latest"
)

AGENT = r"""
import os, signal, subprocess, sys, time
mode, line, pidfile = sys.argv[1], sys.argv[2], sys.argv[3]
def worker(code, live_s=0.0):
    src = f"import sys, time; time.sleep({live_s}); print({line!r}, file=sys.stderr, flush=True); sys.exit({code})"
    return subprocess.Popen([sys.executable, "-c", src], start_new_session=True)  # as torchrun starts its workers
w = worker(1)
open(pidfile, "w").write(f"{os.getpid()} {w.pid}")
w.wait()
print("agent: worker exited", flush=True)
if mode == "stubborn":  # torchrun retrying a store it cannot reach
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode in ("stubborn", "retrying"):
    for _ in range(1200):
        time.sleep(0.05)
    sys.exit(0)  # not reached when ended
if mode == "restart":  # a new attempt whose worker outlives the grace, then succeeds
    time.sleep(0.3)
    sys.exit(worker(0, 2.5).wait())
if mode == "slow-exit":  # no lost contact: an agent without workers for a while is its own business
    time.sleep(2.5)
    sys.exit(3)
if mode == "trap":  # reports SIGTERM (forwarded by the supervisor) and exits with 143
    signal.signal(signal.SIGTERM, lambda s, f: (print("agent: got SIGTERM", flush=True), sys.exit(143)))
    open(pidfile + ".ready", "w").close()
    for _ in range(600):
        time.sleep(0.05)
    sys.exit(0)
"""

LIMIT_S = 60  # any run here: far above what it needs, so a hang fails instead of blocking


def _supervise(tmp_path, mode, t="1", extra=(), wait=True):
    pidfile = tmp_path / "pids"
    cmd = [
        sys.executable,
        "-m",
        "mmalign.dist.supervise",
        *extra,
        "--",
        sys.executable,
        "-c",
        AGENT,
        mode,
        LOST.format(t=t) if t else "worker: some other failure",
        str(pidfile),
    ]
    if not wait:
        return subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        ), pidfile
    start = time.monotonic()
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S)
    return res, time.monotonic() - start, pidfile


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _ended_line(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "ending it" in line]


def test_an_agent_that_ignores_sigterm_after_lost_contact_is_killed_within_the_grace(tmp_path):
    res, elapsed, pidfile = _supervise(tmp_path, "stubborn", t="1", extra=("--kill-after", "1"))
    assert res.returncode == 1, res.stderr
    # grace 1 s (the line's dist.timeout_s) + 1 s to SIGKILL + start-up; the agent alone would run 60 s
    assert elapsed < 15, f"{elapsed:.1f} s"
    lines = _ended_line(res.stderr)
    assert (
        len(lines) == 1
        and lines[0].startswith("mmalign: supervise: the agent (pid ")
        and "still running 1 s after its workers lost contact" in lines[0]
    ), res.stderr
    assert "lost contact with another rank" in res.stderr  # the worker's line passed through
    assert "agent: worker exited" in res.stdout
    agent, worker = map(int, pidfile.read_text().split())
    assert _gone(agent) and _gone(worker)


def test_sigterm_ends_a_retrying_agent_without_waiting_for_sigkill(tmp_path):
    res, elapsed, _ = _supervise(tmp_path, "retrying", t="1", extra=("--kill-after", "30"))
    assert res.returncode == 1 and len(_ended_line(res.stderr)) == 1, res.stderr
    assert elapsed < 15, f"{elapsed:.1f} s"  # not the 30 s before SIGKILL


def test_grace_option_overrides_the_reported_timeout(tmp_path):
    res, elapsed, _ = _supervise(tmp_path, "retrying", t="600", extra=("--grace", "0.5"))
    assert res.returncode == 1 and "still running 0.5 s after" in res.stderr, res.stderr
    assert elapsed < 15, f"{elapsed:.1f} s"


def test_a_restart_after_lost_contact_is_left_alone(tmp_path):
    # the new worker lives 2.5 s, longer than the 1 s grace: the agent has a live worker meanwhile
    res, _, _ = _supervise(tmp_path, "restart", t="1")
    assert res.returncode == 0 and not _ended_line(res.stderr), res.stderr


def test_an_agent_without_a_lost_contact_report_is_left_alone(tmp_path):
    res, elapsed, _ = _supervise(tmp_path, "slow-exit", t="", extra=("--grace", "0.5"))
    assert res.returncode == 3 and not _ended_line(res.stderr), res.stderr  # the agent's own status
    assert elapsed >= 2.5
    assert "worker: some other failure" in res.stderr and "agent: worker exited" in res.stdout


def test_sigterm_to_the_supervisor_reaches_the_agent(tmp_path):
    proc, pidfile = _supervise(tmp_path, "trap", t="", wait=False)
    try:
        deadline = time.monotonic() + LIMIT_S
        ready = pidfile.with_name(pidfile.name + ".ready")  # the agent's handler is in place
        while not ready.is_file():
            assert time.monotonic() < deadline and proc.poll() is None, "the agent did not get ready"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=LIMIT_S)
    assert proc.returncode == 143 and "agent: got SIGTERM" in out, out + err


@pytest.mark.parametrize(
    "argv, needle",
    [
        ([], "no agent command given"),
        (["--"], "no agent command given"),
        (["--grace", "-1", "torchrun"], "--grace must be a number of seconds >= 0"),
        (["--kill-after", "nan", "torchrun"], "--kill-after must be a number of seconds >= 0"),
        (["mmalign-no-such-agent-command"], "cannot run the agent command 'mmalign-no-such-agent-command'"),
    ],
)
def test_a_bad_supervisor_line_is_one_line_and_exit_2(argv, needle):
    res = subprocess.run(
        [sys.executable, "-m", "mmalign.dist.supervise", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmalign: error: ") and needle in lines[0], res.stderr


def test_supervise_imports_neither_torch_nor_the_training_code():
    """The supervisor starts with the agent on every node: it must not pay torch's import."""
    code = "import sys, mmalign.dist.supervise; print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('mmalign.')))"
    res = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=LIMIT_S
    )
    # the package's own __init__ (a docstring) and the supervisor, nothing else of mmalign
    assert res.returncode == 0 and res.stdout.strip() == "['mmalign.dist', 'mmalign.dist.supervise']", (
        res.stdout + res.stderr
    )
