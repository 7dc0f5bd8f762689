"""Towers and the TwoTower model (no loss; the only collectives are sync BatchNorm's, models/batchnorm.py)."""

from mmalign.config import ModelConfig
from mmalign.models.batchnorm import convert_batchnorm, has_batchnorm
from mmalign.models.presets import PRESETS, available, resolve_arch
from mmalign.models.two_tower import TwoTower


def build_model(cfg: ModelConfig) -> TwoTower:
    """Random-init model from a model config; never downloads weights.  With
    ``model.batchnorm`` its BatchNorm layers take that mode (models/batchnorm.py)."""
    model = TwoTower(
        resolve_arch(cfg),
        init_logit_scale=cfg.init_logit_scale,
        init_logit_bias=cfg.init_logit_bias,
        max_logit_scale=cfg.max_logit_scale,
    )
    if cfg.batchnorm is not None and has_batchnorm(model):
        convert_batchnorm(model, cfg.batchnorm)
    return model


__all__ = ["PRESETS", "TwoTower", "available", "build_model", "resolve_arch"]
