"""The typed experiment configuration, declared: every key's type, default, domain, unit and
meaning in one place.

Each leaf is a :func:`~mmalign.config.checks.knob`: the annotation is its type (string modes
are ``Literal``), the metadata its domain (``rule``), ``unit`` and ``doc``.  The generic
validator (:func:`mmalign.config.checks.check_domains`) and the table of docs/configuration.md
(``python -m mmalign.config.doc``) both read this metadata, so a key is documented and checked
where it is declared.  The defaults are the embedded quickstart recipe: a run without any YAML
is a complete, working experiment.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from mmalign.config.checks import (
    BOUNDED_PAIR,
    COUNT,
    LOG_FLOAT32_MAX,
    MAX_LOCAL,
    NAME,
    OPEN_PROB,
    PATH,
    POSITIVE,
    PROB,
    RATE,
    Entries,
    Seq,
    ShardSpecs,
    Span,
    Text,
    Weights,
    knob,
)

MAX_MEMBER_BYTES = 64 << 20  # data.max_member_bytes' default: larger tar members are never read
LOCKED = "0 = the whole tower locked"
SEE_FT = " ([Fine-tuning](#fine-tuning))"


@dataclass
class ModelConfig:
    preset: str | None = knob(
        None,
        rule=Text(pattern=NAME, what="an architecture name (`mmalign models` lists them) or null"),
        doc="`tiny` (ViT), `tiny-rn` (ResNet, the quickstart's), `micro`, `micro-rn` "
        "(tests) or any open_clip architecture name; null = the architecture of "
        "`model.pretrained` when that carries one, else `tiny`",
    )
    embed_dim: int | None = knob(None, rule=POSITIVE, doc="the joint embedding size (null = the preset's)")
    image_size: int | None = knob(None, rule=POSITIVE, unit="pixels", doc="overrides `vision.image_size`")
    vision: dict[str, Any] = knob(
        {}, doc="merged into the preset's vision tower config (e.g. `layers`, `timm_model_name`)"
    )
    text: dict[str, Any] = knob(
        {}, doc="merged into the preset's text tower config (e.g. `layers`, `hf_local_dir`)"
    )
    quick_gelu: bool = knob(False, doc="open_clip's QuickGELU activation")
    init_logit_scale: float = knob(
        math.log(1 / 0.07),
        rule=Span(0, LOG_FLOAT32_MAX, note="the log of the logit scale; exp() must fit float32"),
        doc="log of the initial logit scale (CLIP: log(1/0.07))",
    )
    max_logit_scale: float = knob(
        100.0, rule=Span(1), doc="the scale is clamped to [1, this] after each step"
    )
    init_logit_bias: float | None = knob(
        None,
        rule=Span(note="SigLIP uses -10"),
        doc="SigLIP's initial logit bias (-10); null = no bias parameter",
    )
    tokenizer: str | None = knob(
        None,
        rule=PATH,
        doc="a sentencepiece `.model` (`mmalign tokenizer train`), which also sets the "
        "text tower's `vocab_size`; null = open_clip's CLIP BPE",
    )
    # Needed with caching or > 1 process (models/batchnorm.py).
    batchnorm: Literal["frozen", "sync", "local"] | None = knob(
        None,
        doc="BatchNorm towers (ResNets): `frozen` (running statistics, exact gradients), `sync` (statistics "
        "across ranks, per chunk under caching) or `local` (per chunk and rank); required with gradient "
        "caching or > 1 process; null = torch's BatchNorm (one process, no caching)",
    )
    # LiT (Zhai et al. 2022), through the tower's own lock().
    lock_image: bool = knob(
        False, doc="LiT: the image tower frozen, no optimizer state, no re-forward under caching" + SEE_FT
    )
    lock_image_unlocked_groups: int = knob(
        0, rule=Span(0, note=LOCKED), doc="the locked image tower's last N layer groups stay trainable"
    )
    lock_image_freeze_bn_stats: bool = knob(
        False, doc="the locked image tower's BatchNorm statistics frozen (sets `model.batchnorm: frozen`)"
    )
    lock_text: bool = knob(False, doc="LiT: the text tower frozen" + SEE_FT)
    lock_text_unlocked_layers: int = knob(
        0, rule=Span(0, note=LOCKED), doc="the locked text tower's last N layers stay trainable"
    )
    # Loaded after init and before locking (models/init_from.py).
    pretrained: str | None = knob(
        None,
        rule=PATH,
        doc="start from pretrained weights: an open_clip checkpoint file or local-dir "
        "folder, an HF CLIPModel folder, an mmalign model / run folder, or a model name "
        "(`ARCH/TAG`, `hf-hub:ORG/NAME`, `ORG/NAME`: [models by name](models.md))" + SEE_FT,
    )
    pretrained_image: str | None = knob(None, rule=PATH, doc="as `model.pretrained`, the image tower only")
    pretrained_text: str | None = knob(None, rule=PATH, doc="as `model.pretrained`, the text tower only")
    pretrained_strict: bool = knob(True, doc="false: missing / unexpected weights are logged, not refused")
    pretrained_resample: Literal["bicubic", "bilinear", "nearest", "area"] = knob(
        "bicubic",
        doc="how a ViT source's position embedding (and patch kernel) is resampled when "
        "`model.image_size` / `model.vision.patch_size` differ from the source's; bicubic "
        "equals timm's `resample_abs_pos_embed`",
    )
    timm_weights: str | None = knob(
        None,
        rule=PATH,
        doc="a local timm checkpoint (`.safetensors` / `.pth`) for a timm image tower "
        "(`model.vision.timm_model_name`); timm never downloads",
    )
    patch_dropout: float = knob(
        0.0,
        rule=Span(0, 1, hi_open=True, note="0 = off"),
        doc="FLIP: the fraction of a ViT's patch tokens dropped in training (the paper: 0.5-0.75)" + SEE_FT,
    )


@dataclass
class AugmentConfig:
    # Augmentation declares what the model learns to ignore; the shapes captions name
    # positions and colours, so the default keeps left/right, the colours and most of the frame.
    crop_scale: list[float] = knob(
        [0.85, 1.0],
        rule=Seq((Span(0, 1, lo_open=True),) * 2, ordered=True, what="[lo, hi] with 0 < lo <= hi <= 1"),
        doc="random-resized-crop area fraction",
    )
    crop_ratio: list[float] = knob(
        [0.75, 1.3333333333333333],
        rule=Seq((Span(1e-3, 1e3),) * 2, ordered=True, what=BOUNDED_PAIR),
        doc="random-resized-crop aspect ratio range",
    )
    hflip: bool = knob(False, doc="random horizontal flip")
    color_jitter: list[float] = knob(
        [0.0, 0.0, 0.0, 0.0],
        rule=Seq(
            (Span(0),) * 3 + (Span(0, 0.5),),
            what="[brightness, contrast, saturation, hue] >= 0 with hue <= 0.5",
        ),
        doc="colour jitter strengths: brightness, contrast, saturation, hue",
    )
    color_jitter_prob: float = knob(0.8, rule=PROB, doc="probability of the jitter (when any strength > 0)")
    grayscale_prob: float = knob(0.0, rule=PROB, doc="probability of a grayscale image")
    blur_prob: float = knob(0.0, rule=PROB, doc="probability of a gaussian blur")
    blur_sigma: list[float] = knob(
        [0.1, 2.0],
        rule=Seq((Span(1e-3, 1e3),) * 2, ordered=True, what=BOUNDED_PAIR),
        unit="pixels",
        doc="gaussian blur sigma range",
    )


@dataclass
class DataConfig:
    train: str | list[str] = knob(
        "data/shapes/train/{00000..00007}.tar",
        rule=ShardSpecs(),
        doc="WebDataset shard spec(s) in img2dataset layout (`::` joins specs); a list "
        "with `data.train_weights`: sources drawn with those weights",
    )
    train_weights: list[float] | None = knob(
        None, rule=Weights(), doc="one sampling weight per `data.train` source"
    )
    val: str = knob(
        "data/shapes/val/00000.tar",
        rule=Text(empty_ok=True, what="a shard spec ('' = none)"),
        doc="validation shards (the collapse probe); '' = none",
    )
    mode: Literal["resampled", "epoch"] = knob(
        "resampled",
        doc="`resampled` (shards with replacement, endless) "
        "or `epoch` (each sample once per epoch); either "
        "order is the same on any number of ranks and workers",
    )
    workers: int = knob(1, rule=Span(0, MAX_LOCAL, note="0 = in the main process"), doc="loader processes")
    # Which rows form a batch does not depend on it.
    worker_batch_size: int = knob(
        0,
        rule=Span(0, note="0 = automatic"),
        doc="rows per piece a loader worker sends (0 = the gradient-cache chunk, else "
        "min(local batch, 256)); the batches themselves do not depend on it",
    )
    shuffle_buffer: int = knob(
        1000,
        rule=Span(1, note="1 = no shuffling"),
        doc="samples held for shuffling, over the whole run: each row of the global batch "
        "(lane) holds ceil(this / global batch)",
    )
    views: int = knob(
        1, rule=Span(1, 2), doc="2 = a second augmented view per sample (image-image positives)"
    )
    id_field: str | None = knob(
        None,
        rule=Text(pattern=NAME, what="a .json field name or null"),
        doc="a `.json` id field for multi-positive targets (set from "
        "`loss.false_negative_ids` when that names a field)",
    )
    keep_keys: str | None = knob(
        None,
        rule=PATH,
        doc="a file of sample keys, one a line (`mmalign curate "
        "--keys-only`): only those samples train, the others are "
        "counted skips (`not_in_keep_keys`)",
    )
    decontaminate: str | None = knob(
        None,
        rule=Text(what="an evaluation set (a suite name, cb:DIR, a clip_benchmark folder or shards) or null"),
        doc="check at start-up how many of this evaluation set's images have near-duplicates "
        "(perceptual hash) in a sample of the training shards: a warning with the count, "
        "or a refusal with `data.decontaminate_strict`",
    )
    decontaminate_strict: bool = knob(
        False, doc="refuse to start when `data.decontaminate` finds any evaluation image in the shards"
    )
    decontaminate_samples: int = knob(
        10_000,
        rule=POSITIVE,
        doc="training samples the `data.decontaminate` check hashes (from a seeded sample of the shards)",
    )
    decontaminate_distance: int = knob(
        4,
        rule=Span(0, 63),
        unit="bits",
        doc="perceptual-hash distance (of 64 bits) at which a training image copies an evaluation image",
    )
    hard_negatives: int = knob(
        0,
        rule=Span(0, note="0 = off"),
        doc="k mined negative captions per image from `mmalign mine` (InfoNCE, image->text)",
    )
    max_image_pixels: int = knob(
        89_478_485,
        rule=POSITIVE,
        unit="pixels",
        doc="larger images are a counted skip (PIL's decompression-bomb limit)",
    )
    # Shards without a single usable sample must not loop forever.
    max_consecutive_skips: int = knob(
        10_000,
        rule=POSITIVE,
        doc="bad samples in a row before the run stops with one line giving the skip reasons",
    )
    max_member_bytes: int = knob(
        MAX_MEMBER_BYTES,
        rule=POSITIVE,
        unit="bytes",
        doc="a larger tar member is never read into memory; its sample is a counted skip",
    )
    # Remote shards: pipe:CMD, http(s)://, fsspec URLs.
    remote_retries: int = knob(5, rule=COUNT, doc="remote shard failures in a row before it is skipped")
    remote_backoff: float = knob(
        1.0, rule=Span(0, 3600), unit="seconds", doc="first retry backoff (doubling)"
    )
    remote_timeout: float = knob(
        60.0, rule=Span(1e-3, 86400), unit="seconds", doc="every remote wait's timeout"
    )
    augment: AugmentConfig = field(default_factory=AugmentConfig)


@dataclass
class TrainConfig:
    steps: int = knob(300, rule=POSITIVE, doc="optimizer steps (warmup then cosine)")
    global_batch_size: int = knob(128, rule=POSITIVE, doc="samples per step over all ranks")
    lr: float = knob(1e-3, rule=RATE, doc="peak learning rate")
    warmup_steps: int = knob(20, rule=Span(0, hi_key="train.steps"), doc="linear warmup steps")
    weight_decay: float = knob(0.1, rule=Span(0), doc="decoupled weight decay")
    betas: list[float] = knob(
        [0.9, 0.98],
        rule=Seq((OPEN_PROB,) * 2, what="[beta1, beta2], each in [0, 1)"),
        doc="Adam / LAMB betas",
    )
    eps: float = knob(1e-6, rule=Span(0, 1, lo_open=True), doc="Adam / LAMB epsilon")
    optimizer: Literal["adamw", "sgd", "lamb"] = knob("adamw", doc="`adamw`, `lamb` or `sgd`")
    momentum: float = knob(0.0, rule=OPEN_PROB, doc="SGD momentum")
    grad_clip: float = knob(0.0, rule=Span(0, note="0 = off"), doc="max global gradient norm")
    grad_cache_chunk_size: int | Literal["auto"] = knob(
        0,
        rule=Span(0, note="0 = off; or auto"),
        doc="exact gradient caching: 0 = off; K = forward K samples of the local batch at a time; `auto` = off "
        "while the step's measured activations plus the loss fit `train.memory_budget_gb`, else the largest "
        "balanced chunk that fits, the smallest over the ranks, logged (`mmalign/run/memory_plan.py`)",
    )
    memory_budget_gb: float = knob(
        0.0,
        rule=Span(0, note="0 = measured"),
        unit="GiB",
        doc="`grad_cache_chunk_size: auto` only: per process for a step's activations, "
        "loss and features; 0 = measured (CUDA: 85% of the free memory, CPU: half "
        "this process's share of the available RAM, less gradients and optimizer "
        "state)",
    )
    precision: Literal["fp32", "bf16", "fp16"] = knob(
        "fp32",
        doc="autocast dtype of the forward pass (`fp16` on GPU, with `deepspeed.precision: fp16`); "
        "weights, gradient sums and reductions stay fp32",
    )
    device: str = knob(
        "auto",
        rule=Text(pattern=r"auto|cpu|cuda(:\d+)?", what="auto, cpu, cuda or cuda:N"),
        doc="`auto`, `cpu`, `cuda` or `cuda:N`",
    )
    log_every: int = knob(10, rule=POSITIVE, doc="steps between `metrics.jsonl` / TensorBoard records")
    eval_every: int = knob(
        0,
        rule=Span(0, note="0 = only at the end"),
        doc="steps between evaluations of `eval.suite` (as an `eval.during` entry of it, but "
        "without metrics.jsonl records)",
    )
    checkpoint_every: int = knob(0, rule=Span(0, note="0 = none"), doc="steps between checkpoints")
    keep_checkpoints: int = knob(2, rule=COUNT, doc="step checkpoints kept (older ones pruned)")
    max_consecutive_skips: int = knob(5, rule=POSITIVE, doc="non-finite steps in a row before the run stops")
    threads: int = knob(0, rule=Span(0, MAX_LOCAL, note="0 = torch's default"), doc="torch intra-op threads")
    # Fine-tuning (mmalign/run/optim.py); the temperature / SigLIP bias always use train.lr.
    lr_image: float | None = knob(
        None,
        rule=Span(0, lo_open=True, note="or null for train.lr"),
        doc="the image tower's base learning rate" + SEE_FT,
    )
    lr_text: float | None = knob(
        None,
        rule=Span(0, lo_open=True, note="or null for train.lr"),
        doc="the text tower's base learning rate",
    )
    layer_decay: float = knob(
        1.0,
        rule=Span(0, 1, lo_open=True, note="1 = off"),
        doc="EVA-style layer-wise lr decay: layer i of L gets its tower's lr x decay^(L - i)",
    )
    grad_checkpointing: bool = knob(
        False, doc="recompute each transformer block's activations in the backward"
    )
    unmasked_steps: int = knob(
        0,
        rule=Span(0, hi_key="train.steps"),
        doc="FLIP's unmasked tuning: the last K steps without `model.patch_dropout`",
    )
    compile: bool = knob(False, doc="torch.compile the towers in place (the loss stays eager)" + SEE_FT)
    compile_backend: str = knob(
        "inductor",
        rule=Text(pattern=r"[A-Za-z_][\w.-]*", what="a torch.compile backend name (inductor, eager, ...)"),
        doc="torch's backend name: `inductor`; `aot_eager` / `eager` to debug without a C++ compiler",
    )
    tf32: bool = knob(
        True,
        doc="CUDA: float32 matmuls and cuDNN convolutions in TF32; false keeps them exact "
        "float32; no effect on CPU",
    )
    trim_text_padding: bool = knob(
        True,
        doc="cut each batch's trailing all-padding token columns before causal, "
        "EOT-pooled text towers: the same features and gradients, less compute "
        "(`mmalign/models/text_trim.py`)",
    )
    attention_kernel: Literal["auto", "default", "flash", "math", "flash_fp32"] = knob(
        "auto",
        doc="`auto`: torch's choice on CUDA and in fp32, on CPU under bf16 / fp16 the fastest measured of "
        "`flash`, `math`, `flash_fp32`; the others force one (`mmalign/models/attention_kernel.py`)",
    )
    ema_decay: float = knob(
        0.0,
        rule=Span(0, 1, hi_open=True, note="0 = off"),
        doc="keep an exponential moving average of the weights with this decay d (e.g. 0.999), "
        "saved in checkpoints and evaluated beside the raw weights" + SEE_FT,
    )
    ema_warmup: bool = knob(
        True, doc="`train.ema_decay`'s warm-up: step t uses min(d, (1 + t) / (10 + t))" + SEE_FT
    )


@dataclass
class DistillConfig:
    teacher: str | None = knob(
        None,
        rule=PATH,
        doc="a frozen teacher (any model `model.pretrained` takes, or `stored`: its embeddings "
        "precomputed into the shards by `mmalign embed`); null = no distillation" + SEE_FT,
    )
    weight: float = knob(
        1.0, rule=Span(0), doc="the distillation term's share: loss = contrastive + weight x KL" + SEE_FT
    )


@dataclass
class LossConfig:
    name: Literal["infonce", "siglip"] = knob("infonce", doc="`infonce` or `siglip`")
    tile_size: int | Literal["auto"] = knob(
        "auto",
        rule=Span(0, note="0 = untiled; or auto"),
        doc="0 = untiled, N = N x N tiles (Inf-CL), `auto` = untiled while the logits fit `loss.tile_budget_mb`, "
        "else the largest power-of-two tile that fits (`mmalign/losses/tile_choice.py`)",
    )
    tile_budget_mb: float = knob(
        256.0, rule=RATE, unit="MiB", doc="`loss.tile_size: auto` only: per process, for the logit matrices"
    )
    false_negative_ids: str = knob(
        "none",
        rule=Text(pattern=NAME, what="none, caption or a .json id field name"),
        doc="`none`, `caption` (same caption = positive) or a `.json` id field",
    )
    hard_negative_beta: float = knob(
        0.0, rule=Span(0), doc="InfoNCE: weight negatives by exp(beta * logit) (Robinson et al. 2021)"
    )
    debias_prior: float = knob(
        0.0, rule=OPEN_PROB, doc="InfoNCE: class prior tau+ of debiased InfoNCE (Chuang et al. 2020)"
    )
    positive_mask: Literal["none", "attribute_subset"] = knob(
        "none", doc="`attribute_subset`: a B x B positive mask decoded from `data.id_field`'s subset codes"
    )
    queue_size: int = knob(
        0,
        rule=Span(0, note="0 = off"),
        doc="MoCo momentum queue (He et al. 2020): past global batches from an EMA copy of the "
        "towers are extra InfoNCE negatives ([docs/pair_policies.md](docs/pair_policies.md))",
    )
    momentum: float = knob(
        0.995, rule=OPEN_PROB, doc="the queue encoder's EMA decay m: ema = m * ema + (1 - m) * online"
    )
    image_image_weight: float = knob(
        0.0,
        rule=Span(0),
        doc="+ weight x NT-Xent between the two views of each image (SimCLR / SLIP; needs `data.views: 2`)",
    )
    image_image_temperature: float = knob(0.1, rule=RATE, doc="the NT-Xent temperature (fixed)")
    distill: DistillConfig = field(default_factory=DistillConfig)


@dataclass
class DeepSpeedConfig:
    zero_stage: int = knob(
        0,
        rule=Span(0, 3),
        doc="ZeRO 0-3 (one process with fp32 weights runs 1-2 as 0; `mmalign/run/zero_stage.py`)",
    )
    # Distinct from train.precision, which is autocast around the forward pass.
    precision: Literal["fp32", "bf16", "fp16"] = knob(
        "fp32", doc="weight precision inside DeepSpeed (fp32 master weights kept by ZeRO)"
    )
    extra: dict[str, Any] = knob(
        {},
        doc="merged into the generated DeepSpeed config (e.g. "
        "`zero_optimization.overlap_comm`); keys mmalign derives from typed keys are refused",
    )


@dataclass
class EvalDuringConfig:
    """One entry of ``eval.during``: a suite evaluated on its own schedule while training."""

    suite: str = knob(
        rule=Text(pattern=NAME, what="a suite name or a suite YAML"),
        doc="a suite in `eval/` or a suite YAML, as `eval.suite` names one",
    )
    every: int = knob(rule=POSITIVE, unit="steps", doc="optimizer steps between its evaluations")
    limit: int | None = knob(
        None,
        rule=POSITIVE,
        unit="images",
        doc="a seeded random draw of this many images, as `mmalign eval --limit` draws "
        "them; null = the whole suite",
    )


@dataclass
class EvalConfig:
    suite: str = knob(
        "shapes",
        rule=Text(empty_ok=True, what="a suite name, a suite YAML or none"),
        doc="a suite in `eval/`, a suite YAML or `none`; its keys are checked like the config's "
        "(`mmalign/evaluation/suite_schema.py`)",
    )
    batch_size: int = knob(256, rule=POSITIVE, doc="evaluation batch size")
    # mmalign/run/in_run_eval.py: train.eval_every with eval.suite is the same as one entry
    during: list[EvalDuringConfig] = knob(
        [],
        rule=Entries(
            EvalDuringConfig, "a list of {suite, every >= 1 steps, limit >= 1 images or null} mappings"
        ),
        doc="suites evaluated while training, each every `every` steps (`limit`: on that many images); logged to "
        "`metrics.jsonl` and TensorBoard as `eval/<suite>/<task>/<metric>`; the final evaluation runs each "
        "whole ([What a run writes](#what-a-run-writes))",
    )


@dataclass
class MonitorConfig:
    probe_size: int = knob(
        256,
        rule=Span(0, note="0 = off"),
        doc="fixed probe batch (from `data.val`) for the collapse indicators",
    )
    min_dim_std: float = knob(
        0.01,
        rule=Span(0, 1, note="0 = no alarm"),
        doc="alarm when either modality's mean per-dimension std falls below",
    )
    min_effective_rank_frac: float = knob(
        0.05, rule=Span(0, 1, note="0 = no alarm"), doc="alarm when the effective rank < this x embed_dim"
    )
    peak_tflops: float = knob(
        0.0, rule=Span(0, note="0 = known GPUs only"), unit="TFLOP/s", doc="the device's peak, for MFU"
    )
    tensorboard: bool = knob(True, doc="TensorBoard event files")
    log_sample_keys: bool = knob(False, doc="`samples.jsonl`: the keys of every step's batch (data audits)")


@dataclass
class DistConfig:
    timeout_s: float = knob(
        0.0,
        rule=Span(0, 86400, note="0 = 600 s on GPU, 120 s on CPU"),
        unit="seconds",
        doc="longest wait of any collective (and the rendezvous) before a rank gives up on a "
        "lost peer with one line",
    )


@dataclass
class Config:
    seed: int = knob(0, rule=COUNT, doc="RNG seed")
    output: str = knob("runs/quickstart", rule=PATH, doc="run directory")
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    dist: DistConfig = field(default_factory=DistConfig)
