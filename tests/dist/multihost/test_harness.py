"""The two-host harness itself: the hosts reach each other only over their veth pair, the
machine's own namespace gains nothing, and closing kills every process and removes both
namespaces even when the processes are still running."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.dist.multihost.hosts import SUBNET, Hosts, wait_all, wait_for

pytestmark = pytest.mark.multihost

ECHO = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 29555)); s.listen(1); s.settimeout(60)
c, _ = s.accept(); c.sendall(c.recv(64).upper()); c.close()
"""
DIAL = """
import socket, sys, time
for _ in range(300):
    try:
        c = socket.create_connection((sys.argv[1], 29555), timeout=5); break
    except OSError:
        time.sleep(0.05)
c.sendall(b"hello"); print(c.recv(64).decode())
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its (re)parent to reap it."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_hosts_talk_over_the_veth_only(hosts):
    a, b = hosts["a"], hosts["b"]
    server = hosts.start("a", [sys.executable, "-c", ECHO, a.addr], log="echo.log")
    client = hosts.start("b", [sys.executable, "-c", DIAL, a.addr], log="dial.log")
    assert wait_all([server, client], 60) == [0, 0], hosts.log(server) + hosts.log(client)
    assert hosts.log(client).strip() == "HELLO"
    # the machine's own namespace has neither the addresses nor a route to them
    own = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, timeout=20).stdout
    routes = subprocess.run(["ip", "route"], capture_output=True, text=True, timeout=20).stdout
    assert f"{SUBNET}." not in own and f"{SUBNET}." not in routes
    # and each host has no default route: nothing it sends can leave the pair
    for h in (a, b):
        table = subprocess.run(
            ["ip", "-n", h.netns, "route"], capture_output=True, text=True, timeout=20
        ).stdout
        assert "default" not in table and f"{SUBNET}.0/24" in table


def test_close_kills_processes_and_removes_namespaces(netns_ok, tmp_path):
    hosts = Hosts(tmp_path).open()
    try:
        procs = [hosts.start(h, ["sleep", "600"]) for h in "ab"]
        stray = hosts.start("b", ["sh", "-c", "setsid sleep 600 & wait"])  # a process outside our group
        assert all(p.poll() is None for p in procs + [stray])
        wait_for(lambda: len(hosts.pids("b")) >= 3, 30, what="the stray sleep")
        inside = hosts.pids("a") + hosts.pids("b")
    finally:
        hosts.close()
    assert all(p.poll() is not None for p in procs + [stray])
    assert not [pid for pid in inside if _running(pid)]
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=20).stdout
    assert hosts["a"].netns not in names and hosts["b"].netns not in names
