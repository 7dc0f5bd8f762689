"""A transformers ``SiglipModel`` / ``Siglip2Model`` folder (``config.json`` + weights +
tokenizer + ``preprocessor_config.json``, as the hub ships them and ``mmalign export --format hf``
writes them) read as mmalign's architecture and weights, and back.

The architecture keeps transformers' own tower configs (their structural keys only), so the
towers (models/towers/siglip.py) are rebuilt exactly; weight names differ by one prefix:
``vision_model.X`` <-> ``visual.hf.X``, ``text_model.X`` <-> ``text.hf.X``; ``logit_scale`` and
``logit_bias`` keep theirs.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from mmalign.errors import ConfigError

MODEL_TYPES = {"siglip": "SiglipModel", "siglip2": "Siglip2Model"}
PREPROCESSOR = "preprocessor_config.json"
# the keys that shape a tower (the rest of a transformers config is bookkeeping)
VISION_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_channels",
    "image_size",
    "patch_size",
    "num_patches",
    "hidden_act",
    "layer_norm_eps",
    "attention_dropout",
    "vision_use_head",
)
TEXT_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "hidden_act",
    "layer_norm_eps",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "projection_size",
)
PREFIXES = (("vision_model.", "visual.hf."), ("text_model.", "text.hf."))
BUFFERS = ("vision_model.embeddings.position_ids", "text_model.embeddings.position_ids")  # aranges
CONTEXT = 64  # the length SigLIP was trained with and transformers' zero-shot pipeline pads to


def is_siglip(config: dict) -> bool:
    return config.get("model_type") in MODEL_TYPES


def _tower_config(config: dict, keys: tuple[str, ...]) -> dict[str, Any]:
    return {k: config[k] for k in keys if k in config and config[k] is not None}


def _full_configs(config: dict) -> tuple[dict, dict]:
    """The vision and text configs with transformers' defaults filled in (a hub config.json
    lists only what differs from them)."""
    from transformers import Siglip2Config, SiglipConfig

    kind = SiglipConfig if config["model_type"] == "siglip" else Siglip2Config
    full: Any = kind(
        text_config=config.get("text_config") or {}, vision_config=config.get("vision_config") or {}
    )
    return full.vision_config.to_dict(), full.text_config.to_dict()


def _preprocess(folder: Path) -> dict[str, Any]:
    file = folder / PREPROCESSOR
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def _tokenizer_facts(folder: Path, key: str) -> tuple[int, int]:
    """(its pad id, its size) of the folder's tokenizer: it must load now, not when training starts."""
    from mmalign.errors import first_line

    stamp = tuple(
        p.stat().st_mtime_ns for p in sorted(folder.glob("*token*")) + sorted(folder.glob("*.model"))
    )
    try:
        return _facts(str(folder.resolve()), stamp)  # read once per folder (an arch is resolved often)
    except Exception as e:  # transformers raises OSError / ValueError / its own types
        raise ConfigError(
            f"config key '{key}': the tokenizer of {folder} does not load ({type(e).__name__}: "
            f"{first_line(e)[:160]})"
        ) from None


