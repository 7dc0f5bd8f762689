"""Save and load a trained TwoTower as ``model.safetensors`` + ``model_config.json``.

Weights go through safetensors and the rest through JSON, so loading a model never
executes code from the files.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from mmalign.errors import UsageError, first_line
from mmalign.models.misfit import misfit  # noqa: F401 (re-exported: its old home)
from mmalign.models.two_tower import TwoTower

WEIGHTS = "model.safetensors"
CONFIG = "model_config.json"
TOKENIZER = "tokenizer.model"  # a sentencepiece tokenizer, when the model uses one


def save_pretrained(
    model: TwoTower,
    out_dir: str | Path,
    *,
    preprocess: dict,
    extra: dict | None = None,
    state_dict: dict | None = None,
) -> Path:
    """Write the model; ``state_dict`` overrides the module's own (e.g. consolidated ZeRO shards)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    state = state_dict if state_dict is not None else model.state_dict()
    # safetensors refuses shared storage; clone contiguous CPU copies.
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in state.items()}
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt", "library": "mmalign"})
    respect_umask(out / WEIGHTS)
    arch, tokenizer = _record_tokenizer(model, out)
    from mmalign.models.siglip_hf import model_preprocess

    preprocess = model_preprocess(model.arch, preprocess)  # a SigLIP model's own resize (no crop)
    config = {
        "arch": arch,
        "init_logit_bias": None
        if model.logit_bias is None
        else float(model.logit_bias.detach().reshape(-1)[0]),
        "max_logit_scale": model.max_logit_scale,
        "preprocess_cfg": preprocess,
        "tokenizer": tokenizer,
        **(extra or {}),
    }
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


def _record_tokenizer(model: TwoTower, out: Path) -> tuple[dict, dict]:
    """The arch to save and a description of its tokenizer; a sentencepiece model file is
    copied beside the weights (``tokenizer.model``), an HF text tower's config and tokenizer
    into ``hf_text/`` (models/hf_text.py), so the folder is self-contained."""
    from mmalign.data.tokenizer import SPM_KEY
    from mmalign.models.tokenizers import tokenizer_file

    if model.towers.text.ships_files:  # an HF text tower: config + tokenizer in hf_text/
        from mmalign.models.hf_text import record_for_save

        return record_for_save(model.arch, out)
    source = tokenizer_file(model.arch)
    if source is None:
        return model.arch, {"type": "clip_bpe", "context_length": model.context_length}
    target = out / TOKENIZER
    if Path(source).resolve() != target.resolve():
        shutil.copyfile(source, target)
    arch = copy.deepcopy(model.arch)
    arch["text_cfg"]["tokenizer_kwargs"] = {SPM_KEY: TOKENIZER}  # relative to the model folder
    return arch, {
        "type": "sentencepiece",
        "file": TOKENIZER,
        "context_length": model.context_length,
        "vocab_size": int(arch["text_cfg"]["vocab_size"]),
    }


def respect_umask(*paths: str | Path) -> None:
    """Give files the mode a plain ``open()`` would (0644 under umask 022).

    safetensors (0.8) writes through a private temporary file and renames it, which
    leaves 0600: unreadable to the other users of a shared model directory.
    """
    mask = os.umask(0)
    os.umask(mask)
    for path in paths:
        os.chmod(path, 0o666 & ~mask)


def resolve_model_dir(path: str | Path) -> Path:
    """A run directory (uses its ``final/``) or a directory holding the model files."""
    p = Path(path)
    if (p / WEIGHTS).is_file() and (p / CONFIG).is_file():
        return p
    if (p / "final" / WEIGHTS).is_file():
        return p / "final"
    raise FileNotFoundError(f"no mmalign model in {p} (expected {WEIGHTS} and {CONFIG}, or a run's final/)")


def _read_config(d: Path) -> dict:
    """``model_config.json`` as a dict; a one-line error for anything that is not one."""
    path = d / CONFIG
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"model folder {d}: {CONFIG} is not valid JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(config, dict):
        raise UsageError(f"model folder {d}: {CONFIG} must hold a JSON object, got {type(config).__name__}")
    arch = config.get("arch")
    if not isinstance(arch, dict) or not all(k in arch for k in ("embed_dim", "vision_cfg", "text_cfg")):
        raise UsageError(f"model folder {d}: {CONFIG} has no usable 'arch' (embed_dim, vision_cfg, text_cfg)")
    pre = config.get("preprocess_cfg")
    if not isinstance(pre, dict) or not isinstance(pre.get("size"), (int, list)):
        raise UsageError(f"model folder {d}: {CONFIG} has no usable 'preprocess_cfg' (an object with 'size')")
    return config


def load_pretrained(path: str | Path, map_location: str = "cpu") -> tuple[TwoTower, dict]:
    """The model saved in ``path`` (a model folder or a run's final/), eval mode.

    Everything a damaged or foreign folder can do wrong (invalid JSON, no ``arch``, a
    truncated or non-safetensors weights file, weights of another shape) is a one-line
    UsageError naming the folder; nothing in the folder is executed.
    """
    from mmalign.models.hf_text import absolutize

    d = resolve_model_dir(path)
    config = _read_config(d)
    config["arch"] = absolutize(config["arch"], d)  # a saved HF text tower's hf_text/ folder
    try:
        model = TwoTower(
            config["arch"],
            init_logit_bias=config.get("init_logit_bias"),
            max_logit_scale=config.get("max_logit_scale", 100.0),
        )
    except Exception as e:  # open_clip's constructors on a bad arch
        raise UsageError(
            f"model folder {d}: its 'arch' cannot be built: {type(e).__name__}: {first_line(e)}"
        ) from None
    try:
        state = load_file(str(d / WEIGHTS), device=map_location)
    except Exception as e:  # safetensors raises its own error types for truncated / foreign files
        raise UsageError(
            f"model folder {d}: {WEIGHTS} is not a readable safetensors file "
            f"({type(e).__name__}: {first_line(e)})"
        ) from None
    problem = misfit(model.state_dict(), state)
    if problem:
        raise UsageError(f"model folder {d}: {WEIGHTS} does not fit its {CONFIG}: {problem}")
    model.load_state_dict(state, strict=True)
    model.eval()
    return model, config


__all__ = [
    "CONFIG",
    "WEIGHTS",
    "load_pretrained",
    "misfit",
    "resolve_model_dir",
    "respect_umask",
    "save_pretrained",
]
