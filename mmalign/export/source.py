"""Where an export (or an embedding run) takes its weights from.

Two kinds of directory hold an mmalign model:

* a saved model (``final/`` or a run directory, via :func:`resolve_model_dir`):
  ``model.safetensors`` + ``model_config.json``;
* a step checkpoint ``RUN/checkpoints/step_N`` (``engine/`` is DeepSpeed's state,
  any ZeRO stage): the weights are consolidated into one fp32 state dict with
  :func:`mmalign.engine.consolidate_checkpoint` and the architecture is rebuilt
  from the run's resolved ``RUN/config.yaml``.

A model folder can come from anyone, so the safetensors files win whenever they are
present: a folder is read as a step checkpoint only when it has no saved model and
sits at ``checkpoints/step_N``, and even then every torch file is unpickled with
``weights_only=True`` (a planted pickle is a one-line error, never executed).

Either way the result is a :class:`Source`: an eval-mode ``TwoTower`` plus what an
exported folder needs besides the weights (preprocessing, tokenizer).
"""

from __future__ import annotations

import pickle
import re
from dataclasses import dataclass
from pathlib import Path

from mmalign.config import ConfigError
from mmalign.models.two_tower import TwoTower


@dataclass
class Source:
    model: TwoTower
    preprocess_cfg: dict  # open_clip keys: size, mean, std, interpolation, resize_mode, mode
    tokenizer: object  # tokenizer(list[str]) -> LongTensor (N, context_length)
    tokenizer_file: Path | None  # a sentencepiece model to ship beside the weights, else None
    origin: str  # "model" or "checkpoint", for messages


def _is_checkpoint(path: Path) -> bool:
    """Only ``.../checkpoints/step_N`` with an ``engine/`` folder is a step checkpoint."""
    from mmalign.checkpoint import ENGINE_TAG, ROOT, is_step_name

    return is_step_name(path.name) and path.resolve().parent.name == ROOT and (path / ENGINE_TAG).is_dir()


def load_source(path: str | Path) -> Source:
    """A saved model or a step checkpoint -> :class:`Source`; ConfigError if neither."""
    from mmalign.data.tokenizer import build_tokenizer, tokenizer_file
    from mmalign.models.io import load_pretrained, resolve_model_dir

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--model: {p} does not exist")
    try:
        model_dir = resolve_model_dir(p)  # safetensors first, whatever else the folder holds
    except FileNotFoundError as e:
        if _is_checkpoint(p):
            return _load_checkpoint(p)
        raise ConfigError(f"--model: {e}; or a checkpoint directory RUN/checkpoints/step_N") from None
    model, config = load_pretrained(model_dir)
    spm = tokenizer_file(model.arch)
    return Source(
        model=model,
        preprocess_cfg=dict(config["preprocess_cfg"]),
        tokenizer=build_tokenizer(model.arch, base_dir=model_dir),
        tokenizer_file=None if spm is None else (model_dir / spm if not Path(spm).is_absolute() else Path(spm)),
        origin="model",
    )


def _load_checkpoint(step_dir: Path) -> Source:
    """``RUN/checkpoints/step_N`` -> weights consolidated from any ZeRO stage + the run's config."""
    from mmalign.checkpoint import ENGINE_TAG
    from mmalign.config import load_config
    from mmalign.data.tokenizer import build_tokenizer, tokenizer_file
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.engine import consolidate_checkpoint  # imports deepspeed: only on this path
    from mmalign.models import build_model

    run_config = step_dir.resolve().parent.parent / "config.yaml"
    if not run_config.is_file():
        raise ConfigError(f"--model: checkpoint {step_dir} has no run config at {run_config}")
    cfg = load_config(run_config)
    model = build_model(cfg.model)
    try:
        state = consolidate_checkpoint(step_dir, ENGINE_TAG)
    except FileNotFoundError as e:
        raise ConfigError(f"--model: {e}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError) as e:
        # weights_only refuses anything but tensors and plain containers (a planted or
        # foreign pickle); a cut file fails as RuntimeError/EOFError.
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        why = (f"it would import {refused.group(1)}" if refused
               else f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}")
        raise ConfigError(f"--model: checkpoint {step_dir} holds a file that is not a plain weights file "
                          f"({why}); not loaded") from None
    # Non-persistent buffers (e.g. the causal mask) are not in checkpoints; strict=True
    # still catches any missing or unexpected parameter.
    model.load_state_dict(state, strict=True)
    model.eval()
    spm = tokenizer_file(model.arch)
    return Source(
        model=model,
        preprocess_cfg=preprocess_cfg(model.image_size),
        tokenizer=build_tokenizer(model.arch),
        tokenizer_file=None if spm is None else Path(spm),
        origin="checkpoint",
    )
