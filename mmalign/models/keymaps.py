"""The weight-name maps between mmalign's ``TwoTower`` and other formats, read both ways:
by the exporters (:mod:`mmalign.export`) and by ``model.pretrained``
(:mod:`mmalign.models.init_from`).  They live with the model so that both directions
import them from here (models never import export).

* open_clip (``CustomTextCLIP``): the same names; only the scalars differ in shape.
* HF ``CLIPModel``: the table below.
"""

from __future__ import annotations

# open_clip: the only names that differ from ours in shape: 0-dim in CustomTextCLIP, (1,) in TwoTower
SCALARS = ("logit_scale", "logit_bias")

# HF CLIPModel. Per model: (ours, theirs, transposed); transposed marks
# the (W, D) projections that HF stores as nn.Linear weights (D, W).
TOP_KEYS: tuple[tuple[str, str, bool], ...] = (
    ("visual.conv1.weight", "vision_model.embeddings.patch_embedding.weight", False),
    ("visual.class_embedding", "vision_model.embeddings.class_embedding", False),
    ("visual.positional_embedding", "vision_model.embeddings.position_embedding.weight", False),
    *((f"visual.ln_pre.{p}", f"vision_model.pre_layrnorm.{p}", False) for p in ("weight", "bias")),
    *((f"visual.ln_post.{p}", f"vision_model.post_layernorm.{p}", False) for p in ("weight", "bias")),
    *((f"text.ln_final.{p}", f"text_model.final_layer_norm.{p}", False) for p in ("weight", "bias")),
    ("visual.proj", "visual_projection.weight", True),  # (W, D) -> (D, W)
    ("text.token_embedding.weight", "text_model.embeddings.token_embedding.weight", False),
    ("text.positional_embedding", "text_model.embeddings.position_embedding.weight", False),
    ("text.text_projection", "text_projection.weight", True),  # (W, D) -> (D, W)
)
TOWERS = (("visual", "vision_model"), ("text", "text_model"))  # our prefix, HF's
# per transformer block i: ours under ``{tower}.transformer.resblocks.{i}.``, HF's under
# ``{hf}.encoder.layers.{i}.``, each with .weight and .bias
BLOCK_KEYS = (
    ("attn.out_proj", "self_attn.out_proj"),
    ("ln_1", "layer_norm1"),
    ("ln_2", "layer_norm2"),
    ("mlp.c_fc", "mlp.fc1"),
    ("mlp.c_proj", "mlp.fc2"),
)
IN_PROJ = "attn.in_proj"  # ours (3W, W) / (3W,), chunked in QKV order into HF's separate projections
QKV = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
SCALE = "logit_scale"  # HF keeps log(scale) 0-dim, we keep it in shape [1]


def block_prefixes(tower: str, hf_tower: str, i: int) -> tuple[str, str]:
    return f"{tower}.transformer.resblocks.{i}.", f"{hf_tower}.encoder.layers.{i}."