@functools.lru_cache(maxsize=16)
def _facts(folder: str, stamp: tuple) -> tuple[int, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    pad = tok.pad_token_id
    return int(0 if pad is None else pad), len(tok)


def siglip_arch(config: dict, folder: Path, key: str) -> dict:
    """A SiglipModel / Siglip2Model config.json -> our architecture (siglip_vision / siglip_text
    towers); one ConfigError line for what does not fit."""
    family = str(config["model_type"])
    try:
        vision, text = _full_configs(config)
    except Exception as e:  # transformers' config classes on a bad value
        raise ConfigError(
            f"config key '{key}': {folder / 'config.json'} is no usable {family} config ({e})"
        ) from None
    pre = _preprocess(folder)
    width = int(vision["hidden_size"])
    head = int(text.get("projection_size") or text["hidden_size"])
    if head != width:
        raise ConfigError(
            f"config key '{key}': {folder}: the text head's width {head} differs from the image width {width}"
        )
    patch = int(vision["patch_size"])
    if family == "siglip":
        size = int(vision["image_size"])
    else:  # NaFlex: fixed square images of the grid its position table was trained at, unless told
        grid = int(round(int(pre.get("max_num_patches", vision["num_patches"])) ** 0.5))
        size = grid * patch
    pad, vocab = _tokenizer_facts(folder, key)
    context = min(CONTEXT, int(text["max_position_embeddings"]))
    absolute = str(folder.resolve())
    return {
        "embed_dim": width,
        "quick_gelu": False,
        "vision_cfg": {
            "kind": "siglip_vision",
            "family": family,
            "image_size": size,
            "image_mean": [float(x) for x in pre.get("image_mean", (0.5, 0.5, 0.5))],
            "image_std": [float(x) for x in pre.get("image_std", (0.5, 0.5, 0.5))],
            "hf_config": _tower_config(vision, VISION_KEYS),
        },
        "text_cfg": {
            "kind": "siglip_text",
            "family": family,
            "context_length": context,
            "vocab_size": max(vocab, int(text["vocab_size"])),
            "hf_model_name": absolute,
            "hf_tokenizer_name": absolute,
            "attention_mask": False,  # SigLIP and SigLIP2 were trained on max-length ids, unmasked
            "pad_token_id": pad,
            "hf_config": _tower_config(text, TEXT_KEYS),
        },
    }


def from_hf_siglip(state: dict) -> dict:
    """SiglipModel / Siglip2Model weight names -> TwoTower's (unknown names kept, so that they are
    reported as unexpected)."""
    out = {}
    for name, tensor in state.items():
        if name in BUFFERS:
            continue
        for theirs, ours in PREFIXES:
            if name.startswith(theirs):
                name = ours + name[len(theirs) :]
                break
        out[name] = tensor.reshape(1) if name in ("logit_scale", "logit_bias") else tensor
    return out


def to_hf_siglip(state: dict) -> dict:
    """TwoTower's weight names -> SiglipModel's (the inverse of :func:`from_hf_siglip`)."""
    out = {}
    for name, tensor in state.items():
        for theirs, ours in PREFIXES:
            if name.startswith(ours):
                name = theirs + name[len(ours) :]
                break
        out[name] = tensor
    return out


def hf_configs(arch: dict) -> tuple[str, dict, dict]:
    """(model_type, vision_config, text_config) of a SigLIP architecture, for an HF export."""
    from mmalign.models.towers import Towers
    from mmalign.models.towers.siglip import SiglipVisionSpec

    spec = Towers.from_arch(arch).vision
    assert isinstance(spec, SiglipVisionSpec)  # is_siglip_arch(arch): the caller checked
    return (
        str(arch["vision_cfg"].get("family", "siglip")),
        spec.built_config,
        dict(arch["text_cfg"]["hf_config"]),
    )


def is_siglip_arch(arch: dict) -> bool:
    return arch.get("vision_cfg", {}).get("kind") == "siglip_vision"


def model_preprocess(arch: dict, preprocess: dict) -> dict:
    """``preprocess`` (open_clip's preprocess_cfg keys) with a SigLIP model's own resize: the whole
    image to the square, no crop (``resize_mode: squash``).  The mean and std stay OpenAI's: the
    image tower maps them to its own (models/siglip_modules.py)."""
    return {**preprocess, "resize_mode": resize_mode(arch)} if is_siglip_arch(arch) else preprocess


def resize_mode(arch: dict) -> str:
    """The eval transform's resize for a model (data.transforms.eval_transform): SigLIP's whole
    image to the square (``squash``), else open_clip's shortest side and centre crop."""
    return "squash" if is_siglip_arch(arch) else "shortest"


__all__ = [
    "MODEL_TYPES",
    "from_hf_siglip",
    "hf_configs",
    "is_siglip",
    "is_siglip_arch",
    "model_preprocess",
    "resize_mode",
    "siglip_arch",
    "to_hf_siglip",
]
