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

Key mapping (to TwoTower's names, which are open_clip ``CustomTextCLIP``'s: ``visual.*``,
``text.*``, ``logit_scale``, ``logit_bias``) is explicit: open_clip's plain ``CLIP`` keeps its
text tower at the top level (:data:`CLIP_TEXT_MODULES` gain ``text.``), open_clip's 0-dim
scalars (``models/keymaps.SCALARS``) become shape (1,), and HF names go backwards through
``models/keymaps.py``'s HF table.  Any missing or unexpected weight is a one-line ConfigError listing
them (``model.pretrained_strict: false``: a logged report, the rest loaded); a weight of another
shape is always refused.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch

from mmalign.config import ConfigError, ModelConfig
from mmalign.models.arch import (  # noqa: F401 (pretrained_arch: re-exported)
    FILE, HF_CONFIG, HF_DIR, OPEN_CLIP_DIR, _hf_arch, _read_json, differences, kind_of, pretrained_arch, source_arch,
)
from mmalign.models.keymaps import BLOCK_KEYS, IN_PROJ, QKV, SCALARS, SCALE, TOP_KEYS, TOWERS, block_prefixes

log = logging.getLogger(__name__)

# open_clip's own search order for a local-dir folder's weights (safetensors first)
OPEN_CLIP_WEIGHTS = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors",
                     "open_clip_pytorch_model.bin", "open_clip_pytorch_model.pth", "model.safetensors",
                     "pytorch_model.bin")
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
HF_BUFFERS = ("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids")  # aranges, not weights
# open_clip's plain CLIP: the text tower's modules at the top level (CustomTextCLIP: under text.)
CLIP_TEXT_MODULES = ("token_embedding", "positional_embedding", "transformer", "ln_final", "text_projection",
                     "attn_mask")
TOWER_KEYS = {"model.pretrained": None, "model.pretrained_image": "visual", "model.pretrained_text": "text"}
TOWER_CFG = {"visual": "vision_cfg", "text": "text_cfg"}


# ---------------------------------------------------------------- weights


def _read_weights(file: Path, key: str, meta: bool = False) -> dict:
    """A weights file as a flat {name: tensor}: safetensors, or torch.load(weights_only=True)
    unwrapped from open_clip_train's {"state_dict": ...} and DDP's ``module.``.  ``meta``: the
    names and shapes only, as meta tensors (safetensors' header; a memory-mapped torch file)."""
    try:
        if file.suffix == ".safetensors":
            from safetensors import safe_open
            from safetensors.torch import load_file

            if meta:
                with safe_open(str(file), framework="pt") as f:
                    state = {k: torch.empty(f.get_slice(k).get_shape(), device="meta") for k in f.keys()}
            else:
                state = load_file(str(file), device="cpu")
        else:
            try:
                state = torch.load(str(file), map_location="cpu", weights_only=True, mmap=meta)
            except RuntimeError:
                if not meta:
                    raise
                state = torch.load(str(file), map_location="cpu", weights_only=True)  # legacy format: no mmap
    except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"config key '{key}': {file} is not a plain weights file ({type(e).__name__}: {first}); "
                          f"not loaded") from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # open_clip_train: {"epoch", "name", "state_dict", "optimizer", ...}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"config key '{key}': {file} holds no state dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module."):]: v for k, v in state.items()}  # saved from a DDP-wrapped model
    return {k: v.to("meta") for k, v in state.items()} if meta else state


def from_open_clip(state: dict) -> dict:
    """open_clip CLIP / CustomTextCLIP names and shapes -> TwoTower's."""

    out = {}
    for name, tensor in state.items():
        if name in SCALARS:
            tensor = tensor.reshape(1)  # 0-dim -> (1,)
        elif name.split(".")[0] in CLIP_TEXT_MODULES:
            name = "text." + name
        out[name] = tensor
    return out


