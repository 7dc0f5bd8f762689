"""The derived values of a config: what one key implies for another, filled in place.

:func:`resolve` runs once, between building the typed config and validating it
(:func:`mmalign.config.load_config`).  It derives only from values within their own domain
and never refuses anything: a value it cannot derive from is left as it is, for
:func:`mmalign.config.validate` to name in one line.  Running it again changes nothing, so a
saved (resolved) config loads back equal.
"""

from __future__ import annotations

from pathlib import Path

from mmalign.config.checks import model_name_form, within_domain
from mmalign.config.schema import Config, ModelConfig

__all__ = ["resolve"]


def resolve(cfg: Config) -> Config:
    """Fill ``cfg``'s derived values (in place; also returned)."""
    _id_field(cfg)
    _frozen_batchnorm(cfg.model)
    _default_preset(cfg.model)
    _patch_dropout(cfg.model)
    _tokenizer(cfg.model)
    return cfg


def _id_field(cfg: Config) -> None:
    """``loss.false_negative_ids: <field>``: the loader reads that .json field (data.id_field)."""
    ids = cfg.loss.false_negative_ids
    if (
        ids not in ("none", "caption")
        and cfg.data.id_field is None
        and within_domain(cfg, "loss.false_negative_ids")
    ):
        cfg.data.id_field = ids


def _frozen_batchnorm(m: ModelConfig) -> None:
    """``lock_image_freeze_bn_stats`` is ``batchnorm: frozen`` (open_clip's FrozenBatchNorm2d maths,
    torch's names kept)."""
    if m.lock_image_freeze_bn_stats is True and m.batchnorm is None:
        m.batchnorm = "frozen"


def _default_preset(m: ModelConfig) -> None:
    """No preset: a pretrained folder (or a model name: mmalign.models.hub) carries its
    architecture; anything else is ``tiny``."""
    if m.preset is not None:
        return
    folder = (
        m.pretrained is not None
        and within_domain(m, "pretrained")
        and (
            Path(m.pretrained).is_dir() or (not Path(m.pretrained).exists() and model_name_form(m.pretrained))
        )
    )
    if not folder:
        m.preset = "tiny"


def _patch_dropout(m: ModelConfig) -> None:
    """``model.vision.patch_dropout`` (the tower's own key) is mirrored in model.patch_dropout."""
    if isinstance(m.vision, dict) and "patch_dropout" in m.vision and not m.patch_dropout:
        m.patch_dropout = m.vision["patch_dropout"]


def _tokenizer(m: ModelConfig) -> None:
    """``model.tokenizer`` -> the text tower's vocab_size (unless given) and the file it records."""
    if m.tokenizer is None or not within_domain(m, "tokenizer") or not isinstance(m.text, dict):
        return
    from mmalign.errors import UsageError
    from mmalign.sentencepiece_file import SPM_KEY, sentencepiece_vocab_size

    try:
        needed = sentencepiece_vocab_size(m.tokenizer)
    except UsageError:
        return  # not a sentencepiece model: validate() says so
    m.text.setdefault("vocab_size", needed)
    m.text["tokenizer_kwargs"] = {SPM_KEY: str(Path(m.tokenizer).resolve())}
