"""Weights in other tools' formats, under TwoTower's names: an open_clip checkpoint file, an
open_clip ``local-dir:`` folder and a transformers ``CLIPModel`` folder.

Below both readers of such weights, so neither imports the other: :mod:`mmalign.models.init_from`
(``model.pretrained*``, which also reads mmalign models through the loader) and
:mod:`mmalign.models.load` (which builds a model from an export folder).

Key mapping (to TwoTower's names, which are open_clip ``CustomTextCLIP``'s: ``visual.*``,
``text.*``, ``logit_scale``, ``logit_bias``): open_clip's plain ``CLIP`` keeps its text tower at
the top level (:data:`CLIP_TEXT_MODULES` gain ``text.``), open_clip's 0-dim scalars
(``models/keymaps.SCALARS``) become shape (1,), and HF names go backwards through
``models/keymaps.py``'s HF table.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from mmalign.config import ConfigError
from mmalign.models.arch import FILE, HF_CONFIG, HF_DIR, OPEN_CLIP_DIR, _hf_arch, _read_json, kind_of
from mmalign.models.keymaps import BLOCK_KEYS, IN_PROJ, QKV, SCALARS, SCALE, TOP_KEYS, TOWERS, block_prefixes

# open_clip's own search order for a local-dir folder's weights (safetensors first)
OPEN_CLIP_WEIGHTS = (
    "open_clip_model.safetensors",
    "open_clip_pytorch_model.safetensors",
    "open_clip_pytorch_model.bin",
    "open_clip_pytorch_model.pth",
    "model.safetensors",
    "pytorch_model.bin",
)
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
HF_BUFFERS = (
    "vision_model.embeddings.position_ids",
    "text_model.embeddings.position_ids",
)  # aranges, not weights
# open_clip's plain CLIP: the text tower's modules at the top level (CustomTextCLIP: under text.)
CLIP_TEXT_MODULES = (
    "token_embedding",
    "positional_embedding",
    "transformer",
    "ln_final",
    "text_projection",
    "attn_mask",
)


# ---------------------------------------------------------------- weights


def _read_weights(file: Path, key: str, meta: bool = False) -> dict:
    """A weights file as a flat {name: tensor}: safetensors, or torch.load(weights_only=True)
    unwrapped from open_clip_train's {"state_dict": ...} and DDP's ``module.``.  ``meta``: the
    names and shapes only, as meta tensors (safetensors' header; a memory-mapped torch file)."""
    state: Any
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
        raise ConfigError(
            f"config key '{key}': {file} is not a plain weights file ({type(e).__name__}: {first}); "
            f"not loaded"
        ) from None
    if isinstance(state, dict) and isinstance(state.get("state_dict"), dict):
        state = state["state_dict"]  # open_clip_train: {"epoch", "name", "state_dict", "optimizer", ...}
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"config key '{key}': {file} holds no state dict of tensors")
    if state and all(k.startswith("module.") for k in state):
        state = {k[len("module.") :]: v for k, v in state.items()}  # saved from a DDP-wrapped model
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


def read_foreign(path: Path, key: str, meta: bool = False) -> dict | None:
    """The weights of an open_clip file or folder or an HF folder under TwoTower's names; None
    for any other source (an mmalign model). ``key`` names the config key or flag in errors."""
    kind = kind_of(path, key)
    if kind == FILE:
        return from_open_clip(_read_weights(path, key, meta))
    if kind == OPEN_CLIP_DIR:
        return from_open_clip(_read_weights(_first(path, OPEN_CLIP_WEIGHTS, key, kind), key, meta))
    if kind == HF_DIR:
        config = _read_json(path / HF_CONFIG, key)
        from mmalign.models.siglip_hf import from_hf_siglip, is_siglip

        if is_siglip(config):  # SiglipModel / Siglip2Model: one prefix per tower
            return from_hf_siglip(_read_weights(_first(path, HF_WEIGHTS, key, kind), key, meta))
        arch = _hf_arch(config, path, key)
        return from_hf(
            _read_weights(_first(path, HF_WEIGHTS, key, kind), key, meta),
            arch["vision_cfg"]["layers"],
            arch["text_cfg"]["layers"],
        )
    return None
