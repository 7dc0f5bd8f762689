"""Where a model is: a model folder, a run directory (its ``final/``) or a step checkpoint
``RUN/checkpoints/step_N``, told apart by the names of :mod:`mmalign.layout.run_dir` alone.

Below :mod:`mmalign.models.arch` (``model.pretrained`` names a model by path) and
:mod:`mmalign.models.load` (which reads it); reading nothing but names and the config file a
step checkpoint was written with. A model *name* (``ARCH/TAG``, ``hf-hub:ORG/NAME``,
``ORG/NAME``) is resolved to its local folder by :mod:`mmalign.models.hub` first
(:func:`check_exists`, ``load``).
"""

from __future__ import annotations

import logging
from pathlib import Path

from mmalign.errors import UsageError
from mmalign.layout.run_dir import CONFIG_FILE, ENGINE_TAG, FINAL, LATEST, ROOT, is_step_name

log = logging.getLogger("mmalign.models.load")  # its messages are the loader's

MODEL, CHECKPOINT = "model", "checkpoint"  # Loaded.kind


def is_step_checkpoint(path: Path) -> bool:
    """Only ``.../checkpoints/step_N`` with an ``engine/`` folder is a step checkpoint."""
    return is_step_name(path.name) and path.resolve().parent.name == ROOT and (path / ENGINE_TAG).is_dir()


def check_exists(path: str | Path, key: str = "--model") -> Path:
    """``path``, the local folder of a model name (:mod:`mmalign.models.hub`: found in the
    cache, or downloaded now), or the one-line UsageError of a model path that does not exist:
    free of torch, so a command says it before the seconds of importing the loader."""
    p = Path(path)
    if p.exists():
        return p
    from mmalign.models.hub import is_name, resolve  # a name: open_clip's registry, the cache

    if is_name(str(path)):
        return resolve(str(path), key)
    raise UsageError(f"model path {p} does not exist")


def locate(path: str | Path) -> tuple[str, Path]:
    """``(kind, folder)`` of the model at ``path``; a one-line UsageError when there is none."""
    from mmalign.models.io import resolve_model_dir

    p = check_exists(path)
    try:
        return MODEL, resolve_model_dir(p)  # safetensors first, whatever else the folder holds
    except FileNotFoundError as e:
        if is_step_checkpoint(p):
            return CHECKPOINT, p
        hint = ""
        latest = p / ROOT / LATEST  # a run killed or still training: name what it has
        newest = latest.read_text(errors="replace").strip() if latest.is_file() else ""
        if is_step_name(newest) and not (p / FINAL).exists():
            hint = f" (the run has no final/ yet; its newest checkpoint is {latest.parent / newest})"
        raise UsageError(f"{e}; or a step checkpoint RUN/checkpoints/step_N{hint}") from None


def checkpoint_config(step_dir: Path) -> Path:
    """The config file a step checkpoint is rebuilt from: its own, else (older runs) the
    run's ``config.yaml``, with one warning."""
    own = step_dir / CONFIG_FILE
    if own.is_file():
        return own
    run_config = step_dir.resolve().parent.parent / CONFIG_FILE
    if not run_config.is_file():
        raise UsageError(
            f"step checkpoint {step_dir} has no {CONFIG_FILE} of its own, nor the run at {run_config}"
        )
    log.warning(
        "step checkpoint %s has no %s of its own (written before checkpoints stored their config); "
        "rebuilding it from %s, which may have been edited since the checkpoint",
        step_dir,
        CONFIG_FILE,
        run_config,
    )
    return run_config


__all__ = ["CHECKPOINT", "MODEL", "checkpoint_config", "is_step_checkpoint", "locate"]
