"""Atomic, resumable step checkpoints.

Layout under the run directory::

    checkpoints/
      step_00000010/           a complete checkpoint
        engine/                DeepSpeed's engine state (model, optimiser, scheduler; every rank writes its shard)
        trainer_rank0.pt       step, RNG states (tensors, ints and lists only: loaded with weights_only=True)
        loader_rank0.json      the data loader's position
        ema_rank0.pt           this rank's piece of the EMA weights (train.ema_decay > 0; mmalign.run.ema)
        momentum.pt            rank-identical state saved once, by rank 0 (the MoCo queue: EMA weights,
                               queue contents, pointer; weights_only-loadable), when the run has one
      step_00000020.tmp/       a save in progress (never read)
      latest                   the name of the newest complete checkpoint

A save writes into ``*.tmp``, then renames the directory, then rewrites
``latest`` through a rename of its own, then prunes to the newest K.  A kill at
any moment therefore leaves ``latest`` naming a complete checkpoint (or no
``latest`` at all before the first save).  A save that cannot be written (a full
disk on any rank) is removed and fails on every rank alike, ``latest`` unchanged, in one
line that names the free space (:mod:`mmalign.run.diskspace`).  DeepSpeed's engine state is pickled
and is read only when resuming a run from its own directory.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

from mmalign.config import ConfigError
from mmalign.dist import distributed as mdist
from mmalign.errors import first_line
from mmalign.layout.run_dir import ENGINE_TAG, ROOT, is_step_name  # noqa: F401 (re-exported)
from mmalign.run import diskspace, reshard, rundir
from mmalign.run.rng_state import rng_state, set_rng_state  # noqa: F401 (re-exported: the loop saves them)

# torch-free, in rundir: the launcher checks a resume before it starts any rank
from mmalign.run.rundir import candidates, empty_pointer, step_of  # noqa: F401 (re-exported)


def root(out: str | Path) -> Path:
    return Path(out) / ROOT


def clean_partial(out: str | Path) -> None:
    """Remove saves that a kill interrupted (rank 0)."""
    if mdist.get_rank() != 0:
        return
    for tmp in root(out).glob("*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    """Flush a file's or a directory's entries to disk (a rename is only durable once the
    directory holding it is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(top: Path) -> None:
    for path in sorted(top.rglob("*"), reverse=True):  # files before the directories holding them
        _fsync(path)
    _fsync(top)


def _prune(base: Path, written: Path, keep: int) -> None:
    """Keep the checkpoint just written and the ``keep - 1`` newest *older* ones. Newer ones
    can only be left from a timeline this run no longer continues (a resume from an
    earlier step), so they go: pruning by name alone would have deleted the new one."""
    if keep <= 0:
        return
    step = step_of(written)
    older = sorted(
        (p for p in base.glob("step_*") if p.is_dir() and is_step_name(p.name) and p != written), key=step_of
    )
    stale = [p for p in older if step_of(p) > step]
    kept_older = [p for p in older if step_of(p) < step][-(keep - 1) :] if keep > 1 else []
    for old in older:
        if old in stale or old not in kept_older:
            shutil.rmtree(old, ignore_errors=True)


def save(
    engine,
    out: str | Path,
    step: int,
    trainer_state: dict,
    loader_state: dict,
    keep: int,
    shared: dict[str, dict] | None = None,
    config=None,
    per_rank: dict[str, dict] | None = None,
) -> Path:
    """Collective: every rank calls it; returns the final directory.

    ``shared`` maps a name to state that is identical on every rank (e.g. the
    momentum queue): rank 0 alone writes it, as ``<name>.pt``, so it is stored once.
    ``per_rank`` maps a name to this rank's own state (the EMA's pieces): every rank writes
    it, as ``<name>_rank<r>.pt``.
    ``config`` (the resolved :class:`~mmalign.config.Config`) is stored beside the state,
    so a resume can tell whether it continues the same run.  Every file and directory
    is fsynced before ``latest`` names the checkpoint.

    A write that fails on any rank (a full disk) fails the save on every rank alike, with
    no rank left in a barrier: the partial save is removed, ``latest`` keeps naming the
    previous checkpoint, and :class:`~mmalign.run.diskspace.CheckpointWriteError` says so in
    one line (:mod:`mmalign.run.diskspace`).
    """
    rank = mdist.get_rank()
    base = root(out)
    name = f"step_{step:08d}"
    tmp, final = base / f"{name}.tmp", base / name
    failures: list[BaseException] = []
    if rank == 0:
        diskspace.space_watch.check(base, _last_saved(base), step)
        try:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except OSError as e:
            failures.append(e)
    _fail_together(failures, base, tmp, final)  # a collective: the barrier before every rank writes
    with diskspace.deferred_engine_writes(engine, failures):
        try:
            engine.save_checkpoint(tmp, ENGINE_TAG)
            if not failures:
                _write_rank_files(tmp, rank, step, trainer_state, loader_state, shared, config, per_rank)
        except Exception as e:  # noqa: BLE001 - agreed with the other ranks below, then raised
            failures.append(e)
    _fail_together(failures, base, tmp, final)
    if rank == 0:
        try:
            _publish(base, tmp, final, name)
        except OSError as e:
            failures.append(e)
    _fail_together(failures, base, tmp, final)  # every rank waits for latest to flip
    if rank == 0:
        _prune(base, final, keep)
    mdist.barrier()
    return final


def _last_saved(base: Path) -> Path | None:
    """The checkpoint ``latest`` names, if it names one that exists (a pointer edited by hand
    is resume's business, not the save's)."""
    try:
        found = resolve(base.parent, "latest")
    except ConfigError:
        return None
    return found if found is not None and found.is_dir() else None


def _write_rank_files(
    tmp: Path,
    rank: int,
    step: int,
    trainer_state: dict,
    loader_state: dict,
    shared: dict[str, dict] | None,
    config,
    per_rank: dict[str, dict] | None = None,
) -> None:
    diskspace.save_torch({"step": step, **trainer_state}, tmp / f"trainer_rank{rank}.pt")
    for key, state in (per_rank or {}).items():
        diskspace.save_torch(state, tmp / f"{key}_rank{rank}.pt")
    (tmp / f"loader_rank{rank}.json").write_text(json.dumps(loader_state))
    if rank == 0:
        for key, state in (shared or {}).items():
            diskspace.save_torch(state, tmp / f"{key}.pt")
        if config is not None:
            rundir.save_into(config, tmp)


def _publish(base: Path, tmp: Path, final: Path, name: str) -> None:
    """Rank 0, once every rank's files are in ``tmp``: rename it to ``final``, then flip ``latest``."""
    _fsync_tree(tmp)  # every rank's files are complete here (after the agreement)
    if final.exists():  # re-saving a step (after a resume): replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(base)
    pointer = base / "latest.tmp"
    pointer.write_text(name)
    _fsync(pointer)
    os.replace(pointer, base / "latest")
    _fsync(base)


def _fail_together(failures: list[BaseException], base: Path, tmp: Path, final: Path) -> None:
    """Collective: when any rank's step of the save failed, every rank raises (no rank goes on
    to a barrier the others never reach). Rank 0 first removes what the save left (the
    partial ``tmp``; a ``final`` that ``latest`` does not name), so the space comes back."""
    mine = failures[0] if failures else None
    if mine is None:
        reason = None
    else:
        why = diskspace.write_reason(mine) or f"{type(mine).__name__}: {first_line(mine)[:120]}"
        reason = why if mdist.get_world_size() == 1 else f"{why} on rank {mdist.get_rank()}"
    reason = _agree(reason)  # the barrier of this phase, too
    if reason is None:
        return
    if mdist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        (base / "latest.tmp").unlink(missing_ok=True)
        latest = base / "latest"
        named = latest.read_text().strip() if latest.is_file() else None
        if final.is_dir() and named != final.name:
            shutil.rmtree(final, ignore_errors=True)
    mdist.barrier()  # the space is back before any rank measures it
    if mine is not None and diskspace.write_reason(mine) is None:
        raise mine  # not a failed write (a bug): as it is, on the rank where it happened
    previous = _last_saved(base)
    free = diskspace.free_bytes(base)
    raise diskspace.CheckpointWriteError(
        f"cannot write checkpoint {final}: {reason}; "
        f"{'?' if free is None else diskspace.size_text(free)} free on that filesystem"
        + (
            f" (the last checkpoint took {diskspace.size_text(diskspace.tree_bytes(previous))})"
            if previous
            else ""
        )
        + "; the partial save was removed, "
        + (
            f"{base / 'latest'} still names {previous.name}: free some space, then continue with --resume latest"
            if previous
            else "no checkpoint of this run is saved yet: free some space, then start again"
        )
    ) from None


def resolve(out: str | Path, resume: str | None) -> Path | None:
    """``latest`` -> the checkpoint ``latest`` names (None if there is none yet); a path ->
    that checkpoint directory, which must be ``RUN/checkpoints/step_N``."""
    found = candidates(out, resume)
    return found[0] if found else None


_OTHER_RANK = re.compile(r"(?:zero_pp_rank_|trainer_rank|loader_rank|ema_rank)(\d+)")


def damaged(path: Path, rank: int = 0) -> str | None:
    """Why this rank cannot load ``path`` (a missing, empty, truncated or corrupt file), or
    None.  Checks the files this rank reads: the shared ones and its own shards, each
    ``.pt`` as a whole zip archive with its CRCs (a cut file has no central directory)."""
    import zipfile

    engine = path / ENGINE_TAG
    if not path.is_dir():
        return "it is gone"
    if not engine.is_dir() or not any(engine.glob("*.pt")):
        return f"{ENGINE_TAG}/ holds no state"
    if not (path / "trainer_rank0.pt").is_file():
        return "no trainer_rank0.pt"
    for r in sorted({0, rank}):  # a rank that wrote its trainer state wrote its data position beside it
        if (path / f"trainer_rank{r}.pt").is_file() and not (path / f"loader_rank{r}.json").is_file():
            return f"no loader_rank{r}.json"
    for file in sorted([*engine.glob("*.pt"), *path.glob("*.pt"), *path.glob("loader_rank*.json")]):
        owner = _OTHER_RANK.search(file.name)
        if owner is not None and int(owner.group(1)) != rank:
            continue  # another rank's shard: that rank checks it
        if file.stat().st_size == 0:
            return f"{file.name} is empty"
        if file.suffix == ".json":
            try:
                state = json.loads(file.read_text())
            except (ValueError, UnicodeDecodeError):
                return f"{file.name} is not valid JSON"
            if not isinstance(state, dict) or "version" not in state:  # valid JSON, but not a data position
                return f"{file.name} is not a data loader state"
            continue
        try:
            with zipfile.ZipFile(file) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError):
            return f"{file.name} is truncated or not a torch file"
        if bad is not None:
            return f"{file.name} is corrupt ({bad})"
    return None


