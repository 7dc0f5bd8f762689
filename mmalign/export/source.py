"""Where an export (or an embedding run) takes its weights from.

Two kinds of directory hold an mmalign model:

* a saved model (``final/`` or a run directory, via :func:`resolve_model_dir`):
  ``model.safetensors`` + ``model_config.json``;
* a step checkpoint ``RUN/checkpoints/step_N`` (``engine/`` is DeepSpeed's state,
  any ZeRO stage): the weights are consolidated into one fp32 state dict with
  :func:`mmalign.engine.consolidate_checkpoint` and the architecture is rebuilt
  from the run's resolved ``RUN/config.yaml``.

Either way the result is a :class:`Source`: an eval-mode ``TwoTower`` plus what an
exported folder needs besides the weights (preprocessing, tokenizer).
"""

from __future__ import annotations

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
    from mmalign.checkpoint import ENGINE_TAG

    return (path / ENGINE_TAG).is_dir()


def load_source(path: str | Path) -> Source:
    """A saved model or a step checkpoint -> :class:`Source`; ConfigError if neither."""
    from mmalign.data.tokenizer import build_tokenizer, tokenizer_file
    from mmalign.models.io import load_pretrained, resolve_model_dir

    p = Path(path)
    if not p.exists():
        raise ConfigError(f"--model: {p} does not exist")
    if _is_checkpoint(p):
        return _load_checkpoint(p)
    try:
        model_dir = resolve_model_dir(p)
    except FileNotFoundError as e:
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
