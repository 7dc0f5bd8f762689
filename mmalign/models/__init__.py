"""Towers and the TwoTower model (no loss, no distributed code)."""

from mmalign.config import ModelConfig
from mmalign.models.presets import PRESETS, available, resolve_arch
from mmalign.models.two_tower import TwoTower


def build_model(cfg: ModelConfig) -> TwoTower:
    """Random-init model from a model config; never downloads weights."""
    return TwoTower(
        resolve_arch(cfg),
        init_logit_scale=cfg.init_logit_scale,
        init_logit_bias=cfg.init_logit_bias,
        max_logit_scale=cfg.max_logit_scale,
    )


__all__ = ["PRESETS", "TwoTower", "available", "build_model", "resolve_arch"]
