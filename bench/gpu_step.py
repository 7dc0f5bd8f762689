"""The training steps the GPU benches time: one builder each, so that bench/gpu_check.py (part 4)
and bench/gpu_vs_openclip.py measure the same mmalign step.  A helper module, not a script:

    from bench.gpu_step import MmalignStep, OpenClipStep, mmalign_config   # from the repository root
    step = MmalignStep(mmalign_config("ViT-B-16", 256), torch.device("cuda")); step(); step.close()
    step = OpenClipStep("ViT-B-16", 256, torch.device("cuda")); step(); step.close()

``MmalignStep`` is ``Engine.step(Batch(images, tokens), objective)`` with no autocast argument:
the engine enters ``train.precision``'s autocast itself, inside the module DeepSpeed calls (on
CUDA DeepSpeed 0.19.8 switches a caller's autocast off around the module, so wrapping the call
here would measure fp32 towers).  ``OpenClipStep`` is one step of open_clip_train's
``train_one_epoch`` with ``--precision amp_bf16``.  ``TowerDtypes`` records the dtype each
tower really produced.
"""

from __future__ import annotations

import contextlib
import gc
import math
import sys

import torch
import torch.nn.functional as F

SOT, EOT = 49406, 49407  # open_clip's tokenizer: start / end of text

# The one optimiser setting both tools get in bench/gpu_vs_openclip.py (open_clip_train's
# defaults for ViT training: betas (0.9, 0.98), eps 1e-6; weight decay 0.2).
LR, BETAS, EPS, WEIGHT_DECAY = 1e-4, (0.9, 0.98), 1e-6, 0.2


