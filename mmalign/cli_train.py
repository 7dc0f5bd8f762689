"""``mmalign train`` before any rank starts: the config loaded and validated once at the world
size the run will have, the run directory checked, then the run in this process or its local
ranks launched (``--nproc``). A torchrun restart continues the run instead of redoing the line.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from mmalign.errors import UserError

if TYPE_CHECKING:
    from mmalign.config import Config


def _load(args, world_size: int = 1) -> Config:
    from mmalign.config import load_config

    overrides = list(args.set)
    if args.output:
        overrides.append(f"output={args.output}")
    return load_config(args.config, overrides, world_size)


def _world_size(nproc: int, env) -> int:
    """The ranks this ``mmalign train`` trains on, known before torch is imported: ``--nproc``'s
    own, else the launcher's (the variables mmalign.dist.distributed.env_dist_info reads)."""
    if nproc > 1 and "RANK" not in env:
        return nproc
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_NTASKS"])
    return 1


def cmd_train(args) -> int:
    # resolved and validated once, at the run's world size, before spawning anything (and before importing torch)
    cfg = _load(args, _world_size(args.nproc, os.environ))
    _check_local_shards(cfg)
    if _launch_rank(os.environ) == 0:  # the seconds before "building model" say what they are
        print("mmalign: config checked; importing torch and open_clip to check the model ...", flush=True)
    from mmalign.models import check_buildable

    meta_model = check_buildable(cfg.model)
    from mmalign.objective.distill import check_teacher

    check_teacher(cfg)  # loss.distill.teacher: a model that exists, or shards that carry its embeddings
    from mmalign.dist import cluster

    cluster.check_nproc(args.nproc, os.environ)  # not N local ranks per rank of a multi-node job
    from mmalign.run.rundir import check_writable

    check_writable(Path(cfg.output))  # a read-only mount: this line, not the lock file's
    # one launch per run directory, before it is checked: the --nproc launcher holds it (its ranks
    # inherit it), or rank 0 of an outside launcher (the other ranks write what rank 0's run directs)
    with output_lock(Path(cfg.output), "mmalign train", take=_launch_rank(os.environ) == 0):
        return _checked_run(args, cfg, meta_model)


def _check_local_shards(cfg) -> None:
    """A missing local shard or a table given as shards, in a second rather than after the
    seconds of importing torch (the remote shards are probed later, with the rest)."""
    from mmalign.data.shards import check_local, train_shard_lists

    for urls, what in train_shard_lists(cfg.data):
        check_local(urls, what)


def _checked_run(args, cfg, meta_model) -> int:
    from mmalign.run.rundir import check_fresh_start

    typed_resume = args.resume
    restart = _continue_on_restart(args, Path(cfg.output))
    try:  # before spawning ranks or DeepSpeed; with cfg: a finished run is not restarted by --resume
        check_fresh_start(Path(cfg.output), args.resume, args.overwrite, cfg)
    except UserError as e:
        if not restart or typed_resume == "latest":  # the hint would repeat what the line already says
            raise
        raise type(e)(
            f"{e} (this is torchrun's restart {restart}: put --resume latest on the launch line, "
            f"so that a restart continues the run)"
        ) from None
    from mmalign.run.rundir import check_newest

    # a key that cannot change on resume: one line here, not one per rank and torchrun's report
    check_newest(Path(cfg.output), args.resume, cfg)
    from mmalign.run import contamination_check

    with contamination_check.handed_over(_decontamination(args, cfg)):
        return _launch_or_train(args, cfg, meta_model)


def _decontamination(args, cfg) -> dict | None:
    """data.decontaminate's check, once per launch: here in the launcher (or rank 0 of an outside
    launcher); a rank this launcher started gets its result (contamination_check.ENV)."""
    from mmalign.run import contamination_check

    handed = contamination_check.handed(cfg)
    if handed is not None or _launch_rank(os.environ) != 0:
        return handed
    return contamination_check.at_start(cfg, Path(cfg.output), args.resume)