def _agree(reason: str | None) -> str | None:
    """Collective: every rank's verdict; a checkpoint one rank cannot load is skipped by all."""
    if mdist.get_world_size() == 1:
        return reason
    reasons = [r for r in mdist.all_gather_object(reason) if r is not None]
    return reasons[0] if reasons else None


def resume(
    engine, out: str | Path, resume: str | None, cfg=None, say=print
) -> tuple[Path, dict, dict] | None:
    """Collective: load the newest loadable checkpoint; (path, trainer state, loader state),
    or None when there is nothing to resume yet.

    A damaged newest checkpoint (a kill or a full disk during a save that still renamed,
    a truncated engine file, a 0-byte trainer file, an empty ``engine/``) is skipped with
    one line, and the next older complete one is tried.  A config that changes the run
    (:func:`mmalign.run.rundir.check_resume`) is an error, not a reason to fall back.
    """
    paths = candidates(out, resume)
    rank = mdist.get_rank()
    if rank == 0 and paths and empty_pointer(out, resume):
        say(
            f"mmalign: {root(out) / 'latest'} names no checkpoint (empty or unreadable); trying the newest, "
            f"{paths[0].name}"
        )
    for i, path in enumerate(paths):
        reason = _agree(damaged(path, rank))
        if reason is None:
            if cfg is not None:
                rundir.check_resume(cfg, path, step_of(path))
            try:
                trainer, loader = load(engine, path)
                problem = None
            except ConfigError:
                raise
            except Exception as e:  # DeepSpeed's loader on a file that passed the archive check
                text = str(e).strip()
                problem = f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"
            reason = _agree(problem)
            if reason is None:
                return path, trainer, loader
        nxt = paths[i + 1].name if i + 1 < len(paths) else None
        if rank == 0:
            say(
                f"mmalign: checkpoint {path.name} cannot be loaded ({reason}); "
                + (f"falling back to {nxt}" if nxt else "no older checkpoint is left")
            )
    if paths:
        raise ConfigError(
            f"--resume: no loadable checkpoint in {paths[0].parent} (tried {len(paths)}, newest "
            f"{paths[0].name})"
        )
    return None


def load(engine, path: Path) -> tuple[dict, dict]:
    """Restore the engine; return this rank's (trainer state, loader state).

    A checkpoint written by another number of ranks gives rank 0's trainer state and the
    loader states of all its ranks (:func:`mmalign.run.reshard.trainer_and_loader`)."""
    rank = mdist.get_rank()
    engine.load_checkpoint(path, ENGINE_TAG)
    saved_world = len(list(path.glob("trainer_rank*.pt")))
    if saved_world != mdist.get_world_size():
        return reshard.trainer_and_loader(path, saved_world)
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
