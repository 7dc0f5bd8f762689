"""What the launcher's environment says about the job: SLURM node lists, multi-node jobs, restarts.

Pure functions of an environment mapping (no torch, no sockets), so the CLI can check them
before it imports anything heavy, and tests can feed them any environment.

* SLURM without torchrun exports ``SLURM_PROCID`` / ``SLURM_NTASKS`` / ``SLURM_LOCALID`` and
  the job's node list, but no ``MASTER_ADDR``: every task derives the same rendezvous
  address, the first host of ``SLURM_JOB_NODELIST`` (Slurm's hostlist syntax,
  ``node[01-03,07],gpu7``), and the same port from the job id.
* ``mmalign train --nproc N`` inside a job that already has many ranks would start one
  independent N-rank run per rank, all writing into one directory: refused.
* torchrun restarts the workers with ``TORCHELASTIC_RESTART_COUNT`` >= 1; a restart must
  continue the run, never clear it or resume an older checkpoint than the newest.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping

from mmalign.errors import UsageError

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = "29500"
# A port per SLURM job (the same in every task of it) below Linux's ephemeral range
# (32768-60999), so two jobs sharing a node rarely pick the same rendezvous port.
SLURM_PORT_BASE, SLURM_PORT_SPAN = 12000, 20000

NODELIST_KEYS = ("SLURM_JOB_NODELIST", "SLURM_NODELIST")
MAX_HOSTS = 1_000_000  # a bracket range beyond this is a typo, not a job

_RANGE = re.compile(r"(\d+)(?:-(\d+))?")


def _split_top(text: str) -> list[str]:
    """Split a node list at the commas outside brackets; unbalanced brackets are an error."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ValueError("nested '['")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError("'[' without ']'")
    parts.append(text[start:])
    return parts


def _numbers(body: str) -> list[str]:
    """``01-03,07`` -> ['01', '02', '03', '07'] (zero padding follows the lower bound)."""
    out = []
    for item in body.split(","):
        m = _RANGE.fullmatch(item)
        if m is None:
            raise ValueError(f"range {item!r} is not N or N-M")
        lo, hi = m.group(1), m.group(2)
        if hi is None:
            out.append(lo)
            continue
        if int(hi) < int(lo):
            raise ValueError(f"range {item!r} runs backwards")
        if int(hi) - int(lo) >= MAX_HOSTS:
            raise ValueError(f"range {item!r} is too long")
        out += [str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1)]
    return out


def _choices(expr: str) -> list[list[str]]:
    """One host expression (``rack[1-2]-n[01-04]``) -> the alternatives of each of its parts."""
    if not expr:
        raise ValueError("an empty entry")
    out = []
    for piece in re.split(r"(\[[^\]]*\])", expr):  # literal, [body], literal, ...
        if piece.startswith("["):
            out.append(_numbers(piece[1:-1]))
        elif re.fullmatch(r"[A-Za-z0-9._-]*", piece):
            out.append([piece])
        else:
            raise ValueError(f"{piece!r} is not part of a host name")
    return out


def _parse(text: str) -> list[list[list[str]]]:
    text = text.strip()
    if not text:
        raise ValueError("it is empty")
    return [_choices(expr) for expr in _split_top(text)]


def expand_nodelist(text: str) -> list[str]:
    """Every host of a Slurm node list (``node[01-03,07],gpu7`` -> node01 node02 node03 node07 gpu7),
    in Slurm's order.  ValueError (with the reason) for a list that is not Slurm's hostlist syntax."""
    return ["".join(combo) for parts in _parse(text) for combo in itertools.product(*parts)]


def first_host(text: str) -> str:
    """The first host of a Slurm node list (the whole list is checked)."""
    return "".join(alternatives[0] for alternatives in _parse(text)[0])


def slurm_master(env: Mapping[str, str]) -> tuple[str, str, str]:
    """(address, port, where the address came from) for a SLURM task.

    ``MASTER_ADDR`` / ``MASTER_PORT`` win when set; else the first host of the job's node
    list and a port derived from ``SLURM_JOB_ID``.  A node list we cannot parse is a
    one-line :class:`~mmalign.errors.UsageError` (guessing would hang every task until the store timeout)."""
    port = env.get("MASTER_PORT")
    if port is None:
        job = env.get("SLURM_JOB_ID", "")
        port = str(SLURM_PORT_BASE + int(job) % SLURM_PORT_SPAN) if job.isdigit() else DEFAULT_MASTER_PORT
    if "MASTER_ADDR" in env:
        return env["MASTER_ADDR"], port, "MASTER_ADDR"
    for key in NODELIST_KEYS:
        if key in env:
            try:
                return first_host(env[key]), port, f"first host of {key}"
            except ValueError as e:
                raise UsageError(
                    f"{key}={env[key][:120]!r} cannot be parsed as a Slurm node list ({e}); "
                    f"export MASTER_ADDR=<the first node's address> (and MASTER_PORT)"
                ) from None
    return DEFAULT_MASTER_ADDR, port, "default (no SLURM node list)"


def job_world(env: Mapping[str, str]) -> tuple[str, int] | None:
    """(variable, size) when this process is one rank of a multi-rank job: any
    ``*WORLD_SIZE`` variable above 1 (torchrun, the DeepSpeed launcher, MPI's
    ``OMPI_COMM_WORLD_SIZE``) or ``SLURM_NTASKS`` above 1; else None."""
    for key in sorted(env):
        if key == "WORLD_SIZE" or key.endswith("_WORLD_SIZE") or key == "SLURM_NTASKS":
            value = env[key].strip()
            if value.isdigit() and int(value) > 1:
                return key, int(value)
    return None


def check_nproc(nproc: int, env: Mapping[str, str]) -> None:
    """``--nproc N`` (N > 1) starts its own local ranks; inside a multi-rank job each rank would
    start N more, as independent runs writing into one directory."""
    found = job_world(env) if nproc > 1 else None
    if found is not None:
        key, size = found
        raise UsageError(
            f"--nproc {nproc} inside a job that already runs {size} ranks ({key}={size}): every "
            f"task would start its own {nproc}-rank run; drop --nproc and let the launcher "
            f"(srun / torchrun / deepspeed) start one process per rank"
        )


def restart_count(env: Mapping[str, str]) -> int:
    """How often torchrun has restarted this job's workers (0: the first attempt)."""
    value = env.get("TORCHELASTIC_RESTART_COUNT", "0").strip()
    return int(value) if value.isdigit() else 0