def from_hf(state: dict, vision_layers: int, text_layers: int) -> dict:
    """CLIPModel names -> TwoTower's, through models/keymaps.py's HF table backwards; HF weights the
    table does not name are kept under their own names (so they are reported as unexpected)."""

    state = {k: v for k, v in state.items() if k not in HF_BUFFERS}
    out, used = {}, set()
    for ours, theirs, transpose in TOP_KEYS:
        if theirs in state:
            out[ours] = state[theirs].T if transpose else state[theirs]
            used.add(theirs)
    for (tower, hf_tower), layers in zip(TOWERS, (vision_layers, text_layers)):
        for i in range(layers):
            s, d = block_prefixes(tower, hf_tower, i)
            for p in ("weight", "bias"):
                parts = [f"{d}{name}.{p}" for name in QKV]
                if all(x in state for x in parts):
                    out[f"{s}{IN_PROJ}_{p}"] = torch.cat([state[x] for x in parts])  # 3 x (W, W) -> (3W, W)
                    used.update(parts)
                for ours, theirs in BLOCK_KEYS:
                    if f"{d}{theirs}.{p}" in state:
                        out[f"{s}{ours}.{p}"] = state[f"{d}{theirs}.{p}"]
                        used.add(f"{d}{theirs}.{p}")
    if SCALE in state:
        out[SCALE] = state[SCALE].reshape(1)
        used.add(SCALE)
    out.update({k: v for k, v in state.items() if k not in used})
    return out


def _first(folder: Path, names: tuple[str, ...], key: str, what: str) -> Path:
    for name in names:
        if (folder / name).is_file():
            return folder / name
    raise ConfigError(f"config key '{key}': the {what} {folder} has no weights file ({', '.join(names)})")


def read_state(path: Path, key: str, meta: bool = False) -> dict | None:
    """The weights at ``path`` under TwoTower's names (``meta``: as meta tensors, for the
    start-up check; None where that would mean reading everything: a step checkpoint)."""
    kind = kind_of(path, key)
    if kind == FILE:
        return from_open_clip(_read_weights(path, key, meta))
    if kind == OPEN_CLIP_DIR:
        return from_open_clip(_read_weights(_first(path, OPEN_CLIP_WEIGHTS, key, kind), key, meta))
    if kind == HF_DIR:
        arch = _hf_arch(_read_json(path / HF_CONFIG, key), path, key)
        return from_hf(_read_weights(_first(path, HF_WEIGHTS, key, kind), key, meta), arch["vision_cfg"]["layers"],
                       arch["text_cfg"]["layers"])
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
        path = Path(path)
        own = {k: v for k, v in model.state_dict().items() if tower is None or k.startswith(tower + ".")}
        state = read_state(path, key, meta)
        if state is None:
            continue  # a step checkpoint: checked when the weights are read
        if tower is not None:
            arch = source_arch(path, key)
            differ = [] if arch is None else differences(model.arch, arch, (TOWER_CFG[tower],))
            if differ:
                raise ConfigError(f"config key '{key}': the {tower} tower of {path} differs from the model's "
                                  f"({'; '.join(differ[:3])})")
            state = {k: v for k, v in state.items() if k.startswith(tower + ".")}
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
        if wrong:
            k = wrong[0]
            raise ConfigError(f"config key '{key}': {path} has {k} of shape {tuple(state[k].shape)}, the model needs "
                              f"{tuple(own[k].shape)}" + (f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else ""))
        report = "; ".join(([f"missing {_few(missing)}"] if missing else [])
                           + ([f"unexpected {_few(unexpected)}"] if unexpected else []))
        if report and cfg.pretrained_strict:
            raise ConfigError(f"config key '{key}': {path} does not fit the model: {report} "
                              f"(model.pretrained_strict: false loads the rest)")
        if meta:
            continue
        if report:
            log.warning("%s: %s: %s; loaded the other %d weights", key, path, report, len(own) - len(missing))
        with torch.no_grad():
            for k in set(own) & set(state):
                own[k].copy_(state[k])  # the model's dtype and device
        log.info("%s: %d weights from %s", key, len(set(own) & set(state)), path)


__all__ = ["differences", "from_hf", "from_open_clip", "load_pretrained_weights", "pretrained_arch", "read_state",
           "source_arch"]
