"""Resuming a training run: everything the loop needs restored before its next step.

:func:`resume_run` loads the newest loadable checkpoint (:func:`mmalign.run.checkpoint.resume`:
model, optimiser, schedule through DeepSpeed), adapts it to another world size when the
run restarts on a different number of ranks (:func:`mmalign.run.reshard.adopt`), then restores
this rank's random generators, the data loader's position, the momentum queue and the EMA
weights (:meth:`mmalign.run.ema.Ema.restore`, re-cut for another world size), and says where
the run continues.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from mmalign.config import Config, ConfigError
from mmalign.dist import distributed as mdist
from mmalign.errors import first_line
from mmalign.run import checkpoint, reshard
from mmalign.run.runlog import say

# the run's lines: train.log names them mmalign.run.train, whichever module of the run writes them
log = logging.getLogger("mmalign.run.train")


@dataclass(frozen=True)
class Resumed:
    start: int  # the last step done: the loop continues at start + 1 (0 for a fresh run)
    skipped_steps: int  # non-finite steps skipped before ``start``
    checkpoint: Path | None  # the checkpoint loaded; None for a fresh run


def resume_run(engine, loader, queue, out: str | Path, resume: str | None, cfg: Config, ema=None) -> Resumed:
    """Collective: restore ``engine``, ``loader``, ``queue`` and ``ema`` (None: the run has none) from
    the checkpoint ``resume`` names (``latest`` or a ``RUN/checkpoints/step_N``) and this
    rank's RNG; a fresh start (``resume`` None, or no checkpoint yet) restores nothing."""
    rank = mdist.get_rank()
    main = rank == 0

    def warn(line: str) -> None:  # printed as it is, and in train.log
        print(line, flush=True)
        log.warning("%s", line)

    found = checkpoint.resume(engine, out, resume, cfg, say=warn)
    if found is None:
        if resume and main:
            print(f"mmalign: no checkpoint in {out} yet, starting from step 0", flush=True)
        return Resumed(0, 0, None)
    ckpt, trainer, loader_state = found
    start, skipped_steps = trainer["step"], trainer["skipped_steps"]
    # another world size: fresh per-rank RNG, the data position converted to the new slots
    trainer, loader_state, changed = reshard.adopt(trainer, loader_state, loader.spec, cfg.seed, start, rank)
    if changed and main:
        say(changed)
    checkpoint.set_rng_state(trainer["rng"])
    loader.load_state_dict(loader_state)
    if queue is not None:
        load_queue(queue, ckpt)
    if ema is not None:
        ema.restore(ckpt)
    if main:
        say(f"resumed from {ckpt} at step {start}")
    return Resumed(start, skipped_steps, ckpt)


def load_queue(queue, ckpt: Path) -> None:
    """Restore the EMA weights and the queue (rank 0's file, read by every rank); one-line errors."""
    state = checkpoint.load_shared(ckpt, "momentum")
    if state is None:
        raise ConfigError(
            f"config key 'loss.queue_size': {ckpt} holds no momentum queue (written by a run without one)"
        )
    try:
        queue.load_state_dict(state)
    except (ValueError, RuntimeError, KeyError) as e:
        raise ConfigError(
            f"config key 'loss.queue_size': the checkpoint's momentum queue does not fit: "
            f"{first_line(e) or type(e).__name__}"
        ) from None
