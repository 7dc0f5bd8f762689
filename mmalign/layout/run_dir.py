"""The names inside a run directory, shared by what writes it (:mod:`mmalign.run.checkpoint`,
:mod:`mmalign.run.rundir`) and what reads a model out of it (:mod:`mmalign.models.locate`)::

    RUN/
      config.yaml                  CONFIG_FILE: the resolved config of the run
      final/                       FINAL: the trained model (save_pretrained's folder)
      final_ema/                   FINAL_EMA: its EMA weights (train.ema_decay > 0), the same kind of folder
      decontamination.json         DECONTAMINATION: data.decontaminate's start-up check (run/contamination_check)
      checkpoints/                 ROOT
        step_00000010/             a complete checkpoint (is_step_name)
          config.yaml              CONFIG_FILE again: the config that checkpoint was written with
          engine/                  ENGINE_TAG: DeepSpeed's state, every rank's shard
          ema_rank0.pt             ema_file(r): rank r's piece of the EMA weights (train.ema_decay > 0)
        latest                     LATEST: the name of the newest complete checkpoint

Names only: no reading or writing here, so both sides can import it from any layer.
"""

from __future__ import annotations

import re

CONFIG_FILE = "config.yaml"  # in the run directory and in every checkpoint
FINAL = "final"
FINAL_EMA = "final_ema"
DECONTAMINATION = "decontamination.json"
EMA_PREFIX = "ema"  # a checkpoint's per-rank EMA files: ema_rank{r}.pt
ROOT = "checkpoints"
ENGINE_TAG = "engine"
LATEST = "latest"

_STEP = re.compile(r"step_[0-9]+")


def ema_file(rank: int) -> str:
    """The name of rank ``rank``'s EMA piece in a step checkpoint."""
    return f"{EMA_PREFIX}_rank{rank}.pt"


def is_step_name(name: str) -> bool:
    """``step_N`` (a complete checkpoint's directory name; not ``.tmp``, no path parts)."""
    return _STEP.fullmatch(name) is not None


__all__ = [
    "CONFIG_FILE",
    "DECONTAMINATION",
    "EMA_PREFIX",
    "ENGINE_TAG",
    "FINAL",
    "FINAL_EMA",
    "LATEST",
    "ROOT",
    "ema_file",
    "is_step_name",
]
