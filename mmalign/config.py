"""Typed experiment configuration: dataclasses <- YAML <- ``--set a.b=c`` overrides.

The dataclass defaults are the embedded default (the quickstart recipe), so a run
without any YAML is a complete, working experiment.  Every key is checked: an
unknown key, a value of the wrong type, a value outside the key's domain
(mmalign/config_checks.py) or an impossible combination raises
:class:`ConfigError` with a one-line message naming the key; the CLI turns it into
exit code 2.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml


from mmalign.config_checks import show_value
from mmalign.errors import ConfigError  # re-exported: the config's own error
from mmalign.resources import recipe_path


MAX_MEMBER_BYTES = 64 << 20  # data.max_member_bytes' default: larger tar members are never read


@dataclass
class ModelConfig:
    # A preset name: "tiny" (CPU-sized) or any open_clip architecture ("ViT-B-32", ...).
    # None: the architecture of model.pretrained when that carries one, else "tiny".
    preset: Optional[str] = None
    embed_dim: Optional[int] = None  # overrides the preset's joint embedding size
    image_size: Optional[int] = None  # overrides vision.image_size
    vision: dict = field(default_factory=dict)  # merged into the preset's vision_cfg
    text: dict = field(default_factory=dict)  # merged into the preset's text_cfg
    quick_gelu: bool = False
    init_logit_scale: float = math.log(1 / 0.07)  # log of the CLIP temperature 1/0.07
    max_logit_scale: float = 100.0  # the scale is clamped to [1, this] after each step
    init_logit_bias: Optional[float] = None  # SigLIP uses -10; None = no bias parameter
    # None = open_clip's CLIP BPE; else a sentencepiece .model (`mmalign tokenizer train`),
    # which also sets the text tower's vocab_size (validate() fills model.text).
    tokenizer: Optional[str] = None
    # BatchNorm towers (open_clip ResNets, tiny-rn): frozen = running statistics, never updated
    # (gradients exact under caching / ranks); sync = statistics of the same chunk of every rank;
    # local = each chunk's own rows ("ghost"). Needed with caching or > 1 process (models/batchnorm.py).
    batchnorm: Optional[Literal["frozen", "sync", "local"]] = None
    # LiT (Zhai et al. 2022): lock a tower's weights (no gradient, no optimiser state) through
    # the tower's own lock(); N > 0 leaves its last N layer groups (image) / layers (text)
    # trainable. A fully locked tower is forwarded once per step under gradient caching.
    lock_image: bool = False
    lock_image_unlocked_groups: int = 0
    lock_image_freeze_bn_stats: bool = False  # the image tower's BatchNorm: model.batchnorm=frozen
    lock_text: bool = False
    lock_text_unlocked_layers: int = 0
    # Pretrained weights from local files, loaded after init and before locking (models/init_from.py):
    # an open_clip checkpoint file (.pt/.bin/.safetensors), an open_clip local-dir folder, an HF
    # CLIPModel folder, or an mmalign model / run folder. The _image / _text keys load one tower.
    pretrained: Optional[str] = None
    pretrained_image: Optional[str] = None
    pretrained_text: Optional[str] = None
    pretrained_strict: bool = True  # false: missing / unexpected weights are logged, not refused
    # A timm image tower (model.vision.timm_model_name) starts from this local timm checkpoint
    # (.safetensors / .pth) instead of random init; timm never downloads (models/timm_tower.py).
    timm_weights: Optional[str] = None
    # FLIP (Li et al. 2023): drop this fraction of a ViT image tower's patch tokens in training
    # (open_clip's PatchDropout, a new random subset per sample and step; evaluation never masks).
    # 0 = off; the paper uses 0.5-0.75. train.unmasked_steps ends the run unmasked.
    patch_dropout: float = 0.0


@dataclass
class AugmentConfig:
    # Augmentation declares what the model learns to ignore; the shapes captions
    # name positions and colours, so the default keeps left/right (no flip), the
    # colours (no jitter, no grayscale) and most of the frame.
    crop_scale: list = field(default_factory=lambda: [0.85, 1.0])  # random-resized-crop area fraction
    crop_ratio: list = field(default_factory=lambda: [0.75, 1.3333333333333333])  # aspect ratio range
    hflip: bool = False
    color_jitter: list = field(default_factory=lambda: [0.0, 0.0, 0.0, 0.0])  # brightness, contrast, saturation, hue
    color_jitter_prob: float = 0.8  # probability of applying the jitter (when any strength > 0)
    grayscale_prob: float = 0.0
    blur_prob: float = 0.0
    blur_sigma: list = field(default_factory=lambda: [0.1, 2.0])  # gaussian blur sigma range (pixels)


@dataclass
class DataConfig:
    # A shard spec (``d/{00000..00099}.tar``; ``::`` joins specs) or a list of them.
    # With train_weights, each list entry is a source drawn with that weight.
    train: Union[str, list] = "data/shapes/train/{00000..00007}.tar"
    train_weights: Optional[list] = None
    val: str = "data/shapes/val/00000.tar"
    mode: Literal["resampled", "epoch"] = "resampled"  # shards with replacement (endless) | each sample once per epoch
    workers: int = 1
    # rows per piece a worker sends; the main process joins the pieces into the local batch
    # (which rows form a batch does not depend on it). 0 = the gradient-cache chunk, else
    # min(local batch, 256)
    worker_batch_size: int = 0
    shuffle_buffer: int = 1000  # samples held per worker for shuffling; 1 = no shuffling
    views: int = 1  # 2 adds a second augmented view ``images2`` for image-image positives
    id_field: Optional[str] = None  # a .json field yielding ``ids`` (false-negative-aware positives)
    # k mined negative captions per sample from .json "hard_negatives" (`mmalign mine`): batch
    # ``neg_tokens`` (B, k, L) + ``neg_mask``; extra image->text candidates (losses/mined.py). 0 = off.
    hard_negatives: int = 0
    max_image_pixels: int = 89_478_485  # PIL's decompression-bomb limit; larger images are skipped
    # Bad samples in a row (per loader slot) before the run stops with one line giving the skip
    # reasons: shards without a single usable sample must not loop forever.
    max_consecutive_skips: int = 10_000
    # a tar member larger than this is never read into memory; its sample is a counted skip
    max_member_bytes: int = MAX_MEMBER_BYTES
    # Remote shards (pipe:CMD, http(s)://, fsspec URLs): failures in a row before a shard is
    # skipped (unreadable_shard), the first backoff in seconds (doubling), and every wait's timeout.
    remote_retries: int = 5
    remote_backoff: float = 1.0
    remote_timeout: float = 60.0
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class TrainConfig:
    steps: int = 300
    global_batch_size: int = 128
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    betas: list = field(default_factory=lambda: [0.9, 0.98])
    eps: float = 1e-6
    optimizer: Literal["adamw", "sgd", "lamb"] = "adamw"
    momentum: float = 0.0  # sgd only
    grad_clip: float = 0.0  # max global grad norm; 0 = off
    # exact gradient caching: 0 = off, K = forward K samples at a time; auto = off while the local
    # batch fits train.memory_budget_gb, else the largest chunk that fits (mmalign/memory_plan.py)
    grad_cache_chunk_size: Union[int, Literal["auto"]] = 0
    # GiB per process for a step's activations + loss under grad_cache_chunk_size: auto; 0 = measured
    # (free GPU memory / this process's share of the available RAM, less gradients and optimizer state)
    memory_budget_gb: float = 0.0
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"  # autocast dtype of the forward pass
    device: str = "auto"  # auto | cpu | cuda
    log_every: int = 10
    eval_every: int = 0  # 0 = only at the end
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    max_consecutive_skips: int = 5  # non-finite steps in a row before the run stops
    threads: int = 0  # torch intra-op threads; 0 = torch's default
    # Fine-tuning (mmalign/optim.py): per-tower base learning rates (null = train.lr; the
    # temperature / SigLIP bias always use train.lr) and EVA-style layer-wise decay (1.0 = off:
    # layer i of a tower with layers 0..L gets its tower's lr x layer_decay^(L - i)).
    lr_image: Optional[float] = None
    lr_text: Optional[float] = None
    layer_decay: float = 1.0
    grad_checkpointing: bool = False  # recompute each transformer block's activations in the backward
    unmasked_steps: int = 0  # FLIP's unmasked tuning: the last K steps run without model.patch_dropout
    # torch.compile the towers in place (mmalign/compile.py; the loss stays eager); the backend
    # is torch's name: inductor (default), aot_eager / eager to debug without a C++ compiler.
    compile: bool = False
    compile_backend: str = "inductor"
    # CUDA only: float32 matmuls / convolutions in TF32 (10-bit mantissa inputs, float32 accumulation);
    # false keeps them exact float32 (mmalign/tf32.py). No effect on CPU.
    tf32: bool = True
    # Cut each batch's trailing all-padding token columns before the text tower (causal,
    # EOT-pooled towers only: the same features and gradients, less compute; models/text_trim.py).
    trim_text_padding: bool = True
    # The towers' attention kernel (models/attention_kernel.py): auto = torch's on CUDA and for
    # fp32, the fastest measured of flash / math / flash_fp32 on CPU under bf16 / fp16 autocast.
    attention_kernel: Literal["auto", "default", "flash", "math", "flash_fp32"] = "auto"


@dataclass
class LossConfig:
    name: Literal["infonce", "siglip"] = "infonce"
    # 0 = untiled, N = N x N tiles (Inf-CL), auto = untiled while the logits fit loss.tile_budget_mb,
    # else the largest power-of-two tile that fits (mmalign/losses/tile_choice.py)
    tile_size: Union[int, Literal["auto"]] = "auto"
    tile_budget_mb: float = 256.0  # MiB, per process; read by tile_size: auto only
    false_negative_ids: str = "none"  # none | caption | <a .json id field>
    hard_negative_beta: float = 0.0  # infonce: weight negatives by exp(beta * logit) (Robinson et al. 2021)
    debias_prior: float = 0.0  # infonce: class prior tau+ in [0, 1) of debiased InfoNCE (Chuang et al. 2020)
    positive_mask: str = "none"  # none | attribute_subset (B x B mask decoded from data.id_field's subset codes)
    # MoCo momentum queue (He et al. 2020): Q past global batches, encoded by an EMA copy of the
    # towers, are extra negatives in both directions (infonce, no beta / prior / mask). 0 = off.
    queue_size: int = 0
    momentum: float = 0.995  # EMA decay m of the queue's encoder: ema = m * ema + (1 - m) * online
    # + weight x NT-Xent between the two views of each image (SimCLR / SLIP; needs data.views: 2).
    image_image_weight: float = 0.0
    image_image_temperature: float = 0.1  # fixed NT-Xent temperature (SimCLR / SLIP use 0.1)


@dataclass
class DeepSpeedConfig:
    zero_stage: int = 0
    # Weight precision inside DeepSpeed (fp32 master weights kept by ZeRO); distinct
    # from train.precision, which is autocast around the forward pass.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Merged recursively into the generated ds config (DeepSpeed's own keys, e.g.
    # zero_optimization.overlap_comm); keys that mmalign derives from typed keys are refused.
    extra: dict = field(default_factory=dict)


@dataclass
class EvalConfig:
    suite: str = "shapes"  # a suite name from eval/, a path to a suite YAML, or "none" (no evaluation)
    batch_size: int = 256


@dataclass
class MonitorConfig:
    probe_size: int = 256  # fixed probe batch (from data.val) for collapse indicators; 0 = off
    min_dim_std: float = 0.01  # alarm when the mean per-dimension std of either modality falls below
    min_effective_rank_frac: float = 0.05  # alarm when effective rank < this x embed_dim
    peak_tflops: float = 0.0  # device peak for MFU; 0 = known GPUs only
    tensorboard: bool = True
    log_sample_keys: bool = False  # write samples.jsonl: the keys of every step's batch (data audits, tests)


@dataclass
class DistConfig:
    # Longest wait of any collective (and of the rendezvous store) before a rank gives up on a
    # lost peer with a one-line error; 0 = 600 s on GPU, 120 s on CPU (torch's default is 30 min).
    timeout_s: float = 0.0


@dataclass
class Config:
    seed: int = 0
    output: str = "runs/quickstart"
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    dist: DistConfig = field(default_factory=DistConfig)


# ---------------------------------------------------------------- building


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert the few lossless cases."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(f"config key '{key}': expected {' or '.join(map(_type_name, args))}, got {show_value(value)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"config key '{key}': expected one of {_type_name(tp)}, got {show_value(value)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {show_value(value)}")
        return _build(tp, value, key + ".")
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        list: lambda v: isinstance(v, list),
        dict: lambda v: isinstance(v, dict),
    }.get(tp)
    if ok is None:
        raise TypeError(f"unsupported annotation {tp!r} for {key}")
    if not ok(value):
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {show_value(value)}")
    if tp is float:  # nan/inf pass every "> 0" check and fail much later; so does an int too big for a float
        if isinstance(value, int) and abs(value) > 2**1023 or not math.isfinite(value):
            raise ConfigError(f"config key '{key}': expected a finite number, got {show_value(value)}")
        return float(value)
    return value


def _build(cls: type, data: dict, prefix: str = "") -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}' (valid: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    return cls(**kwargs)


def _set_path(tree: dict, dotted: str, value: Any) -> None:
    """Insert ``value`` at ``a.b.c`` in a nested dict, creating mappings on the way."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is not a mapping")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", yaml-parsed c).  ``c`` is parsed as YAML, so 3, 1e-3, true,
    [0.5, 1.0] and null work; the field's annotation then checks the result."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an int of > 4300 digits; deep [[[[...
        value = raw
    # "1e-3" is a string to YAML 1.1; a float field still deserves it.
    if isinstance(value, str):
        try:
            value = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            pass
    return key, value


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def load_config(path: Optional[str | Path] = None, overrides: list[str] | tuple = ()) -> Config:
    """Defaults <- YAML file <- overrides, then validation."""
    tree: dict = {}
    if path is not None:
        path = recipe_path(path)  # a file, or a shipped recipe's name (one line when neither)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except (ValueError, RecursionError) as e:  # an int of > 4300 digits; nesting deeper than Python's stack
            raise ConfigError(f"config file {path} is not a usable config ({type(e).__name__})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded
    for item in overrides:
        key, value = parse_override(item)
        _set_path(tree, key, value)
    cfg = _build(Config, tree)
    validate(cfg)
    return cfg


def validate(cfg: Config, world_size: int = 1) -> None:
    """Reject values outside a key's domain (mmalign/config_checks.py), then impossible
    combinations, with a message that names the key."""
    from mmalign.config_checks import check_domains

    check_domains(cfg)
    t = cfg.train
    if not 0 <= t.warmup_steps <= t.steps:
        raise ConfigError(f"config key 'train.warmup_steps' must be in [0, train.steps={t.steps}], got {t.warmup_steps}")
    if t.global_batch_size % world_size:
        raise ConfigError(
            f"config key 'train.global_batch_size'={t.global_batch_size} is not divisible by the world size {world_size}"
        )
    local = t.global_batch_size // world_size
    if t.grad_cache_chunk_size != "auto" and not 0 <= t.grad_cache_chunk_size <= local:
        raise ConfigError(
            f"config key 'train.grad_cache_chunk_size' must be in [0, local batch {local}] or auto, "
            f"got {t.grad_cache_chunk_size}"
        )
    if t.compile and cfg.deepspeed.zero_stage == 3:
        # torch.compile would trace ZeRO-3's parameter-gathering hooks and see empty partitions
        raise ConfigError("config key 'train.compile': not supported with deepspeed.zero_stage=3 (ZeRO-3's "
                          "parameter gathering cannot be traced); use zero_stage <= 2 or train.compile: false")
    if cfg.loss.positive_mask != "none" and cfg.data.id_field is None:
        raise ConfigError("config key 'loss.positive_mask' needs data.id_field naming the .json subset code "
                          "(e.g. subset_code)")
    from mmalign.objective import rules  # which loss terms combine: the objective's one table (no torch)

    rules.check(cfg, world_size)
    fn_ids = cfg.loss.false_negative_ids
    if fn_ids not in ("none", "caption"):
        # an id field: the loader must read it from each sample's .json
        if cfg.data.id_field is None:
            cfg.data.id_field = fn_ids
        elif cfg.data.id_field != fn_ids:
            raise ConfigError(f"config key 'loss.false_negative_ids'={fn_ids!r} differs from data.id_field="
                              f"{cfg.data.id_field!r}; they name the same .json field")
    if Path(cfg.output).exists() and not Path(cfg.output).is_dir():
        raise ConfigError(f"config key 'output': {cfg.output} exists and is not a directory")
    if cfg.loss.name == "siglip" and cfg.model.init_logit_bias is None:
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
    for key, lock in (("lock_image_unlocked_groups", "lock_image"), ("lock_image_freeze_bn_stats", "lock_image"),
                      ("lock_text_unlocked_layers", "lock_text")):
        if getattr(m, key) and not getattr(m, lock):
            raise ConfigError(f"config key 'model.{key}' needs model.{lock}: true")
    if m.lock_image and m.lock_text and not (m.lock_image_unlocked_groups or m.lock_text_unlocked_layers):
        raise ConfigError("config key 'model.lock_text': with model.lock_image both towers are fully locked and "
                          "only the temperature would train (unlock some groups or layers of one)")
    if m.lock_image_freeze_bn_stats:
        if m.batchnorm not in (None, "frozen"):
            raise ConfigError(f"config key 'model.lock_image_freeze_bn_stats' freezes the BatchNorm statistics, "
                              f"model.batchnorm={m.batchnorm} updates them: set one of them")
        m.batchnorm = "frozen"  # the same maths as open_clip's FrozenBatchNorm2d, torch's names kept


def _validate_pretrained(m: ModelConfig) -> None:
    """model.pretrained*: the paths exist (what they hold is read by mmalign.models.init_from);
    a folder carries an architecture, so only then may model.preset stay unset."""
    for key in ("pretrained", "pretrained_image", "pretrained_text"):
        path = getattr(m, key)
        if path is not None and not Path(path).exists():
            raise ConfigError(f"config key 'model.{key}': {path} does not exist")
    if m.pretrained is not None and (m.pretrained_image is not None or m.pretrained_text is not None):
        raise ConfigError("config key 'model.pretrained' loads both towers; model.pretrained_image / "
                          "model.pretrained_text load one: set one or the other")
    if m.preset is None and not (m.pretrained is not None and Path(m.pretrained).is_dir()):
        m.preset = "tiny"


def _validate_patch_dropout(cfg: Config) -> None:
    """FLIP keys (a tower without patch tokens is refused by mmalign.models.flip, at check_buildable)."""
    m, k = cfg.model, cfg.train.unmasked_steps
    if "patch_dropout" in m.vision:  # the tower key works too; model.patch_dropout then mirrors it
        if m.patch_dropout and m.patch_dropout != m.vision["patch_dropout"]:
            raise ConfigError(f"config key 'model.patch_dropout'={m.patch_dropout} differs from "
                              f"model.vision.patch_dropout={m.vision['patch_dropout']}: set one of them")
        m.patch_dropout = m.vision["patch_dropout"]
    p = m.patch_dropout
    if not (isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p < 1):
        raise ConfigError(f"config key 'model.patch_dropout' must be in [0, 1) (0 = off), got {p}")
    if not 0 <= k <= cfg.train.steps:
        raise ConfigError(f"config key 'train.unmasked_steps' must be in [0, train.steps={cfg.train.steps}], got {k}")
    if k and not p:
        raise ConfigError("config key 'train.unmasked_steps' needs model.patch_dropout > 0")


def _validate_tokenizer(cfg: Config) -> None:
    """``model.tokenizer`` -> the text tower's vocab_size and the tokenizer it records."""
    path = cfg.model.tokenizer
    if path is None:
        return
    from mmalign.data.tokenizer import SPM_KEY, sentencepiece_vocab_size
    from mmalign.errors import UsageError

    try:
        needed = sentencepiece_vocab_size(path)  # one line naming the path when it is not a sentencepiece model
    except UsageError as e:
        raise ConfigError(f"config key 'model.tokenizer': {e}") from None
    text = cfg.model.text
    given = text.get("vocab_size")
    if given is not None and given < needed:
        raise ConfigError(f"config key 'model.text.vocab_size'={given} is smaller than the tokenizer's {needed} ids")
    text.setdefault("vocab_size", needed)
    text["tokenizer_kwargs"] = {SPM_KEY: str(Path(path).resolve())}


def _validate_data(cfg: Config) -> None:
    """The data keys' combinations (each key's own range: mmalign/config_checks.py)."""
    d = cfg.data
    if d.train_weights is not None:
        w = d.train_weights
        if d.mode != "resampled":
            raise ConfigError("config key 'data.train_weights' needs data.mode=resampled (epoch mode reads every sample once)")
        if not isinstance(d.train, list) or len(w) != len(d.train):
            raise ConfigError(f"config key 'data.train_weights' needs one weight per entry of the data.train list, got {w}")


def _validate_extras(cfg: Config) -> None:
    """The image-image term needs its second view."""
    if cfg.loss.image_image_weight > 0 and cfg.data.views != 2:
        raise ConfigError("config key 'loss.image_image_weight' > 0 needs data.views: 2 (a second augmented view)")


def grad_accum_dtype(cfg: Config) -> Optional[str]:
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


def _accumulation_steps(cfg: Config, world_size: int) -> int:
    local = cfg.train.global_batch_size // world_size
    chunk = cfg.train.grad_cache_chunk_size
    if chunk == "auto":  # unknown until measured; checked again once resolved (memory_plan.resolved_config)
        return 1
    return -(-local // chunk) if chunk else 1


def _validate_precision(cfg: Config, world_size: int) -> None:
    ds, t = cfg.deepspeed, cfg.train
    if t.precision == "fp16" and ds.precision != "fp16":
        raise ConfigError("config key 'train.precision'=fp16 needs deepspeed.precision=fp16 (DeepSpeed's loss "
                          "scaler; fp16 gradients underflow without it): use train.precision=bf16")
    steps = _accumulation_steps(cfg, world_size)
    if ds.precision in ("bf16", "fp16") and ds.zero_stage == 0 and steps > 1:
        raise ConfigError(f"config key 'deepspeed.precision'={ds.precision} at deepspeed.zero_stage=0 would sum the "
                          f"{steps} gradient-cache chunks in {ds.precision} (DeepSpeed accumulates in fp32 only "
                          f"from ZeRO-1): use deepspeed.zero_stage>=1, or deepspeed.precision=fp32 with "
                          f"train.precision=bf16 (autocast)")


_DTYPE_NAMES = {"fp32": {"fp32", "float32", "float", "torch.float32"},
                "bf16": {"bf16", "bfloat16", "torch.bfloat16"},
                "fp16": {"fp16", "float16", "half", "torch.float16"}}


def _validate_deepspeed_extra(cfg: Config) -> None:
    """``deepspeed.extra`` must not contradict what mmalign derives from its typed keys
    (an equal value is allowed; the batch arithmetic is always mmalign's)."""
    ds, t = cfg.deepspeed, cfg.train
    accum = grad_accum_dtype(cfg) or ("fp32" if ds.precision == "fp32" else ds.precision)
    typed = {  # ds config path -> (the typed key to use, its value; None = always derived)
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

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = prefix + str(key)
            if isinstance(value, dict):
                if path in typed:
                    raise ConfigError(f"config key 'deepspeed.extra.{path}' must be a value, not a mapping")
                walk(value, path + ".")
                continue
            below = sorted({typed[name][0] for name in typed if name.startswith(path + ".")})
            if below:  # e.g. extra.bf16: true
                raise ConfigError(f"config key 'deepspeed.extra.{path}' must be a mapping (what mmalign derives "
                                  f"there is set by {', '.join(below)})")
            if path not in typed:
                continue
            use, want = typed[path]
            if path in ("data_types.grad_accum_dtype", "communication_data_type"):
                same = isinstance(value, str) and value in _DTYPE_NAMES[want]
            else:
                same = want is not None and isinstance(value, bool) == isinstance(want, bool) and value == want
            if not same:
                raise ConfigError(f"config key 'deepspeed.extra.{path}'={value!r} contradicts what mmalign derives "
                                  f"from {use}: set {use} instead")

    walk(cfg.deepspeed.extra, "")


def save_config(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))
