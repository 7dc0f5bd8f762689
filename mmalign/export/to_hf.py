"""Export to a ``transformers`` ``CLIPModel`` folder (``config.json`` + ``model.safetensors``).

Possible whenever both towers are plain open_clip transformers that HF's CLIP can
express: a ViT with class-token pooling, pre/post layernorms and a bias-free linear
projection, and a causal text transformer pooled at the end-of-text token.  Anything
else (layer scale, attentional pooling, custom attention blocks, timm or HF towers,
...) has no CLIPModel equivalent and raises :class:`~mmalign.errors.UsageError` naming
the key.

Weight map (open_clip -> HF, per tower; REFERENCE.md):
``in_proj_weight/bias`` (3W, W) -> ``q_proj``/``k_proj``/``v_proj`` (chunks in that
order), ``ln_1/ln_2`` -> ``layer_norm1/2``, ``mlp.c_fc/c_proj`` -> ``mlp.fc1/fc2``,
``conv1`` -> ``patch_embedding``, ``ln_pre/ln_post`` -> ``pre_layrnorm``/
``post_layernorm``, ``ln_final`` -> ``final_layer_norm``; the projections are stored
(W, D) and applied as ``x @ P`` in open_clip but are ``nn.Linear`` (D, W) in HF, hence
transposed.

Text pooling: open_clip pools at ``argmax(token ids)``, which is the end-of-text token
because our tokenizers give it the largest id they emit.  HF pools at the first
``eos_token_id`` (or at argmax when ``eos_token_id == 2``, a legacy rule); we set
``eos_token_id`` to the tokenizer's end-of-text id, so both pick the same position for
every tokenizer output.  Padding is id 0 as in open_clip; under the causal mask it
never reaches the pooled token.

Tokenizer and processor: the folder also holds HF tokenizer files for our tokenizer
(:mod:`mmalign.export.hf_tokenizer`), a ``preprocessor_config.json`` equal to our eval
transform and a ``processor_config.json``, so that ``AutoProcessor.from_pretrained`` and
``pipeline("zero-shot-image-classification", model=DIR)`` work offline.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from mmalign.errors import UsageError
from mmalign.export.hf_tokenizer import write_clip_tokenizer, write_sentencepiece_tokenizer
from mmalign.models.keymaps import BLOCK_KEYS, IN_PROJ, QKV, SCALE, TOP_KEYS, TOWERS, block_prefixes
from mmalign.models.load import Loaded

log = logging.getLogger("mmalign.export")

# Settings with no CLIPModel counterpart: key -> the only value(s) we can export.
_VISION_FIXED: dict[str, tuple[object, ...]] = {
    "ls_init_value": (None,),
    "attentional_pool": (False,),
    "no_ln_pre": (False,),
    "pool_type": ("tok",),
    "act_kwargs": (None, {}),
    "norm_kwargs": (None, {}),
    "block_type": (None, "default"),
    "qk_norm": (False,),
    "scaled_cosine_attn": (False,),
    "scale_heads": (False,),
    "scale_attn_inner": (False,),
    "scale_attn": (False,),
    "scale_fc": (False,),
    "timm_model_name": (None, ""),
    "pos_embed_type": ("learnable", "sin_cos_2d"),
}
_TEXT_FIXED: dict[str, tuple[object, ...]] = {
    "ls_init_value": (None,),
    "embed_cls": (False,),
    "no_causal_mask": (False,),
    "pool_type": ("argmax", "eos"),
    "proj_bias": (False,),
    "proj_type": ("linear",),
    "act_kwargs": (None, {}),
    "norm_kwargs": (None, {}),
    "block_type": (None, "default"),
    "qk_norm": (False,),
    "scaled_cosine_attn": (False,),
    "scale_heads": (False,),
    "scale_attn_inner": (False,),
    "scale_attn": (False,),
    "scale_fc": (False,),
    "hf_model_name": (None, ""),
}


def _square(value, what: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise UsageError(
                f"--format hf: vision_cfg.{what}={list(value)} is not square; HF CLIP needs square"
            )
        value = value[0]
    return int(value)


def _check(cfg: dict, fixed: dict, tower: str) -> None:
    for key, allowed in fixed.items():
        if key in cfg and cfg[key] not in allowed:
            raise UsageError(
                f"--format hf: {tower}.{key}={cfg[key]!r} has no transformers CLIPModel equivalent "
                f"(export with --format open_clip or onnx instead)"
            )


def _intermediate(width: int, mlp_ratio: float, tower: str) -> int:
    size = width * float(mlp_ratio)
    if size != int(size):
        raise UsageError(f"--format hf: {tower}.mlp_ratio={mlp_ratio} gives a fractional MLP width")
    return int(size)


def hf_config(source: Loaded):
    """Our architecture -> ``transformers.CLIPConfig`` (built offline, no hub access)."""
    from transformers import CLIPConfig

    towers = source.model.towers
    for spec, what in ((towers.vision, "image"), (towers.text, "text")):
        if not spec.hf_clip:
            named = f" ({'vision' if what == 'image' else 'text'}_cfg.{spec.marker})" if spec.marker else ""
            raise UsageError(
                f"--format hf: the {spec.kind} {what} tower kind{named} has no HF CLIPModel export "
                f"(open_clip's ViT and text transformer only)"
            )
    v, t = towers.vision.to_cfg(), towers.text.to_cfg()
    arch: dict[str, Any] = {"embed_dim": towers.embed_dim, "quick_gelu": towers.quick_gelu}
    _check(v, _VISION_FIXED, "vision_cfg")
    _check(t, _TEXT_FIXED, "text_cfg")
    act = "quick_gelu" if arch.get("quick_gelu") else "gelu"  # open_clip: QuickGELU or exact nn.GELU
    v_width, t_width = int(v.get("width", 768)), int(t.get("width", 512))
    head_width = int(v.get("head_width", 64))
    if v_width % head_width:
        raise UsageError(
            f"--format hf: vision_cfg.width={v_width} is not a multiple of head_width={head_width}"
        )
    image_size, patch = (
        _square(v.get("image_size", 224), "image_size"),
        _square(v.get("patch_size", 16), "patch_size"),
    )
    tok: Any = source.tokenizer  # open_clip's tokenizer classes: sot_token_id, eot_token_id
    eot = int(t["eos_id"]) if t.get("pool_type") == "eos" else int(tok.eot_token_id)
    text_config = {
        "vocab_size": int(t.get("vocab_size", 49408)),
        "hidden_size": t_width,
        "intermediate_size": _intermediate(t_width, t.get("mlp_ratio", 4.0), "text_cfg"),
        "num_hidden_layers": int(t.get("layers", 12)),
        "num_attention_heads": int(t.get("heads", 8)),
        "max_position_embeddings": int(t.get("context_length", 77)),
        "hidden_act": act,
        "layer_norm_eps": 1e-5,
        "projection_dim": int(arch["embed_dim"]),
        "pad_token_id": 0,
        "bos_token_id": int(tok.sot_token_id),
        "eos_token_id": eot,
    }
    vision_config = {
        "hidden_size": v_width,
        "intermediate_size": _intermediate(v_width, v.get("mlp_ratio", 4.0), "vision_cfg"),
        "num_hidden_layers": int(v.get("layers", 12)),
        "num_attention_heads": v_width // head_width,
        "image_size": image_size,
        "patch_size": patch,
        "num_channels": 3,
        "hidden_act": act,
        "layer_norm_eps": 1e-5,
        "projection_dim": int(arch["embed_dim"]),
    }
    return CLIPConfig(
        text_config=text_config,
        vision_config=vision_config,
        projection_dim=int(arch["embed_dim"]),
        logit_scale_init_value=float(source.model.logit_scale.detach().reshape(-1)[0]),
    )


def _blocks(src: dict, prefix: str, dst_prefix: str, layers: int, out: dict, used: set) -> None:
    for i in range(layers):
        s, d = block_prefixes(prefix, dst_prefix, i)
        for p in ("weight", "bias"):
            chunks = src[f"{s}{IN_PROJ}_{p}"].chunk(3, dim=0)  # (3W, W) -> 3 x (W, W), q/k/v order
            out.update({f"{d}{name}.{p}": chunk for name, chunk in zip(QKV, chunks)})
            used.add(f"{s}{IN_PROJ}_{p}")
        for ours, theirs in BLOCK_KEYS:
            for p in ("weight", "bias"):
                out[f"{d}{theirs}.{p}"] = src[f"{s}{ours}.{p}"]
                used.add(f"{s}{ours}.{p}")


def hf_state_dict(
    src: dict[str, torch.Tensor], vision_layers: int, text_layers: int
) -> dict[str, torch.Tensor]:
    """open_clip-named TwoTower weights -> CLIPModel names; errors on any weight left unmapped."""
    out: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for ours, theirs, transpose in TOP_KEYS:
        out[theirs] = src[ours].T if transpose else src[ours]
        used.add(ours)
    for (tower, hf_tower), layers in zip(TOWERS, (vision_layers, text_layers)):
        _blocks(src, tower, hf_tower, layers, out, used)
    out[SCALE] = src[SCALE].reshape(())
    used.add(SCALE)
    left = sorted(set(src) - used - {"logit_bias"})
    if left:
        raise UsageError(f"--format hf: weights with no CLIPModel counterpart: {', '.join(left[:5])}")
    return {k: v.detach().cpu().float().contiguous().clone() for k, v in out.items()}


def image_processor_config(preprocess: dict) -> dict:
    """CLIPImageProcessor settings equal to our eval transform (shortest-side bicubic resize, centre crop)."""
    size = int(
        preprocess["size"] if not isinstance(preprocess["size"], (list, tuple)) else preprocess["size"][0]
    )
    return {
        "image_processor_type": "CLIPImageProcessor",
        "do_convert_rgb": True,
        "do_resize": True,
        "size": {"shortest_edge": size},
        "resample": 3,  # PIL bicubic
        "do_center_crop": True,
        "crop_size": {"height": size, "width": size},
        "do_rescale": True,
        "rescale_factor": 1 / 255,
        "do_normalize": True,
        "image_mean": list(preprocess["mean"]),
        "image_std": list(preprocess["std"]),
    }


def export_hf(source: Loaded, out: Path) -> Path:
    from transformers import CLIPModel

    from mmalign.models.siglip_hf import is_siglip_arch

    if is_siglip_arch(source.model.arch):  # a SiglipModel / Siglip2Model folder instead
        from mmalign.export.to_hf_siglip import export_hf_siglip

        return export_hf_siglip(source, out)
    config = hf_config(source)
    state = hf_state_dict(
        source.model.state_dict(),
        config.vision_config.num_hidden_layers,
        config.text_config.num_hidden_layers,
    )
    if source.model.logit_bias is not None:
        log.warning(
            "CLIPModel has no logit bias; the SigLIP bias is not exported (embeddings are unaffected)"
        )
    model = CLIPModel(config)
    model.load_state_dict(state, strict=True)  # every CLIPModel weight must come from ours
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    (out / "preprocessor_config.json").write_text(
        json.dumps(image_processor_config(source.preprocess_cfg), indent=2)
    )
    context = config.text_config.max_position_embeddings
    if source.tokenizer_file is not None:
        shutil.copyfile(source.tokenizer_file, out / "tokenizer.model")  # for mmalign's own tokenizer
        write_sentencepiece_tokenizer(source.tokenizer_file, out, context)
    else:
        write_clip_tokenizer(source.tokenizer, out, context)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "CLIPProcessor"}, indent=2))
    return out
