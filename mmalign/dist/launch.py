"""Local multi-process launch: ``mmalign train --nproc N``.

Re-runs the same command under torchrun (``torch.distributed.run``) with N local
processes on a private loopback port; each process then initialises its group from
the RANK / WORLD_SIZE / MASTER_* variables torchrun sets (gloo on CPU, nccl on
GPU).  Multi-node runs call torchrun (under ``python -m mmalign.dist.supervise``, which ends an
agent left retrying an unreachable rendezvous store after a split network), the ``deepspeed``
launcher or ``srun`` with the same arguments (see docs/training.md).  Here the store is local, so
no agent can lose it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

from mmalign.dist.distributed import free_port


def strip_nproc(argv: list[str]) -> list[str]:
    """The command line without ``--nproc N`` / ``--nproc=N``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--nproc":
            skip = True
            continue
        if arg.startswith("--nproc="):
            continue
        out.append(arg)
    return out


def launch_local(nproc: int, argv: list[str]) -> int:
    """Run ``mmalign <argv>`` as ``nproc`` local ranks; returns the worst exit code."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        str(nproc),
        "--nnodes",
        "1",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        free_port(),
        "-m",
        "mmalign.cli",
        *strip_nproc(argv),
    ]
    env = dict(os.environ)
    # Share the 2..N cores between ranks instead of oversubscribing them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    proc = subprocess.Popen(cmd, env=env)
    # SIGTERM to this process (a scheduler, `kill`) goes on to torchrun, which stops its ranks;
    # otherwise this process would vanish and leave the whole run behind it.
    forward = threading.current_thread() is threading.main_thread()
    previous = (
        signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum)) if forward else None
    )
    try:
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:  # Ctrl-C reached torchrun too; `kill -INT` of this process only did not
                proc.send_signal(signal.SIGINT)
    finally:
        if forward:
            signal.signal(signal.SIGTERM, previous)
