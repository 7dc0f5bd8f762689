"""Atomic, resumable step checkpoints.

Layout under the run directory::

    checkpoints/
      step_00000010/           a complete checkpoint
        engine/                DeepSpeed's engine state (model, optimiser, scheduler; every rank writes its shard)
        trainer_rank0.pt       step, RNG states (tensors, ints and lists only: loaded with weights_only=True)
        loader_rank0.json      the data loader's position
        momentum.pt            rank-identical state saved once, by rank 0 (the MoCo queue: EMA weights,
                               queue contents, pointer; weights_only-loadable), when the run has one
      step_00000020.tmp/       a save in progress (never read)
      latest                   the name of the newest complete checkpoint

A save writes into ``*.tmp``, then renames the directory, then rewrites
``latest`` through a rename of its own, then prunes to the newest K.  A kill at
any moment therefore leaves ``latest`` naming a complete checkpoint (or no
``latest`` at all before the first save).  DeepSpeed's engine state is pickled
and is read only when resuming a run from its own directory.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from mmalign import distributed as mdist
from mmalign.config import ConfigError

ROOT = "checkpoints"
ENGINE_TAG = "engine"


def root(out: str | Path) -> Path:
    return Path(out) / ROOT


def is_step_name(name: str) -> bool:
    """``step_N`` (a complete checkpoint's directory name; not ``.tmp``, no path parts)."""
    return re.fullmatch(r"step_[0-9]+", name) is not None


def rng_state() -> dict:
    """Every generator the loop consumes, as weights_only-loadable values."""
    np_state = np.random.get_state()
    py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "python": list(py[1]),
        "python_version": py[0],
        "python_gauss": [] if py[2] is None else [py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    gauss = state["python_gauss"][0] if state["python_gauss"] else None
    random.setstate((state["python_version"], tuple(int(v) for v in state["python"]), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def clean_partial(out: str | Path) -> None:
    """Remove saves that a kill interrupted (rank 0)."""
    if mdist.get_rank() != 0:
        return
    for tmp in root(out).glob("*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def save(engine, out: str | Path, step: int, trainer_state: dict, loader_state: dict, keep: int,
         shared: dict[str, dict] | None = None) -> Path:
    """Collective: every rank calls it; returns the final directory.

    ``shared`` maps a name to state that is identical on every rank (e.g. the
    momentum queue): rank 0 alone writes it, as ``<name>.pt``, so it is stored once.
    """
    rank = mdist.get_rank()
    base = root(out)
    name = f"step_{step:08d}"
    tmp, final = base / f"{name}.tmp", base / name
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    mdist.barrier()
    engine.save_checkpoint(tmp, ENGINE_TAG)
    torch.save({"step": step, **trainer_state}, tmp / f"trainer_rank{rank}.pt")
    (tmp / f"loader_rank{rank}.json").write_text(json.dumps(loader_state))
    if rank == 0:
        for key, state in (shared or {}).items():
            torch.save(state, tmp / f"{key}.pt")
    mdist.barrier()
    if rank == 0:
        if final.exists():  # re-saving a step (after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer = base / "latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, base / "latest")
        complete = sorted(p for p in base.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp"))
        for old in complete[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    mdist.barrier()
    return final


def resolve(out: str | Path, resume: str | None) -> Path | None:
    """``latest`` -> the newest complete checkpoint of ``out`` (None if there is none yet);
    a path -> that checkpoint directory, which must exist."""
    if not resume:
        return None
    if resume == "latest":
        pointer = root(out) / "latest"
        if not pointer.is_file():
            return None
        name = pointer.read_text().strip()
        # only a sibling step_N: the pointer is a file anyone may edit, never a path to follow
        if not is_step_name(name):
            raise ConfigError(f"--resume latest: {pointer} names {name[:80]!r}, not a step_N checkpoint of this run")
        path = root(out) / name
    else:
        path = Path(resume)
        if not is_step_name(path.name) or path.resolve().parent.name != ROOT:
            raise ConfigError(f"--resume: {path} is not a checkpoint directory RUN/{ROOT}/step_N")
    if not (path / ENGINE_TAG).is_dir():
        raise ConfigError(f"--resume: {path} is not a complete mmalign checkpoint")
    return path


def load(engine, path: Path) -> tuple[dict, dict]:
    """Restore the engine; return this rank's (trainer state, loader state)."""
    rank = mdist.get_rank()
    engine.load_checkpoint(path, ENGINE_TAG)
    trainer_file = path / f"trainer_rank{rank}.pt"
    if not trainer_file.is_file():
        raise ConfigError(f"--resume: {path} was written by fewer ranks (no {trainer_file.name})")
    trainer = torch.load(trainer_file, map_location="cpu", weights_only=True)
    loader_file = path / f"loader_rank{rank}.json"
    loader = json.loads(loader_file.read_text()) if loader_file.is_file() else {}
    return trainer, loader


def load_shared(path: Path, name: str) -> dict | None:
    """The rank-identical state ``name`` saved by :func:`save` (every rank reads rank 0's
    file); None if the checkpoint has none."""
    file = path / f"{name}.pt"
    return torch.load(file, map_location="cpu", weights_only=True) if file.is_file() else None
