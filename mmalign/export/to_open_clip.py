"""Export to open_clip's own folder format.

``OUT/open_clip_config.json`` = ``{"model_cfg": ..., "preprocess_cfg": ...}`` and
``OUT/open_clip_model.safetensors``.  open_clip 3.3 loads such a folder offline::

    model, _, preprocess = open_clip.create_model_and_transforms("local-dir:OUT")
    tokenizer = open_clip.get_tokenizer("local-dir:OUT")

Why ``custom_text: true``: our towers are named ``visual.*`` / ``text.*`` (built with
open_clip's ``_build_vision_tower`` / ``_build_text_tower``), which is the layout of
open_clip's ``CustomTextCLIP``; plain ``CLIP`` flattens the text tower into the top
level (``token_embedding``, ``transformer``, ...).  ``CustomTextCLIP`` keeps a 0-dim
``logit_scale`` (ours is shape [1] for DeepSpeed), so it is reshaped here.

A timm image tower exports as is (open_clip builds the same ``TimmModel``), unless its trunk
was resized to another image size (a ViT's position embeddings), which open_clip cannot
build: refused.  An HF text tower's config and tokenizer are copied into the folder
(:func:`_hf_text`).
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
from pathlib import Path

from safetensors.torch import save_file

from mmalign.errors import UsageError
from mmalign.models.keymaps import SCALARS
from mmalign.models.load import Loaded

log = logging.getLogger("mmalign.export")

CONFIG = "open_clip_config.json"
WEIGHTS = "open_clip_model.safetensors"


def model_cfg(source: Loaded, text_changes: dict | None = None) -> dict:
    model = source.model
    towers = model.towers
    # each tower kind writes its own config (a kind open_clip cannot build refuses, one line)
    cfg = {
        "embed_dim": towers.embed_dim,
        "vision_cfg": copy.deepcopy(towers.vision.open_clip_cfg()),
        "text_cfg": copy.deepcopy(towers.text.open_clip_cfg()) | (text_changes or {}),
    }
    if towers.quick_gelu is not None:
        cfg["quick_gelu"] = towers.quick_gelu
    cfg["custom_text"] = True
    if model.logit_bias is not None:  # SigLIP: CustomTextCLIP creates logit_bias only when asked
        cfg["init_logit_bias"] = float(model.logit_bias.detach().reshape(-1)[0])
    return cfg


def export_open_clip(source: Loaded, out: Path, final: Path | None = None) -> Path:
    """Write the folder into ``out``; ``final`` is where it will be published (an HF text
    tower's config is named by that absolute path, see :func:`_hf_text`)."""
    from mmalign.models.timm_tower import open_clip_refusal

    refusal = open_clip_refusal(source.model.towers, source.model.state_dict())
    if refusal:
        raise UsageError(refusal)
    model_cfg(source)  # a tower kind without an open_clip config refuses before anything is written
    out.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, tensor in source.model.state_dict().items():
        tensor = tensor.detach().cpu().float().contiguous().clone()
        if name in SCALARS:
            tensor = tensor.reshape(())  # (1,) -> 0-dim, CustomTextCLIP's shape
        state[name] = tensor
    save_file(state, str(out / WEIGHTS), metadata={"format": "pt", "library": "mmalign"})
    text = source.model.towers.text
    changes = {}
    if text.ships_files:  # a tower that ships files of its own (an HF folder)
        changes = _hf_text(text, out, (final or out).resolve())
    config = {"model_cfg": model_cfg(source, changes), "preprocess_cfg": dict(source.preprocess_cfg)}
    if source.tokenizer_file is not None:
        shutil.copyfile(source.tokenizer_file, out / "tokenizer.model")
        config["mmalign_tokenizer"] = {
            "type": "sentencepiece",
            "file": "tokenizer.model",
            "context_length": source.model.context_length,
        }
        log.warning(
            "open_clip.get_tokenizer('local-dir:%s') returns CLIP BPE, not this model's sentencepiece "
            "tokenizer (tokenizer.model, copied beside the weights); tokenize with "
            "mmalign.data.tokenizer.SentencePieceTokenizer",
            out,
        )
    (out / CONFIG).write_text(json.dumps(config, indent=2))
    return out


def _hf_text(text, out: Path, final: Path) -> dict:
    """An HF text tower: its transformers config and tokenizer files go into the folder itself.
    ``open_clip.get_tokenizer("local-dir:OUT")`` reads the tokenizer from there
    (``hf_tokenizer_name`` set); ``HFTextEncoder`` builds from ``hf_model_name``, which open_clip
    resolves against the working directory, so it is the folder's absolute path at export time
    (moved elsewhere, pass ``text_cfg`` with the new path, or edit ``open_clip_config.json``).
    ``hf_model_pretrained`` is false: the trained weights are in the checkpoint."""
    text.export_files(out)
    log.warning(
        "open_clip_config.json names this folder by its absolute path %s (open_clip builds the HF text "
        "tower from hf_model_name); if the folder moves, update text_cfg.hf_model_name",
        final,
    )
    return {"hf_model_name": str(final), "hf_tokenizer_name": str(final), "hf_model_pretrained": False}
