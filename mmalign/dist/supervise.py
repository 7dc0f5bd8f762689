"""A supervisor around a launcher's agent: ``python -m mmalign.dist.supervise torchrun ...``.

Why: when the network splits, every mmalign rank stops within ``dist.timeout_s`` with the
lost-contact line (``mmalign: error: lost contact with another rank ...``, exit 1), but
torchrun's agent on a node that can no longer reach the rendezvous store keeps retrying
the store after its workers are gone, and never exits. The node's job then never ends, and
neither does a scheduler's job step waiting for it.

The supervisor runs the agent command as its child, in a process group of its own, passes
its stdout through untouched and its stderr through line by line, reading it. Once a worker
has printed the lost-contact line, the agent has ``grace`` seconds (by default the
``dist.timeout_s`` that line names) to exit on its own or to start workers again (a restart
under ``--max-restarts``). An agent still alive with no live worker after that is ended:
SIGTERM to its process group, SIGKILL ``kill_after`` seconds later to the group and to
every process it had started. So a node's whole job ends within about 2 x ``dist.timeout_s``
of the split: the timeout for the ranks to notice, the grace for the agent.

A worker can also vanish without that line (killed, by the OOM killer or by hand, before it
noticed the split): the agent of that node is then watched by liveness alone. Once it has
had workers and has none left for ``idle_limit`` seconds (``--idle-limit``, 120 by default)
with no lost-contact line, it is ended the same way, with a line saying why. Torchrun either
exits or starts new workers within seconds of losing its own; a node's agent that does
neither is retrying a store it cannot reach.

The command must be the agent itself (or a wrapper that execs it): its child processes are
taken for its workers. A restart that waits longer than the grace for a lost node to come
back is ended too; with ``--max-restarts``, raise ``--grace`` to the wait you want.

SIGTERM / SIGINT / SIGHUP sent to the supervisor go on to the agent, which stops its workers.
Exit status: the agent's own (128 + N for a signal N), or 1 when the supervisor ended it.
The workers' stderr reaches the terminal through a pipe, so their progress prints plain
lines instead of a bar.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import threading
import time

import psutil

LOST_CONTACT = b"mmalign: error: lost contact with another rank"
_TIMEOUT = re.compile(rb"dist\.timeout_s=(\d+(?:\.\d+)?) s")
FALLBACK_GRACE_S = 120.0  # a lost-contact line that names no timeout (the CPU default)
IDLE_LIMIT_S = 120.0  # an agent without workers and without a lost-contact line: longer than a restart takes
POLL_S = 0.2
MAX_PARTIAL = 1 << 16  # bytes of an unfinished stderr line kept for the scan


class StderrScan:
    """Copies the agent's stderr to ours and notes the first lost-contact line (when, and the
    ``dist.timeout_s`` it names)."""

    def __init__(self, fd: int, out):
        self.fd, self.out = fd, out
        self.reported_at: float | None = None
        self.timeout_s: float | None = None
        self._partial = b""
        self.thread = threading.Thread(target=self._run, name="mmalign-supervise-stderr", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:
                break
            if not chunk:
                break
            try:
                self.out.write(chunk)
                self.out.flush()
            except (OSError, ValueError):  # our own stderr is gone: keep scanning regardless
                pass
            self._scan(chunk)
        os.close(self.fd)

    def _scan(self, chunk: bytes) -> None:
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()[-MAX_PARTIAL:]
        for line in lines:
            if self.reported_at is None and LOST_CONTACT in line:
                m = _TIMEOUT.search(line)
                self.timeout_s = float(m.group(1)) if m else None
                self.reported_at = time.monotonic()


def _live_children(pid: int) -> list[psutil.Process]:
    """The agent's child processes that are still running (a zombie has exited)."""
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    live = []
    for child in children:
        try:
            if child.status() != psutil.STATUS_ZOMBIE:
                live.append(child)
        except psutil.Error:
            pass
    return live


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _end(agent: subprocess.Popen, kill_after: float) -> None:
    """SIGTERM to the agent's group; SIGKILL to the group and everything it started once
    ``kill_after`` seconds have passed (torchrun starts its workers in sessions of their own)."""
    started = _descendants(agent.pid)
    try:
        os.killpg(agent.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    try:
        agent.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for proc in started:
        try:
            proc.kill()
        except psutil.Error:
            pass
    agent.wait()


def supervise(
    command: list[str],
    grace_s: float | None = None,
    kill_after_s: float = 10.0,
    idle_limit_s: float = IDLE_LIMIT_S,
) -> int:
    """Run the agent ``command`` until it exits, ending it when it outlives its workers after a
    lost-contact report, or ``idle_limit_s`` after its workers vanished without one (see the
    module's docstring); returns the exit status."""
    try:
        agent = subprocess.Popen(command, stderr=subprocess.PIPE, process_group=0)
    except OSError as e:
        print(
            f"mmalign: error: cannot run the agent command {command[0]!r}: {e.strerror or e}", file=sys.stderr
        )
        return 2
    assert agent.stderr is not None  # stderr=PIPE
    scan = StderrScan(os.dup(agent.stderr.fileno()), sys.stderr.buffer)
    agent.stderr.close()
    scan.thread.start()

    def forward(signum, frame):
        try:
            agent.send_signal(signum)
        except ProcessLookupError:
            pass

    forwarded = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, forward) for s in forwarded} if in_main else {}
    try:
        idle_since: float | None = None
        had_workers = ended = False
        while agent.poll() is None:
            time.sleep(POLL_S)
            now = time.monotonic()
            if _live_children(agent.pid):
                had_workers, idle_since = True, None  # workers (again: a restart is under way)
                continue
            if not had_workers and scan.reported_at is None:
                continue  # still starting: the first rendezvous is torchrun's own to time out
            idle_since = now if idle_since is None else idle_since
            if scan.reported_at is not None:
                limit = grace_s if grace_s is not None else (scan.timeout_s or FALLBACK_GRACE_S)
                # not a second "error:" line: the workers' lost-contact line said what went wrong
                why = f"is still running {limit:g} s after its workers lost contact with another rank"
            else:  # the workers vanished without a word (killed): liveness is all there is to go on
                limit = idle_limit_s
                why = (
                    f"has had no live worker for {limit:g} s (they ended without a lost-contact line, "
                    f"e.g. killed) and neither exits nor starts new ones"
                )
            if now - idle_since >= limit and agent.poll() is None:
                print(
                    f"mmalign: supervise: the agent (pid {agent.pid}) {why}; ending it (SIGTERM, then SIGKILL "
                    f"after {kill_after_s:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
                _end(agent, kill_after_s)
                ended = True
        scan.thread.join(timeout=2)  # a stray process may hold the pipe: do not wait for it
        return 1 if ended else _exit_code(agent.returncode)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mmalign.dist.supervise",
        description="Run a launcher's agent (torchrun) and end it when it outlives its workers "
        "after they lost contact with another rank (a split network).",
    )
    p.add_argument(
        "--grace",
        type=float,
        default=None,
        metavar="S",
        help="seconds the agent may live on without workers after a lost-contact line "
        "(default: the dist.timeout_s that line names)",
    )
    p.add_argument(
        "--idle-limit",
        type=float,
        default=IDLE_LIMIT_S,
        metavar="S",
        help="seconds the agent may live on after its workers are gone without a lost-contact "
        "line (killed) before it is ended (default: %(default)s)",
    )
    p.add_argument(
        "--kill-after",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when ending the agent (default: %(default)s)",
    )
    p.add_argument("command", nargs=argparse.REMAINDER, help="the agent's command line, e.g. torchrun ...")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    for name, value in (
        ("--grace", args.grace),
        ("--kill-after", args.kill_after),
        ("--idle-limit", args.idle_limit),
    ):
        if value is not None and not (value >= 0 and value != float("inf")):
            print(f"mmalign: error: {name} must be a number of seconds >= 0, not {value:g}", file=sys.stderr)
            return 2
    if not command:
        print(
            "mmalign: error: no agent command given (python -m mmalign.dist.supervise torchrun ...)",
            file=sys.stderr,
        )
        return 2
    return supervise(command, args.grace, args.kill_after, args.idle_limit)


if __name__ == "__main__":
    sys.exit(main())
