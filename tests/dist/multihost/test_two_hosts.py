"""Two hosts on one machine (network namespaces + a veth pair), one rank per host.

1. torchrun on two hosts ends bitwise equal to ``mmalign train --nproc 2`` on one;
2. a worker killed with a restart budget: re-rendezvous, resume from latest, bitwise equal,
   every step logged once;
3. a host lost without a restart budget: the survivor exits with one line within
   ``dist.timeout_s`` (``slow``: the survivor of case 4 sees the same, a link that is gone);
4. a partition that outlasts the jobs: each host's whole job (supervisor, torchrun agent,
   worker) ends within about 2 x ``dist.timeout_s``, also the host without the rendezvous
   store, whose agent alone would retry the store for ever; once the link is back,
   ``--resume latest`` completes, bitwise equal;
5. SLURM without torchrun: the rendezvous address comes from the node list;
6. a node-local output directory: a one-line start-up error on every rank;
7. (``slow``) 2 hosts and 1 process train the same model on the same samples (issue 30).

Every agent runs under ``python -m mmalign.dist.supervise``, as the README launches it. Every run is
the micro preset (ZeRO-2, gradient caching) for 12 steps; every wait is bounded. The first test
needs no namespaces: it checks the traceback check itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time

import pytest

from tests.dist.multihost.conftest import RUN_LIMIT_S
from tests.dist.multihost.hosts import wait_all, wait_for
from tests.dist.multihost.runs import assert_same_run
from tests.dist.multihost.tracebacks import PACKAGE_DIR, own_frames
from tests.harness import ROOT

pytestmark = [pytest.mark.multihost, pytest.mark.integration]

PORT = 29400  # the c10d rendezvous, on hostA's veth address (exists only inside the namespaces)
SHORT_TIMEOUT_S = 14  # dist.timeout_s of the loss / partition cases: above the ranks' start-up skew here


needs_unshare = pytest.mark.skipif(
    shutil.which("unshare") is None or shutil.which("mount") is None,
    reason="needs util-linux's unshare and mount (private mount namespaces)",
)


def _pair(hosts, argv, run_id, port=PORT, max_restarts=0, wrap_b=None):
    a = hosts.torchrun("a", port, run_id, argv, max_restarts=max_restarts, log=f"{run_id}-a.log")
    b = hosts.torchrun("b", port, run_id, argv, max_restarts=max_restarts, log=f"{run_id}-b.log", wrap=wrap_b)
    return a, b


def _logs(hosts, procs) -> str:
    return "\n".join(f"----- {p.args[3]}\n{hosts.log(p)[-4000:]}" for p in procs)


def _finish(hosts, procs, limit=RUN_LIMIT_S) -> None:
    codes = wait_all(procs, limit)
    assert codes == [0] * len(procs), f"exit codes {codes}\n{_logs(hosts, procs)}"


def _first_checkpoint(out, procs) -> None:
    latest = out / "checkpoints" / "latest"
    wait_for(
        lambda: latest.is_file() or any(p.poll() is not None for p in procs),
        RUN_LIMIT_S,
        what="the first checkpoint",
    )
    assert latest.is_file(), "a host exited before the first checkpoint"


def _error_lines(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("mmalign: error:")]


def _no_mmalign_traceback(log: str) -> None:
    """torchrun prints its own ChildFailedError; no frame of ours may appear."""
    assert not own_frames(log), "a traceback from mmalign's code:\n" + log[-4000:]


def test_the_traceback_check_tells_our_frames_by_location(tmp_path):
    """A checkout named ``mmalign`` holds torch at .../mmalign/.venv/...: not one of our frames."""
    assert PACKAGE_DIR == (ROOT / "mmalign").resolve()  # the package the hosts' processes import
    torch_file = tmp_path / "mmalign" / ".venv" / "lib" / "python3.11" / "site-packages" / "torch" / "run.py"
    log = f'Traceback (most recent call last):\n  File "{torch_file}", line 7, in main\n    run()\n'
    _no_mmalign_traceback(log)
    with pytest.raises(AssertionError, match="a traceback from mmalign's code"):
        _no_mmalign_traceback(log + f'  File "{PACKAGE_DIR / "cli.py"}", line 3, in main\n')


def test_two_hosts_equal_one_host(hosts, reference, train_argv, tmp_path):
    out = tmp_path / "run"
    _finish(hosts, _pair(hosts, train_argv(out), "launch"))
    assert_same_run(out, reference)


@pytest.mark.slow
def test_two_hosts_train_what_one_process_trains(hosts, train_argv, tmp_path):
    """Issue 30 across hosts: 2 hosts x 1 rank and 1 process (both caching in chunks of 4)
    read the same global batches row by row and end with the same weights (SGD: within 1e-5
    of each tensor's norm; the 2-way gradient sum differs in its last bits only)."""
    from tests.dist.multihost.runs import sample_keys, weights
    from tests.harness import cli_main

    sgd = ["train.optimizer=sgd", "train.lr=0.05", "train.weight_decay=0.0"]
    out, alone = tmp_path / "run", tmp_path / "alone"
    _finish(hosts, _pair(hosts, train_argv(out, *sgd), "global-order"))
    res = cli_main(*train_argv(alone, *sgd))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    two = [(step, a + b) for (step, a), (_, b) in zip(sample_keys(out, 0), sample_keys(out, 1))]
    assert two == sample_keys(alone, 0) and len(two) == 12
    a, b = weights(out), weights(alone)
    for k in a:
        assert float((a[k] - b[k]).norm() / b[k].norm()) <= 1e-5, k


def test_killed_worker_restarts_and_resumes(hosts, reference, train_argv, tmp_path):
    out = tmp_path / "run"
    a, b = _pair(hosts, train_argv(out), "restart", max_restarts=1)
    worker = hosts.worker_of(b, time.time() + RUN_LIMIT_S)
    _first_checkpoint(out, (a, b))
    os.kill(worker, signal.SIGKILL)  # hostB's rank, mid-run (raises if the run had already ended)
    _finish(hosts, (a, b))
    log = hosts.log(a)
    assert "no checkpoint in" in log and "resumed from" in log, log[
        -4000:
    ]  # two attempts, the second resumed
    assert_same_run(out, reference)  # metrics.jsonl: steps 1..12, each once


@pytest.mark.slow  # hostA's view is case 4's: a link that is gone, no FIN or RST
def test_host_loss_survivor_exits_within_timeout(hosts, train_argv, tmp_path):
    out = tmp_path / "run"
    a, b = _pair(hosts, train_argv(out, f"dist.timeout_s={SHORT_TIMEOUT_S}"), "loss")
    _first_checkpoint(out, (a, b))
    hosts.link("b", up=False)  # the host vanishes: no FIN / RST reaches hostA
    hosts.kill_host("b")
    lost = time.time()
    [code] = wait_all([a], SHORT_TIMEOUT_S + 120)
    elapsed = time.time() - lost
    log = hosts.log(a)
    assert code not in (0, None), f"hostA's agent: {code}\n{log[-4000:]}"
    # within the timeout (plus the agent's monitor interval and exit), not torch's 30 minutes
    assert elapsed <= SHORT_TIMEOUT_S + 20, f"{elapsed:.0f} s\n{log[-4000:]}"
    lines = _error_lines(log)
    assert len(lines) == 1, log[-4000:]
    assert "lost contact with another rank" in lines[0] and f"dist.timeout_s={SHORT_TIMEOUT_S} s" in lines[0]
    _no_mmalign_traceback(log)


def test_a_lasting_partition_ends_each_hosts_job_then_the_run_resumes(hosts, reference, train_argv, tmp_path):
    out = tmp_path / "run"
    a, b = _pair(hosts, train_argv(out, f"dist.timeout_s={SHORT_TIMEOUT_S}"), "lasting")
    _first_checkpoint(out, (a, b))
    agents = {p: hosts.children(p.pid) for p in (a, b)}  # each supervisor's one child: the agent
    assert all(len(kids) == 1 for kids in agents.values()), agents
    hosts.link("b", up=False)  # and it stays down
    split = time.time()
    # the ranks notice within the timeout, the agents get as long again; then SIGTERM, and
    # SIGKILL 10 s later (the supervisor's default), plus start-up skew and polling
    limit = 2 * SHORT_TIMEOUT_S + 25
    codes = wait_all([a, b], limit + 60)
    elapsed = time.time() - split
    assert None not in codes and 0 not in codes, (
        f"exit codes {codes} after {elapsed:.0f} s\n{_logs(hosts, (a, b))}"
    )
    assert elapsed <= limit, f"{elapsed:.0f} s\n{_logs(hosts, (a, b))}"
    for proc in (a, b):
        log = hosts.log(proc)
        assert len(_error_lines(log)) == 1 and "lost contact" in _error_lines(log)[0], log[-4000:]
        _no_mmalign_traceback(log)
    for host in ("a", "b"):  # the agent and its worker too, not only the supervisor
        wait_for(lambda: not hosts.pids(host), 10, what=f"host {host}'s processes to end")
    assert not (out / "final").exists()

    hosts.link("b", up=True)  # the network is back: the same launch line continues the run
    a, b = _pair(hosts, train_argv(out), "resume", port=PORT + 1)
    _finish(hosts, (a, b))
    assert "resumed from" in hosts.log(a)
    assert_same_run(out, reference)


@needs_unshare
def test_slurm_without_torchrun(hosts, reference, train_argv, tmp_path):
    """srun's variables and no MASTER_ADDR: every task dials the node list's first host."""
    names = tmp_path / "hosts"  # the job's host names, seen only inside each task's mount namespace
    names.write_text(f"127.0.0.1 localhost\n{hosts['a'].addr} mmnode01\n{hosts['b'].addr} mmnode02\n")
    wrap = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount --bind {names} /etc/hosts && exec "$@"',
        "sh",
    ]
    out = tmp_path / "run"
    env = {
        "SLURM_NTASKS": "2",
        "SLURM_LOCALID": "0",
        "SLURM_JOB_NODELIST": "mmnode[01-02]",
        "SLURM_JOB_ID": "4242",
    }
    procs = [
        hosts.start(
            host,
            [sys.executable, "-m", "mmalign.cli", *train_argv(out)],
            env={**env, "SLURM_PROCID": str(rank)},
            wrap=wrap,
            log=f"slurm-{host}.log",
        )
        for rank, host in enumerate("ab")
    ]
    _finish(hosts, procs)
    assert "rendezvous at mmnode01:16242 (first host of SLURM_JOB_NODELIST)" in hosts.log(procs[0])
    assert_same_run(out, reference)


@needs_unshare
def test_node_local_output_is_refused(hosts, train_argv, tmp_path):
    """hostB sees a private tmpfs at the run path: every rank stops at start-up with one line."""
    out = tmp_path / "run"
    out.mkdir()
    wrap_b = [
        "unshare",
        "-m",
        "--propagation",
        "private",
        "sh",
        "-c",
        f'mount -t tmpfs mmalign-node-local {out} && exec "$@"',
        "sh",
    ]
    a, b = _pair(hosts, train_argv(out), "local", wrap_b=wrap_b)
    codes = wait_all([a, b], RUN_LIMIT_S)
    assert None not in codes and 0 not in codes, f"exit codes {codes}\n{_logs(hosts, (a, b))}"
    for proc in (a, b):
        lines = _error_lines(hosts.log(proc))
        assert (
            len(lines) == 1
            and "config key 'output'" in lines[0]
            and "is not shared" in lines[0]
            and "rank 1" in lines[0]
        ), hosts.log(proc)[-4000:]
        _no_mmalign_traceback(hosts.log(proc))
    assert not (out / "checkpoints").exists()