def full_captions(batch: int, image_size: int, context: int, device: torch.device, seed: int = 0):
    """Random inputs already on ``device``: images (B, 3, H, W) float32 ~ N(0, 1) (what the
    normalisation yields) and tokens (B, L) int64, every caption full length (SOT at 0, EOT at
    L-1, ids in [1, SOT) between: the argmax pooling finds the EOT), so that no padding is
    trimmed and both tools do the same FLOPs."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(batch, 3, image_size, image_size, generator=g)
    tokens = torch.randint(1, SOT, (batch, context), generator=g)
    tokens[:, 0], tokens[:, -1] = SOT, EOT
    return images.to(device), tokens.to(device)


def mmalign_config(preset: str, batch: int, *overrides: str):
    """The bench setting: fp32 weights under DeepSpeed ZeRO-0, bf16 autocast, AdamW with the shared
    LR/BETAS/EPS/WEIGHT_DECAY, no gradient caching, the untiled loss (as open_clip's ClipLoss),
    a constant learning rate (no warm-up: every timed step the same), TF32 on. ``overrides``
    (``key=value``) come last and win."""
    from mmalign.config import load_config

    return load_config(
        None,
        [
            f"model.preset={preset}",
            f"train.global_batch_size={batch}",
            "train.precision=bf16",
            "deepspeed.zero_stage=0",
            "deepspeed.precision=fp32",
            "train.optimizer=adamw",
            f"train.lr={LR}",
            f"train.betas=[{BETAS[0]}, {BETAS[1]}]",
            f"train.eps={EPS}",
            f"train.weight_decay={WEIGHT_DECAY}",
            "train.grad_cache_chunk_size=0",
            "train.warmup_steps=0",
            "train.steps=1000000",
            "loss.tile_size=0",
            "train.tf32=true",
            *overrides,
        ],
    )


class TowerDtypes:
    """The dtype of each tower's output features (after its projection, before the L2
    normalisation and before any float() cast), as the last forward produced them.

    Both tools' models call ``self.encode_image(x, normalize=True)`` / ``self.encode_text(...)``
    from their forward; ``install`` replaces these two methods on the instance by ones that run
    the original unnormalised, note the dtype and normalise as the original would (the same
    ops).  Not a forward hook: open_clip's CLIP projects its text features with a bare
    ``x @ text_projection`` (no module to hook), and its normalised features are no evidence
    (under CUDA autocast the norm runs in fp32, so they come out float32 either way).

    Installed before any torch.compile, so a compiled model traces the note too: a dict store,
    replayed by dynamo after the graph (no graph break).  The dict starts with both keys:
    dynamo guards on its emptiness, and an empty one at the first call meant a second full
    compile at the next (seen with aot_eager on CPU)."""

    def __init__(self) -> None:
        self.seen: dict[str, torch.dtype | None] = {"image": None, "text": None}  # keys fixed: see above

    def install(self, model: torch.nn.Module) -> TowerDtypes:
        for field, method in (("image", "encode_image"), ("text", "encode_text")):
            setattr(model, method, self._noting(field, getattr(model, method)))
        return self

    def _noting(self, field: str, encode):
        seen = self.seen

        def noted(x, normalize: bool = False):
            features = encode(x, normalize=False)  # (B, D)
            seen[field] = (
                features.dtype
            )  # a torch.dtype: a constant to dynamo (str() of it would break the graph)
            return F.normalize(features, dim=-1) if normalize else features

        return noted

    def describe(self) -> str:
        return " / ".join("?" if d is None else str(d).removeprefix("torch.") for d in self.seen.values())


@contextlib.contextmanager
def tf32_on(device: torch.device):
    """TF32 for CUDA's fp32 matmuls and convolutions (mmalign.run.tf32.set_tf32, what train.tf32 does),
    the previous setting restored after; nothing on the CPU."""
    from mmalign.run.tf32 import set_tf32

    if torch.device(device).type != "cuda":
        yield
        return
    matmul, conv = torch.backends.cuda.matmul, getattr(torch.backends.cudnn, "conv", None)
    new_api = hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision")
    before = (
        (matmul.fp32_precision, conv.fp32_precision)
        if new_api
        else (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    )
    set_tf32(device, True)
    try:
        yield
    finally:
        try:
            if new_api:
                matmul.fp32_precision, conv.fp32_precision = before
            else:
                matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
        except (RuntimeError, ValueError) as e:  # a restore must not turn a finished bench into a failure
            print(f"gpu_step.tf32_on: could not restore the TF32 setting ({e})", file=sys.stderr)


class MmalignStep:
    """``step()`` = one ``Engine.step`` of ``cfg`` on one fixed batch on ``device``.

    ``inputs(batch, image_size, context_length) -> (images, tokens)`` on the device makes the batch
    (default :func:`full_captions`).  ``flops`` (with ``count_flops``): the model's training FLOPs
    per sample (mmalign.run.monitors), counted before the engine wraps it.  ``dtypes``: the towers'
    output dtypes (:class:`TowerDtypes`).  ``close()`` frees the engine and its device memory."""

    def __init__(self, cfg, device: torch.device, inputs=None, seed: int = 0, count_flops: bool = False):
        from mmalign.data.batch import Batch
        from mmalign.models import build_model
        from mmalign.objective import build_objective
        from mmalign.run.engine import Engine

        torch.manual_seed(seed)
        model = build_model(cfg.model).to(device)
        self.flops = None
        if count_flops:
            from mmalign.run.monitors import train_flops_per_sample

            self.flops = train_flops_per_sample(model, model.image_size, model.context_length)
        if inputs is None:

            def inputs(n, size, context):
                return full_captions(n, size, context, device, seed)

        images, tokens = inputs(cfg.train.global_batch_size, model.image_size, model.context_length)
        self.dtypes = TowerDtypes().install(model)  # before the engine compiles the towers
        self.engine = Engine(model, cfg)  # train.compile=true compiles the towers here (lazily)
        self.objective = build_objective(cfg)
        self.batch = Batch(images, tokens)  # (B, 3, H, W) float32, (B, L) int64, on the device
        self.engine.train_mode()

    def __call__(self):
        # no autocast argument: the engine enters train.precision's inside DeepSpeed's module call
        return self.engine.step(self.batch, self.objective)

    def close(self) -> None:
        for name in ("engine", "objective", "batch"):
            self.__dict__.pop(name, None)
        free_device_memory()


class OpenClipStep:
    """One step of open_clip_train's ``train_one_epoch`` (no accumulation, ``amp_bf16``) on a fixed
    batch: the lr set (its scheduler; constant here), zero_grad, forward + ``ClipLoss`` under bf16
    autocast, backward, ``AdamW.step`` over its two parameter groups, the logit-scale clamp.
    ``backend``: ``torch.compile(model)`` with it (open_clip_train's ``--torchcompile``); None = eager."""

    def __init__(
        self, preset: str, batch: int, device: torch.device, backend: str | None = None, seed: int = 0
    ):
        from open_clip.loss import ClipLoss

        torch.manual_seed(seed)
        self.model = _openclip_model(preset).to(device)
        self.model.train()
        size = self.model.visual.image_size
        self.images, self.tokens = full_captions(
            batch, size if isinstance(size, int) else size[0], self.model.context_length, device, seed
        )
        self.dtypes = TowerDtypes().install(self.model)  # before torch.compile: the compiled graph notes too
        self.run = torch.compile(self.model, backend=backend) if backend else self.model
        self.loss = ClipLoss(
            local_loss=False, gather_with_grad=False, cache_labels=True, rank=0, world_size=1
        )
        self.opt = torch.optim.AdamW(openclip_param_groups(self.model), lr=LR, betas=BETAS, eps=EPS)
        self.device_type = torch.device(device).type

    def __call__(self) -> None:
        for group in self.opt.param_groups:  # open_clip_train's scheduler(step): a constant lr here
            group["lr"] = LR
        self.opt.zero_grad(set_to_none=True)
        with torch.autocast(self.device_type, dtype=torch.bfloat16):  # get_autocast("amp_bf16")
            out = self.run(self.images, self.tokens)  # dict: image_features, text_features, logit_scale
            total = sum(self.loss(**out, output_dict=True).values())
        total.backward()
        self.opt.step()
        with torch.no_grad():  # "we clamp to 4.6052 = ln(100), as in the original paper"
            self.model.logit_scale.clamp_(0, math.log(100))

    def close(self) -> None:
        self.__dict__.clear()
        free_device_memory()


def _openclip_model(preset: str):
    """open_clip's CLIP at ``preset``, random init (no download): an open_clip architecture by name,
    or one of mmalign's own presets (micro, tiny) built as open_clip's CLIP from the same dict."""
    import open_clip

    from mmalign.models.presets import PRESETS, preset_arch

    if preset in PRESETS:
        return open_clip.CLIP(**preset_arch(preset), output_dict=True)
    return open_clip.create_model(preset, pretrained=None, output_dict=True)


def openclip_param_groups(model: torch.nn.Module) -> list[dict]:
    """open_clip_train/main.py's two AdamW groups: no weight decay for tensors with ndim < 2 and for
    names containing bn / ln / bias / logit_scale, WEIGHT_DECAY for the rest."""

    def exempt(n, p):
        return p.ndim < 2 or "bn" in n or "ln" in n or "bias" in n or "logit_scale" in n

    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for n, p in named if exempt(n, p)], "weight_decay": 0.0},
        {"params": [p for n, p in named if not exempt(n, p)], "weight_decay": WEIGHT_DECAY},
    ]


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
