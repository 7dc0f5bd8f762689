"""Start a model from pretrained weights in local files (never a download).

``model.pretrained: PATH`` loads both towers and the temperature (and the SigLIP bias);
``model.pretrained_image`` / ``model.pretrained_text`` load one tower.  What ``PATH`` holds
decides how it is read:

* a file (``.pt`` / ``.pth`` / ``.bin``: ``torch.load(weights_only=True)``; ``.safetensors``):
  open_clip weights, as saved by open_clip (``model.state_dict()``) or by ``open_clip_train``
  (``{"state_dict": {"module.visual...": ...}, "epoch": ...}``).  It carries no architecture:
  ``model.preset`` (+ overrides) gives it;
* an open_clip ``local-dir:`` folder: ``open_clip_config.json`` + weights
  (``mmalign export --format open_clip`` writes one);
* a transformers ``CLIPModel`` folder: ``config.json`` + ``model.safetensors`` /
  ``pytorch_model.bin`` (``mmalign export --format hf``);
* an mmalign model folder, run folder or step checkpoint, read by
  :func:`mmalign.models.load.load` (the one loader).

A folder carries its architecture, which the run then uses (models/arch.py:
:func:`~mmalign.models.arch.pretrained_arch`, called by ``resolve_arch``); ``model.preset`` must
agree with it or be unset. This module reads the weights.

The foreign formats are read and their keys mapped to TwoTower's by
:mod:`mmalign.models.foreign_weights`.  Any missing or unexpected weight is a one-line ConfigError listing
them (``model.pretrained_strict: false``: a logged report, the rest loaded); a weight of another
shape is refused, except a ViT's position embedding and patch kernel at another image size or
patch size, which are resampled to the model's grid (:mod:`mmalign.models.pos_embed`).
"""

from __future__ import annotations

import logging
import math
from pathlib import Path

import torch

from mmalign.config import ConfigError, ModelConfig
from mmalign.models.arch import differences, pretrained_arch, source_arch  # noqa: F401 (pretrained_arch: re-exported)
from mmalign.models.foreign_weights import (  # noqa: F401 (re-exported: their old home)
    CLIP_TEXT_MODULES,
    HF_BUFFERS,
    HF_WEIGHTS,
    OPEN_CLIP_WEIGHTS,
    _read_weights,
    from_hf,
    from_open_clip,
    read_foreign,
)
from mmalign.models.hub import resolve
from mmalign.models.pos_embed import GRID_KEYS, fit_grids, source_grid

log = logging.getLogger(__name__)

TOWER_KEYS = {"model.pretrained": None, "model.pretrained_image": "visual", "model.pretrained_text": "text"}
TOWER_CFG = {"visual": "vision_cfg", "text": "text_cfg"}


def read_state(path: Path, key: str, meta: bool = False) -> dict | None:
    """The weights at ``path`` under TwoTower's names (``meta``: as meta tensors, for the
    start-up check; None where that would mean reading everything: a step checkpoint)."""
    foreign = read_foreign(path, key, meta)
    if foreign is not None:
        return foreign
    from mmalign.errors import UsageError
    from mmalign.models.io import WEIGHTS
    from mmalign.models.load import load
    from mmalign.models.locate import MODEL, locate

    try:
        if meta:
            kind, folder = locate(path)
            return _read_weights(folder / WEIGHTS, key, meta=True) if kind == MODEL else None
        return load(path).model.state_dict()
    except UsageError as e:
        raise ConfigError(f"config key '{key}': {e}") from None


_RESAMPLED = {f"vision_cfg.{k}" for k in GRID_KEYS}  # another image size or patch: resampled, not refused


def _fit_grids(model, own: dict, state: dict, key: str, path: Path, mode: str = "bicubic") -> dict:
    """A ViT source at another image size or patch size: its position embedding (and patch
    kernel) resampled to the model's grid (``model.pretrained_resample``), one log line each
    (models/pos_embed.py)."""
    arch = source_arch(path, key) if path.is_dir() else None
    try:
        return fit_grids(model, own, state, key, source_grid(arch), mode)
    except ValueError as e:
        raise ConfigError(f"config key '{key}': {path}: {e}") from None


