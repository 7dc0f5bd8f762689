"""Two simulated hosts on one machine: Linux network namespaces joined by a veth pair.

Each host is a network namespace with its own loopback and one end of a veth pair, addressed
on a private /24 that exists only inside the two namespaces (no route, no address or
interface is added to the machine's own namespace, so traffic cannot leave them). The
processes a test starts in a host are tracked by PID; :meth:`Hosts.close` kills them (and
anything else still inside the namespaces) and deletes the namespaces, also after a failure.
Every wait here has a deadline.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.harness import ROOT

SUBNET = "10.77.0"  # a private /24, only inside the test's two namespaces


class Skip(Exception):
    """The machine cannot build namespaces here (not root, no iproute2, no CAP_NET_ADMIN)."""


def _ip(*args: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess:
    res = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=timeout)
    if check and res.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res


@dataclass
class Host:
    name: str  # "a" or "b"
    netns: str
    iface: str
    addr: str
    procs: list[subprocess.Popen] = field(default_factory=list)


class Hosts:
    """hosts["a"], hosts["b"]: two namespaces, hostA = SUBNET.1, hostB = SUBNET.2."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"  # unique per test run: runs may overlap
        self.hosts = {
            n: Host(n, f"mmh{tag}{n}", f"veth{n}", f"{SUBNET}.{i}") for i, n in ((1, "a"), (2, "b"))
        }
        self._created: list[str] = []
        self._logs: dict[int, Path] = {}

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ------------------------------------------------------------ set-up / tear-down

    def open(self) -> Hosts:
        a, b = self.hosts["a"], self.hosts["b"]
        for h in (a, b):
            try:
                res = _ip("netns", "add", h.netns, check=False)
            except (FileNotFoundError, subprocess.TimeoutExpired) as e:
                raise Skip(f"`ip netns add` is not available here ({e})") from None
            if res.returncode != 0:
                raise Skip(
                    f"`ip netns add` is refused here (needs root / CAP_SYS_ADMIN): {res.stderr.strip()}"
                )
            self._created.append(h.netns)
        # the pair is created directly inside the namespaces: it never exists in the machine's own
        _ip(
            "link",
            "add",
            a.iface,
            "netns",
            a.netns,
            "type",
            "veth",
            "peer",
            "name",
            b.iface,
            "netns",
            b.netns,
        )
        for h in (a, b):
            _ip("-n", h.netns, "addr", "add", f"{h.addr}/24", "dev", h.iface)
            _ip("-n", h.netns, "link", "set", "lo", "up")
            _ip("-n", h.netns, "link", "set", h.iface, "up")
        return self

    def close(self) -> None:
        """Kill every process of the test (its PIDs, then whatever else is in the namespaces),
        then delete the namespaces (which removes the veth pair). Safe to call twice."""
        for h in self.hosts.values():
            for proc in h.procs:
                self._kill_group(proc)
        for netns in self._created:
            for pid in self._netns_pids(netns):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for h in self.hosts.values():
            for proc in h.procs:
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    pass
        for netns in self._created:
            deadline = time.time() + 20
            while self._netns_pids(netns) and time.time() < deadline:
                time.sleep(0.1)
            _ip("netns", "del", netns, check=False)
        self._created = []

    @staticmethod
    def _netns_pids(netns: str) -> list[int]:
        res = _ip("netns", "pids", netns, check=False)
        return [int(p) for p in res.stdout.split() if p.isdigit()] if res.returncode == 0 else []

    @staticmethod
    def _kill_group(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the agent and its workers
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------ processes

    def start(
        self,
        host: str,
        cmd: list[str],
        env: dict[str, str] | None = None,
        log: str | None = None,
        wrap: list[str] | None = None,
    ) -> subprocess.Popen:
        """Run ``cmd`` inside ``host``'s namespace (cwd: the repository), output to a log file.
        ``wrap`` goes between ``ip netns exec NS`` and ``cmd`` (e.g. ``unshare -m ...``)."""
        h = self.hosts[host]
        full_env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "OMP_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": h.iface,
            **(env or {}),
        }
        for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK"):
            if key not in (env or {}):
                full_env.pop(key, None)
        path = self.workdir / (log or f"{host}-{len(h.procs)}.log")
        with path.open("w") as out:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", h.netns, *(wrap or []), *cmd],
                env=full_env,
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        h.procs.append(proc)
        self._logs[proc.pid] = path
        return proc

    def log(self, proc: subprocess.Popen) -> str:
        return self._logs[proc.pid].read_text(errors="replace")

    def torchrun(
        self,
        host: str,
        port: int,
        run_id: str,
        argv: list[str],
        max_restarts: int = 0,
        env: dict[str, str] | None = None,
        log: str | None = None,
        wrap: list[str] | None = None,
    ) -> subprocess.Popen:
        """One torchrun agent on ``host`` (one rank), c10d rendezvous hosted by host a, under
        ``python -m mmalign.dist.supervise`` as the README launches it (the returned process is the
        supervisor; the agent is its child)."""
        h, a = self.hosts[host], self.hosts["a"]
        cmd = [
            sys.executable,
            "-m",
            "mmalign.dist.supervise",
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"{a.addr}:{port}",
            "--rdzv-id",
            run_id,
            # both namespaces share one hostname: say which agent owns the store
            "--rdzv-conf",
            f"is_host={'true' if host == 'a' else 'false'},join_timeout=120",
            "--local-addr",
            h.addr,
            "--max-restarts",
            str(max_restarts),
            "--monitor-interval",
            "0.5",
            "-m",
            "mmalign.cli",
            *argv,
        ]
        return self.start(host, cmd, env=env, log=log, wrap=wrap)

    def pids(self, host: str) -> list[int]:
        """Every process inside ``host``'s namespace."""
        return self._netns_pids(self.hosts[host].netns)

    def kill_host(self, host: str) -> None:
        """Every process in ``host``'s namespace, SIGKILL by PID (a host that vanished)."""
        for pid in self._netns_pids(self.hosts[host].netns):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def link(self, host: str, up: bool) -> None:
        h = self.hosts[host]
        _ip("-n", h.netns, "link", "set", h.iface, "up" if up else "down")

    def children(self, pid: int) -> list[int]:
        try:
            text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]

    def descendants(self, pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            kids = self.children(todo.pop())
            out += kids
            todo += kids
        return out

    def worker_of(self, agent: subprocess.Popen, deadline: float) -> int:
        """The PID of a (supervised) agent's first worker process, waiting until it exists."""
        while time.time() < deadline:
            for pid in self.descendants(agent.pid):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                except OSError:
                    continue
                # the worker runs mmalign.cli itself; the agent only names it in its own line
                if b"mmalign.cli" in argv and b"torch.distributed.run" not in argv:
                    return pid
            if agent.poll() is not None:
                raise AssertionError(
                    f"the agent exited ({agent.returncode}) before starting a worker:\n"
                    + self.log(agent)[-3000:]
                )
            time.sleep(0.05)
        raise AssertionError("no worker appeared in time")


def wait_all(procs: list[subprocess.Popen], timeout: float) -> list[int | None]:
    """Wait for every process until one shared deadline; None for one still running."""
    deadline = time.time() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.time())))
        except subprocess.TimeoutExpired:
            codes.append(None)
    return codes


def wait_for(predicate, timeout: float, interval: float = 0.02, what: str = "a condition") -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
