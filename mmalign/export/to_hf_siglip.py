"""``mmalign export --format hf`` of a SigLIP-family model: a transformers ``SiglipModel`` /
``Siglip2Model`` folder (config, weights, tokenizer, image processor) that
``AutoModel.from_pretrained`` and ``pipeline("zero-shot-image-classification")`` load.

Written by transformers itself from the towers' own configs and weights (names through
models/siglip_hf.py), so every weight, the logit scale and the bias carry over exactly.  The
tokenizer is saved with ``model_input_names: ["input_ids"]``: the pipeline then passes no
attention mask, as the towers run (models/towers/siglip.py).  The image processor resizes the
whole image to the model's square with bicubic interpolation and normalises with the model's own
mean and std, as mmalign's eval transform does (``resize_mode: squash``).
"""

from __future__ import annotations

from pathlib import Path

from mmalign.errors import UsageError, first_line
from mmalign.models.load import Loaded


def export_hf_siglip(source: Loaded, out: Path) -> Path:
    from transformers import AutoTokenizer

    from mmalign.models.siglip_hf import MODEL_TYPES, hf_configs, to_hf_siglip

    arch = source.model.arch
    family, vision, text = hf_configs(arch)
    if source.model.logit_bias is None:
        raise UsageError(
            f"--format hf: the {MODEL_TYPES[family]} needs a logit bias; {source.source} has none"
        )
    model = _hf_model(family, vision, text)
    state = to_hf_siglip({k: v.detach().cpu().float() for k, v in source.model.state_dict().items()})
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise UsageError(
            f"--format hf: {source.source} does not fit a {MODEL_TYPES[family]} "
            f"(missing {missing[:3]}, unexpected {list(unexpected)[:3]})"
        )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    folder = arch["text_cfg"].get("hf_tokenizer_name") or arch["text_cfg"].get("hf_model_name")
    try:  # its own tokenizer, told to return no attention mask (the towers run unmasked)
        tok = AutoTokenizer.from_pretrained(
            str(folder), local_files_only=True, model_input_names=["input_ids"]
        )
    except Exception as e:  # transformers raises OSError / ValueError / its own types
        raise UsageError(
            f"--format hf: the tokenizer {folder} does not load ({type(e).__name__}: {first_line(e)})"
        ) from None
    tok.model_max_length = int(arch["text_cfg"].get("context_length", 64))
    tok.save_pretrained(str(out))
    _processor(family, arch["vision_cfg"], int(vision.get("patch_size", 16))).save_pretrained(str(out))
    return out


def _hf_model(family: str, vision: dict, text: dict):
    if family == "siglip":
        from transformers import SiglipConfig, SiglipModel

        return SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
    from transformers import Siglip2Config, Siglip2Model

    return Siglip2Model(Siglip2Config(text_config=text, vision_config=vision))


def _processor(family: str, vision_cfg: dict, patch: int):
    """The image processor matching mmalign's eval transform for this model (squash resize, bicubic)."""
    from mmalign.models.towers.vit import square

    size = square(vision_cfg.get("image_size", 224))[0]
    mean, std = list(vision_cfg.get("image_mean", (0.5,) * 3)), list(vision_cfg.get("image_std", (0.5,) * 3))
    if family == "siglip":
        from transformers import SiglipImageProcessor

        return SiglipImageProcessor(
            size={"height": size, "width": size}, resample=3, image_mean=mean, image_std=std
        )
    from transformers import Siglip2ImageProcessor

    grid = size // patch
    return Siglip2ImageProcessor(
        patch_size=patch, max_num_patches=grid * grid, resample=3, image_mean=mean, image_std=std
    )


__all__ = ["export_hf_siglip"]
