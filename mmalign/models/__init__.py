"""Towers and the TwoTower model (no loss; the only collectives are sync BatchNorm's, models/batchnorm.py).

The names below are imported when first used (PEP 562 ``__getattr__``): importing a submodule
such as :mod:`mmalign.models.locate` or :mod:`mmalign.models.preset_table` runs this file first,
and a command that only checks a path or lists presets must not pay for torch and open_clip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mmalign.config import ModelConfig
    from mmalign.models.two_tower import TwoTower


def __getattr__(name: str):
    if name == "TwoTower":
        from mmalign.models.two_tower import TwoTower

        return TwoTower
    if name in ("PRESETS", "available"):
        from mmalign.models import presets

        return getattr(presets, name)
    if name == "resolve_arch":
        from mmalign.models.arch import resolve_arch

        return resolve_arch
    raise AttributeError(f"module 'mmalign.models' has no attribute {name!r}")


def build_model(cfg: ModelConfig) -> TwoTower:
    """Model from a model config: random init, then the local weights of ``model.pretrained*``
    (models/init_from.py); never downloads weights.  With
    ``model.batchnorm`` its BatchNorm layers take that mode (models/batchnorm.py); with
    ``model.lock_image`` / ``model.lock_text`` a tower is locked (:meth:`TwoTower.lock`)."""
    from mmalign.models.arch import resolve_arch
    from mmalign.models.batchnorm import convert_batchnorm, has_batchnorm
    from mmalign.models.flip import add_patch_dropout
    from mmalign.models.init_from import load_pretrained_weights
    from mmalign.models.timm_tower import load_timm_weights
    from mmalign.models.two_tower import TwoTower

    model = TwoTower(
        resolve_arch(cfg),
        init_logit_scale=cfg.init_logit_scale,
        init_logit_bias=cfg.init_logit_bias,
        max_logit_scale=cfg.max_logit_scale,
    )
    if cfg.batchnorm is not None and has_batchnorm(model):
        convert_batchnorm(model, cfg.batchnorm)
    elif cfg.lock_image_freeze_bn_stats and has_batchnorm(
        model.visual
    ):  # config validation sets batchnorm too
        convert_batchnorm(model.visual, "frozen")
    if cfg.timm_weights is not None:  # a timm trunk's own checkpoint (models/timm_tower.py)
        load_timm_weights(model.visual, cfg.timm_weights)
    load_pretrained_weights(model, cfg)  # model.pretrained*: after init, before locking (meta: checked only)
    if cfg.patch_dropout:  # FLIP (models/flip.py); not part of the saved arch
        add_patch_dropout(model, cfg.patch_dropout)
    # LiT: after init and pretrained weights, before the engine builds the optimiser
    if cfg.lock_image:
        model.lock("visual", cfg.lock_image_unlocked_groups)
    if cfg.lock_text:
        model.lock("text", cfg.lock_text_unlocked_layers)
    return model


def check_buildable(cfg: ModelConfig) -> TwoTower:
    """Build the towers on the meta device (no memory, no maths) so that a bad tower setting
    (``model.vision.patch_size=x``, a negative width, ...) is a one-line ConfigError before any
    process or DeepSpeed engine starts, not a traceback after them."""
    import torch

    from mmalign.errors import ConfigError, first_line
    from mmalign.models.arch import resolve_arch

    resolve_arch(cfg)  # unknown presets: their own one-line error
    try:
        with torch.device("meta"):
            model = build_model(cfg)  # the meta-device model, for checks that need its modules
    except ConfigError:
        raise
    except Exception as e:  # whatever open_clip's constructors raise on a bad value
        raise ConfigError(
            f"config key 'model': the towers of preset {cfg.preset!r} cannot be built with "
            f"model.vision={cfg.vision} model.text={cfg.text}: {type(e).__name__}: {first_line(e)}"
        ) from None
    _check_tokenizer(cfg, model.arch)
    return model


def _check_tokenizer(cfg: ModelConfig, arch: dict) -> None:
    """A tokenizer file or folder the architecture names (``model.text.tokenizer_kwargs``, one a
    ``model.pretrained`` folder ships) loads now: a file that is no tokenizer is one line here,
    not a traceback when training builds it.  The default CLIP BPE ships with open_clip."""
    from mmalign.errors import ConfigError, UsageError
    from mmalign.models.tokenizers import build_tokenizer
    from mmalign.models.towers import Towers, TowerSpec

    spec = Towers.from_arch(arch).text
    if type(spec).tokenizer is TowerSpec.tokenizer:  # a kind must say how its ids are made
        raise ConfigError(f"config key 'model.text': the {spec.kind} text tower kind has no tokenizer() hook")
    if spec.tokenizer_file is None and not spec.folder:
        return
    own = [
        k for k in ("tokenizer_kwargs", "hf_tokenizer_name", "hf_model_name", "hf_local_dir") if k in cfg.text
    ]
    key = (
        f"model.text.{own[0]}"
        if own
        else "model.tokenizer"
        if cfg.tokenizer is not None
        else "model.pretrained"
        if cfg.pretrained is not None
        else "model.preset"
    )
    try:
        build_tokenizer(arch)
    except UsageError as e:
        raise ConfigError(f"config key '{key}': {e}") from None


__all__ = ["PRESETS", "TwoTower", "available", "build_model", "check_buildable", "resolve_arch"]
