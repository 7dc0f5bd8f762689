"""Local multi-process launch: ``mmalign train --nproc N``.

Re-runs the same command under torchrun (``torch.distributed.run``) with N local
processes on a private loopback port; each process then initialises its group from
the RANK / WORLD_SIZE / MASTER_* variables torchrun sets (gloo on CPU, nccl on
GPU).  Multi-node runs call torchrun, the ``deepspeed`` launcher or ``srun``
directly with the same arguments (see the README).
"""

from __future__ import annotations

import os
import subprocess
import sys

from mmalign.distributed import free_port


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
        sys.executable, "-m", "torch.distributed.run",
        "--nproc_per_node", str(nproc), "--nnodes", "1",
        "--master_addr", "127.0.0.1", "--master_port", free_port(),
        "-m", "mmalign.cli", *strip_nproc(argv),
    ]
    env = dict(os.environ)
    # Share the 2..N cores between ranks instead of oversubscribing them.
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return subprocess.call(cmd, env=env)