def _few(keys: list[str], n: int = 6) -> str:
    return ", ".join(keys[:n]) + (f" (+{len(keys) - n} more)" if len(keys) > n else "")


def load_pretrained_weights(model, cfg: ModelConfig) -> None:
    """Copy ``model.pretrained`` / ``pretrained_image`` / ``pretrained_text`` into ``model``
    (built, not yet locked; called by :func:`mmalign.models.build_model`).  On a meta-device
    model (``check_buildable``, at start-up) only the names and shapes are checked."""
    meta = any(p.is_meta for p in model.parameters())
    for key, tower in TOWER_KEYS.items():
        path = getattr(cfg, key.split(".")[1])
        if path is None:
            continue
        path = resolve(path, key)  # a path as it is; a model name: its local folder (models/hub.py)
        own = {k: v for k, v in model.state_dict().items() if tower is None or k.startswith(tower + ".")}
        state = read_state(path, key, meta)
        if state is None:
            continue  # a step checkpoint: checked when the weights are read
        if tower is None and "logit_bias" in state and model.logit_bias is None:
            _adopt_bias(model)  # a SigLIP source's bias comes with it (model.init_logit_bias unset)
            own = dict(model.state_dict())
        if tower is not None:
            arch = source_arch(path, key)
            differ = [] if arch is None else differences(model.arch, arch, (TOWER_CFG[tower],))
            differ = [d for d in differ if d.split(":")[0] not in _RESAMPLED]  # resampled below
            if differ:
                raise ConfigError(
                    f"config key '{key}': the {tower} tower of {path} differs from the model's "
                    f"({'; '.join(differ[:3])})"
                )
            state = {k: v for k, v in state.items() if k.startswith(tower + ".")}
        state = _fit_grids(model, own, state, key, path, cfg.pretrained_resample)
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
        if wrong:
            k = wrong[0]
            raise ConfigError(
                f"config key '{key}': {path} has {k} of shape {tuple(state[k].shape)}, the model needs "
                f"{tuple(own[k].shape)}" + (f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else "")
            )
        report = "; ".join(
            ([f"missing {_few(missing)}"] if missing else [])
            + ([f"unexpected {_few(unexpected)}"] if unexpected else [])
        )
        if report and cfg.pretrained_strict:
            raise ConfigError(
                f"config key '{key}': {path} does not fit the model: {report} "
                f"(model.pretrained_strict: false loads the rest)"
            )
        if meta:
            continue
        if report:
            log.warning("%s: %s: %s; loaded the other %d weights", key, path, report, len(own) - len(missing))
        with torch.no_grad():
            for k in set(own) & set(state):
                own[k].copy_(state[k])  # the model's dtype and device
        log.info("%s: %d weights from %s", key, len(set(own) & set(state)), path)
        _keep_scale(model, key, path)


def _adopt_bias(model) -> None:
    """The model gains a logit bias parameter (its value is the source's, copied below)."""
    like = model.logit_scale  # (1,): the same dtype and device (meta at start-up)
    model.logit_bias = torch.nn.Parameter(torch.zeros(1, dtype=like.dtype, device=like.device))


def _keep_scale(model, key: str, path: Path) -> None:
    """A loaded logit scale above ``model.max_logit_scale`` (published SigLIP: ~112-117) raises the
    clamp to it, so that loading changes no logit; one log line."""
    scale = math.exp(float(model.logit_scale.detach().reshape(-1)[0]))  # float64: its log is the weight
    if scale > model.max_logit_scale:
        log.info(
            "%s: %s has logit scale %.2f: the clamp rises from %g", key, path, scale, model.max_logit_scale
        )
        model.max_logit_scale = scale


__all__ = [
    "differences",
    "from_hf",
    "from_open_clip",
    "load_pretrained_weights",
    "pretrained_arch",
    "read_state",
    "source_arch",
]
