"""The typed experiment configuration: load -> resolve -> validate, once.

The keys, their types, defaults, domains and meanings are declared in
:mod:`mmalign.config.schema` (docs/configuration.md's table is generated from them); YAML and
``--set a.b=c`` are read by :mod:`mmalign.config.load`.  :func:`load_config` then runs

* :func:`resolve` (:mod:`mmalign.config.resolve`): the derived values, filled in place;
* :func:`validate`: pure. Every key within its domain (the one generic validator,
  :func:`mmalign.config.checks.check_domains`, reading each field's metadata), then the
  impossible combinations, at the world size the run trains at.

Every refusal is a one-line :class:`ConfigError` naming the key; the CLI turns it into exit
code 2.  The CLI passes the world size to :func:`load_config`, so a run validates once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from mmalign.config.checks import check_domains, check_key, fields_of, model_name_form
from mmalign.config.load import build_config, parse_override
from mmalign.config.resolve import resolve
from mmalign.config.schema import (
    MAX_MEMBER_BYTES,
    AugmentConfig,
    Config,
    DataConfig,
    DeepSpeedConfig,
    DistConfig,
    DistillConfig,
    EvalConfig,
    LossConfig,
    ModelConfig,
    MonitorConfig,
    TrainConfig,
)
from mmalign.errors import ConfigError  # re-exported: the config's own error

__all__ = [
    "MAX_MEMBER_BYTES",
    "AugmentConfig",
    "DistillConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DeepSpeedConfig",
    "DistConfig",
    "EvalConfig",
    "LossConfig",
    "ModelConfig",
    "MonitorConfig",
    "TrainConfig",
    "build_config",
    "grad_accum_dtype",
    "load_config",
    "parse_override",
    "resolve",
    "save_config",
    "to_dict",
    "validate",
    "validate_chunk",
]


_FIELDS = {key: f for key, _, f in fields_of(Config)}


def to_dict(cfg: Any) -> dict[str, Any]:
    import dataclasses

    return dataclasses.asdict(cfg)


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (), world_size: int = 1
) -> Config:
    """Defaults <- YAML file <- overrides, then :func:`resolve` and :func:`validate` at
    ``world_size`` (the number of ranks the run trains on)."""
    cfg = build_config(path, overrides)
    resolve(cfg)
    validate(cfg, world_size)
    return cfg


def valid_world_sizes(batch: int) -> str:
    """The world sizes a global batch of ``batch`` rows allows (its divisors), for a message."""
    divisors = [str(d) for d in range(1, batch + 1) if batch % d == 0]
    shown = divisors if len(divisors) <= 12 else divisors[:6] + ["..."] + divisors[-3:]
    return f"the world sizes it allows are {', '.join(shown)}"


def validate(cfg: Config, world_size: int = 1) -> None:
    """Reject values outside a key's domain (its metadata), then impossible combinations, with
    a message that names the key.  Pure: reads ``cfg`` (and the files its paths name), never
    changes it; expects :func:`resolve` to have filled the derived values."""
    check_domains(cfg)
    t = cfg.train
    if t.global_batch_size % world_size:
        # rank r reads rows [r B/W, (r+1) B/W) of every global batch (mmalign/data/stream.py)
        raise ConfigError(
            f"config key 'train.global_batch_size'={t.global_batch_size} is not divisible by the world "
            f"size {world_size}: {valid_world_sizes(t.global_batch_size)}"
        )
    _validate_chunk_range(cfg, world_size)
    if t.compile and cfg.deepspeed.zero_stage == 3:
        # torch.compile would trace ZeRO-3's parameter-gathering hooks and see empty partitions
        raise ConfigError(
            "config key 'train.compile': not supported with deepspeed.zero_stage=3 (ZeRO-3's "
            "parameter gathering cannot be traced); use zero_stage <= 2 or train.compile: false"
        )
    if cfg.loss.positive_mask != "none" and cfg.data.id_field is None:
        raise ConfigError(
            "config key 'loss.positive_mask' needs data.id_field naming the .json subset code "
            "(e.g. subset_code)"
        )
    from mmalign.config import loss_rules as rules  # which loss terms combine: one table (no torch)

    rules.check(cfg, world_size)
    fn_ids = cfg.loss.false_negative_ids
    if fn_ids not in ("none", "caption"):
        # an id field: the loader reads it from each sample's .json (resolve() copies it to data.id_field)
        if cfg.data.id_field is not None and cfg.data.id_field != fn_ids:
            raise ConfigError(
                f"config key 'loss.false_negative_ids'={fn_ids!r} differs from data.id_field="
                f"{cfg.data.id_field!r}; they name the same .json field"
            )
    if Path(cfg.output).exists() and not Path(cfg.output).is_dir():
        raise ConfigError(f"config key 'output': {cfg.output} exists and is not a directory")
    if cfg.loss.name == "siglip" and cfg.model.init_logit_bias is None and cfg.model.pretrained is None:
        # a model.pretrained carries its bias (SigLIP), or build_objective refuses in one line
        raise ConfigError("config key 'model.init_logit_bias' must be set for loss.name=siglip (e.g. -10)")
    _validate_lock(cfg.model)
    _validate_pretrained(cfg.model)
    _validate_patch_dropout(cfg)
    _validate_data(cfg)
    _validate_extras(cfg)
    _validate_tokenizer(cfg)
    _validate_precision(cfg, world_size)
    _validate_deepspeed_extra(cfg)


def _validate_lock(m: ModelConfig) -> None:
    """LiT keys (the towers' lock() is applied by mmalign.models.build_model)."""
    for key, lock in (
        ("lock_image_unlocked_groups", "lock_image"),
        ("lock_image_freeze_bn_stats", "lock_image"),
        ("lock_text_unlocked_layers", "lock_text"),
    ):
        if getattr(m, key) and not getattr(m, lock):
            raise ConfigError(f"config key 'model.{key}' needs model.{lock}: true")
    if m.lock_image and m.lock_text and not (m.lock_image_unlocked_groups or m.lock_text_unlocked_layers):
        raise ConfigError(
            "config key 'model.lock_text': with model.lock_image both towers are fully locked and "
            "only the temperature would train (unlock some groups or layers of one)"
        )
    if m.lock_image_freeze_bn_stats:
        if m.batchnorm not in (None, "frozen"):
            raise ConfigError(
                f"config key 'model.lock_image_freeze_bn_stats' freezes the BatchNorm statistics, "
                f"model.batchnorm={m.batchnorm} updates them: set one of them"
            )


def _validate_pretrained(m: ModelConfig) -> None:
    """model.pretrained*: the paths exist, or the values are model names (mmalign.models.hub
    resolves those; what either holds is read by mmalign.models.init_from)."""
    for key in ("pretrained", "pretrained_image", "pretrained_text"):
        path = getattr(m, key)
        if path is not None and not Path(path).exists() and not model_name_form(path):
            raise ConfigError(f"config key 'model.{key}': {path} does not exist")
    if m.pretrained is not None and (m.pretrained_image is not None or m.pretrained_text is not None):
        raise ConfigError(
            "config key 'model.pretrained' loads both towers; model.pretrained_image / "
            "model.pretrained_text load one: set one or the other"
        )


def _validate_patch_dropout(cfg: Config) -> None:
    """FLIP keys (a tower without patch tokens is refused by mmalign.models.flip, at check_buildable)."""
    m, k = cfg.model, cfg.train.unmasked_steps
    p = m.patch_dropout
    if "patch_dropout" in m.vision:  # the tower key works too; resolve() mirrors it in model.patch_dropout
        if p and p != m.vision["patch_dropout"]:
            raise ConfigError(
                f"config key 'model.patch_dropout'={p} differs from "
                f"model.vision.patch_dropout={m.vision['patch_dropout']}: set one of them"
            )
        p = m.vision["patch_dropout"]
    check_key("model.patch_dropout", p, _FIELDS["model.patch_dropout"])  # the vision key's value, unresolved
    if k and not p:
        raise ConfigError("config key 'train.unmasked_steps' needs model.patch_dropout > 0")


def _validate_tokenizer(cfg: Config) -> None:
    """``model.tokenizer`` is a sentencepiece model whose ids fit the text tower (resolve() set
    the tower's vocab_size from it, unless the config gives one)."""
    path = cfg.model.tokenizer
    if path is None:
        return
    from mmalign.errors import UsageError
    from mmalign.sentencepiece_file import sentencepiece_vocab_size

    try:
        needed = sentencepiece_vocab_size(
            path
        )  # one line naming the path when it is not a sentencepiece model
    except UsageError as e:
        raise ConfigError(f"config key 'model.tokenizer': {e}") from None
    given = cfg.model.text.get("vocab_size")
    if isinstance(given, (int, float)) and not isinstance(given, bool) and given < needed:
        raise ConfigError(
            f"config key 'model.text.vocab_size'={given} is smaller than the tokenizer's {needed} ids"
        )


def _validate_data(cfg: Config) -> None:
    """The data keys' combinations (each key's own range: mmalign/config/checks.py)."""
    d = cfg.data
    if d.train_weights is not None:
        w = d.train_weights
        if d.mode != "resampled":
            raise ConfigError(
                "config key 'data.train_weights' needs data.mode=resampled (epoch mode reads every sample once)"
            )
        if not isinstance(d.train, list) or len(w) != len(d.train):
            raise ConfigError(
                f"config key 'data.train_weights' needs one weight per entry of the data.train list, got {w}"
            )


def _validate_extras(cfg: Config) -> None:
    """The image-image term needs its second view."""
    if cfg.loss.image_image_weight > 0 and cfg.data.views != 2:
        raise ConfigError(
            "config key 'loss.image_image_weight' > 0 needs data.views: 2 (a second augmented view)"
        )


def grad_accum_dtype(cfg: Config) -> str | None:
    """The ``data_types.grad_accum_dtype`` mmalign asks DeepSpeed for (None: DeepSpeed's default,
    the weight dtype).

    DeepSpeed 0.19.8 sums the micro-step gradients (one per gradient-cache chunk) in the
    weight dtype unless told otherwise, so bf16/fp16 weights get fp32 accumulation. At
    ZeRO-0 DeepSpeed cannot accumulate low-precision weights in fp32 (NotImplementedError);
    there validation only lets one micro-step per update through, where nothing is summed.
    """
    if cfg.deepspeed.precision in ("bf16", "fp16") and cfg.deepspeed.zero_stage >= 1:
        return "fp32"
    return None


def _validate_chunk_range(cfg: Config, world_size: int) -> None:
    t = cfg.train
    local = t.global_batch_size // world_size
    if t.grad_cache_chunk_size != "auto" and not 0 <= t.grad_cache_chunk_size <= local:
        raise ConfigError(
            f"config key 'train.grad_cache_chunk_size' must be in [0, local batch {local}] or auto, "
            f"got {t.grad_cache_chunk_size}"
        )


def validate_chunk(cfg: Config, world_size: int) -> None:
    """The checks that read ``train.grad_cache_chunk_size``, for the integer chunk ``auto``
    became at run time (mmalign.run.memory_plan.resolved_config); the rest of ``cfg`` was
    validated at load and is not checked again."""
    _validate_chunk_range(cfg, world_size)
    _validate_precision(cfg, world_size)


def _accumulation_steps(cfg: Config, world_size: int) -> int:
    local = cfg.train.global_batch_size // world_size
    chunk = cfg.train.grad_cache_chunk_size
    if chunk == "auto":  # unknown until measured; checked by validate_chunk once chosen (memory_plan.py)
        return 1
    return -(-local // chunk) if chunk else 1


def _validate_precision(cfg: Config, world_size: int) -> None:
    ds, t = cfg.deepspeed, cfg.train
    if t.precision == "fp16" and ds.precision != "fp16":
        raise ConfigError(
            "config key 'train.precision'=fp16 needs deepspeed.precision=fp16 (DeepSpeed's loss "
            "scaler; fp16 gradients underflow without it): use train.precision=bf16"
        )
    steps = _accumulation_steps(cfg, world_size)
    if ds.precision in ("bf16", "fp16") and ds.zero_stage == 0 and steps > 1:
        raise ConfigError(
            f"config key 'deepspeed.precision'={ds.precision} at deepspeed.zero_stage=0 would sum the "
            f"{steps} gradient-cache chunks in {ds.precision} (DeepSpeed accumulates in fp32 only "
            f"from ZeRO-1): use deepspeed.zero_stage>=1, or deepspeed.precision=fp32 with "
            f"train.precision=bf16 (autocast)"
        )


_DTYPE_NAMES = {
    "fp32": {"fp32", "float32", "float", "torch.float32"},
    "bf16": {"bf16", "bfloat16", "torch.bfloat16"},
    "fp16": {"fp16", "float16", "half", "torch.float16"},
}


def _validate_deepspeed_extra(cfg: Config) -> None:
    """``deepspeed.extra`` must not contradict what mmalign derives from its typed keys
    (an equal value is allowed; the batch arithmetic is always mmalign's)."""
    ds, t = cfg.deepspeed, cfg.train
    accum = grad_accum_dtype(cfg) or ("fp32" if ds.precision == "fp32" else ds.precision)
    # ds config path -> (the typed key to use, its value; None = always derived)
    typed: dict[str, tuple[str, object]] = {
        "zero_optimization.stage": ("deepspeed.zero_stage", ds.zero_stage),
        "bf16.enabled": ("deepspeed.precision", ds.precision == "bf16"),
        "bfloat16.enabled": ("deepspeed.precision", ds.precision == "bf16"),
        "fp16.enabled": ("deepspeed.precision", ds.precision == "fp16"),
        "data_types.grad_accum_dtype": ("deepspeed.precision", accum),
        "communication_data_type": ("deepspeed.precision", "fp32"),
        "gradient_clipping": ("train.grad_clip", float(t.grad_clip)),
        "train_batch_size": ("train.global_batch_size", None),
        "train_micro_batch_size_per_gpu": ("train.grad_cache_chunk_size", None),
        "gradient_accumulation_steps": ("train.grad_cache_chunk_size", None),
    }

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            path = prefix + str(key)
            if isinstance(value, dict):
                if path in typed:
                    raise ConfigError(f"config key 'deepspeed.extra.{path}' must be a value, not a mapping")
                walk(value, path + ".")
                continue
            below = sorted({typed[name][0] for name in typed if name.startswith(path + ".")})
            if below:  # e.g. extra.bf16: true
                raise ConfigError(
                    f"config key 'deepspeed.extra.{path}' must be a mapping (what mmalign derives "
                    f"there is set by {', '.join(below)})"
                )
            if path not in typed:
                continue
            use, want = typed[path]
            if path in ("data_types.grad_accum_dtype", "communication_data_type"):
                same = isinstance(value, str) and isinstance(want, str) and value in _DTYPE_NAMES[want]
            else:
                same = (
                    want is not None and isinstance(value, bool) == isinstance(want, bool) and value == want
                )
            if not same:
                raise ConfigError(
                    f"config key 'deepspeed.extra.{path}'={value!r} contradicts what mmalign derives "
                    f"from {use}: set {use} instead"
                )

    walk(cfg.deepspeed.extra, "")


def save_config(cfg: Config, path: str | Path) -> None:
    """The resolved config as YAML (``load_config`` reads it back to an equal config)."""
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