def _launch_or_train(args, cfg, meta_model) -> int:
    if args.nproc > 1 and "RANK" not in os.environ:
        from mmalign.dist.launch import launch_local

        _check_batchnorm(cfg, meta_model, args.nproc)
        from mmalign.run.train import plan_evaluations, resolve_suite

        # eval.suite, eval.during and their data, once here rather than once per rank
        plan_evaluations(cfg, resolve_suite(cfg))
        return launch_local(args.nproc, args.argv)
    from mmalign.dist import distributed as mdist
    from mmalign.run.train import train

    out = train(cfg, resume=args.resume, overwrite=args.overwrite, model_checked=True)  # cmd_train checked it
    if mdist.get_rank() == 0:
        written = "final/ weights, metrics.jsonl" + (", eval.json" if (out / "eval.json").exists() else "")
        print(f"run written to {out} ({written})")
    from mmalign.layout import ds_adapter

    ds_adapter.release_groups()  # DeepSpeed's groups go with the default one (a later run in this process)
    mdist.shutdown()
    return 0


def _launch_rank(env) -> int:
    """This process's rank under an outside launcher (torchrun, SLURM), read as :func:`_world_size`
    reads the world (and mmalign.dist.distributed.env_dist_info the rank); 0 otherwise."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["RANK"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_PROCID"])
    return 0


@contextlib.contextmanager
def output_lock(directory: Path, what: str, take: bool = True):
    """``directory``'s lock (:mod:`mmalign.dirlock`) for the block (``take`` False: none): a
    second launch on it is one line naming this one, exit 2 (two launches of one run interleaved
    metrics.jsonl and both wrote final/). A folder this launch made that holds nothing but the
    lock file afterwards (a launch refused by a later check) is removed: a failed launch leaves
    nothing behind."""
    if not take:
        yield None
        return
    from mmalign import dirlock

    directory = Path(directory)
    made = next(
        (d for d in reversed((directory, *directory.parents)) if not d.exists()), None
    )  # outermost new
    lock = dirlock.hold(directory, what)
    try:
        yield lock
    finally:
        lock.release()
        if made is not None:
            _unmake(directory, made, dirlock.LOCK_FILE)


def _unmake(directory: Path, made: Path, lock_file: str) -> None:
    try:
        if [p.name for p in directory.iterdir()] != [lock_file]:
            return  # the run wrote something: it stays
        (directory / lock_file).unlink()
        for folder in (directory, *directory.parents):
            folder.rmdir()  # an OSError (not empty) ends it
            if folder == made:
                return
    except OSError:
        pass


def _continue_on_restart(args, out: Path) -> int:
    """Under a torchrun restart (TORCHELASTIC_RESTART_COUNT >= 1) the launch line runs again
    as it was typed.  ``--overwrite`` would delete the checkpoints this job wrote, and an older
    ``--resume PATH`` would, at its first save, prune every newer checkpoint and move
    ``latest`` back: a restart instead continues from the run's ``latest`` (with nothing saved
    yet, from step 0).  Returns the restart count (0: the first attempt)."""
    from mmalign.dist import cluster

    restart = cluster.restart_count(os.environ)
    if not restart or not (args.overwrite or args.resume not in (None, "latest")):
        return restart  # the first attempt, or a line that already continues the run
    has_latest = (out / "checkpoints" / "latest").is_file()
    given = " ".join(
        flag
        for flag, on in (
            ("--overwrite", args.overwrite),
            (f"--resume {args.resume}", args.resume not in (None, "latest")),
        )
        if on
    )
    if args.overwrite or has_latest:
        args.overwrite, args.resume = False, "latest"
    if os.environ.get("RANK", "0") == "0":
        print(
            f"mmalign: torchrun restart {restart}: continuing the run from its latest checkpoint, if any "
            f"(`{given}` is not applied again)"
            if args.resume == "latest"
            else f"mmalign: torchrun restart {restart}: no checkpoint in {out}; `{given}` applies as given",
            flush=True,
        )
    return restart


def _check_batchnorm(cfg, model, world_size: int) -> None:
    """The engine's BatchNorm gate, once before spawning ranks (each would print it), on the
    meta-device model of :func:`~mmalign.models.check_buildable`."""
    from mmalign.models.batchnorm import check_batchnorm
    from mmalign.run.gradcache import chunk_sizes

    local = cfg.train.global_batch_size // world_size
    chunk = cfg.train.grad_cache_chunk_size
    # auto: chosen per run from a memory measurement (mmalign.run.memory_plan); the engine checks again with it
    chunks = len(chunk_sizes(local, chunk)) if isinstance(chunk, int) else 1
    check_batchnorm(model, cfg.model.batchnorm, chunks=chunks, world_size=world_size)
