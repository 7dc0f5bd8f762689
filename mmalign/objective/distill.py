"""The distillation term (``loss.distill.teacher`` / ``loss.distill.weight``): ``weight`` x the KL
divergence between a frozen teacher's and the student's softmax distributions over the global
batch, both directions (:mod:`mmalign.losses.distill`; open_clip's distillation loss), logged as
``distill_loss`` beside ``contrastive_loss``.

Where the teacher's features come from:

* :class:`LiveTeacher`: a model ``load()`` reads (a run, a folder, an export), loaded once,
  frozen, in eval mode on the training device.  It encodes the step's images (the student's
  crops, resized to the teacher's image size) and captions (tokenised with its own tokenizer)
  under ``torch.inference_mode()``.  The objective runs once
  per step on the whole local batch, also with gradient caching (the chunks' features are
  concatenated before the loss), so the teacher runs once per step, not once per chunk.
* :class:`StoredTeacher` (``loss.distill.teacher: stored``): the per-sample members
  ``teacher_image.npy``, ``teacher_text.npy`` and ``teacher_scale.npy`` that ``mmalign embed``
  writes into a copy of the shards, read by the loader into the Batch
  (:mod:`mmalign.data.teacher_members`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from mmalign.data.batch import Batch
from mmalign.data.device import normalize_pixels, unnormalize_images
from mmalign.data.teacher_members import STORED, check_teacher_members
from mmalign.dist import distributed as mdist
from mmalign.errors import ConfigError, UserError, first_line
from mmalign.losses.distill import distill_kl_local

from .base import StepContext, Term, TermOutput

__all__ = [
    "Distill",
    "LiveTeacher",
    "StoredTeacher",
    "KEY",
    "check_teacher",
    "teacher_autocast",
    "teacher_rows",
    "teacher_source",
]

log = logging.getLogger(__name__)

KEY = "loss.distill.teacher"
_PROBE = ["a photo of a dog.", "two birds on a wire"]  # what a teacher's tokenizer must encode at start-up


class StoredTeacher:
    """The teacher's features precomputed into the shards: the Batch's ``teacher_*`` fields."""

    batch_fields = ("teacher_image", "teacher_text", "teacher_scale")
    forwards = 0  # never runs a model

    def __call__(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        if batch.teacher_image is None or batch.teacher_text is None or batch.teacher_scale is None:
            raise ConfigError(
                f"config key '{KEY}': stored, but the batch has no teacher_image / teacher_text / "
                "teacher_scale (the loader reads them from the shards' .npy members)"
            )
        # every sample of one `mmalign embed` pass carries the same scale: the first row's is the step's
        return batch.teacher_image.float(), batch.teacher_text.float(), batch.teacher_scale.float()[0, 0]

    def __repr__(self) -> str:
        return "StoredTeacher()"


class LiveTeacher:
    """A frozen model that encodes each step's batch.

    Args:
        loaded: a :class:`mmalign.models.load.Loaded` (eval mode, on the training device).
        name: what the config named (for messages).
        autocast: ``() -> context`` the teacher's forwards run in (train.precision's), or None.
        rows: the most rows one teacher call encodes (0: the whole local batch); with gradient
            caching the chunk size, so the teacher's activations stay within the chunk's bound.
    """

    batch_fields = ("captions",)

    def __init__(
        self,
        loaded: Any,
        name: str,
        autocast: Callable[[], AbstractContextManager[Any]] | None = None,
        rows: int = 0,
    ):
        self.loaded, self.name, self.rows = loaded, name, max(0, int(rows))
        self.model = loaded.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)  # frozen: never in an optimizer, never a gradient
        self.autocast = autocast or nullcontext
        size = loaded.preprocess_cfg.get("size", self.model.image_size)
        self.size = tuple(size) if isinstance(size, (list, tuple)) else (int(size), int(size))
        self.interpolation = (
            "bilinear" if loaded.preprocess_cfg.get("interpolation") == "bilinear" else "bicubic"
        )
        self.forwards = 0  # teacher forwards so far (once per step: tested)
        self.check_tokenizer(_PROBE)

    def __repr__(self) -> str:
        return f"LiveTeacher({self.name!r}, image {self.size[0]}x{self.size[1]})"

    def tokens(self, captions: list[str]) -> Tensor:
        """(B, L) the teacher's token ids of ``captions``; a tokenizer that cannot: one line."""
        try:
            tokens: Tensor = self.loaded.tokenizer(captions)
            return tokens
        except (UserError, ValueError, TypeError, KeyError, IndexError, RuntimeError) as e:
            raise ConfigError(
                f"config key '{KEY}': the teacher {self.name}'s tokenizer cannot encode the captions "
                f"({type(e).__name__}: {first_line(e)})"
            ) from None

    def check_tokenizer(self, captions: list[str]) -> None:
        tokens = self.tokens(captions)
        if not torch.is_tensor(tokens) or tokens.ndim != 2 or tokens.shape[0] != len(captions):
            raise ConfigError(
                f"config key '{KEY}': the teacher {self.name}'s tokenizer returns no (N, L) ids"
            )

    def images(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) the student's normalised images -> (B, 3, H_T, W_T) the teacher's input.

        Every mmalign model takes CLIP-normalised input (a tower with other statistics, SigLIP's,
        converts inside itself), so only the size changes: resized as pixels, bicubic and
        antialiased, clamped to [0, 1] as an image would be, and normalised again."""
        if tuple(images.shape[-2:]) == self.size:  # the student's input as it is (exact)
            return images
        pixels = unnormalize_images(images)  # (B, 3, H, W) in [0, 1]
        resized = F.interpolate(pixels, size=self.size, mode=self.interpolation, antialias=True)
        return normalize_pixels(resized.clamp_(0, 1))  # (B, 3, H_T, W_T)

    def __call__(self, batch: Batch) -> tuple[Tensor, Tensor, Tensor]:
        if batch.captions is None:
            raise ValueError("a live teacher needs the batch's captions")
        device = batch.images.device
        tokens = self.tokens(list(batch.captions)).to(device)  # (B, L)
        n = len(batch)
        step = self.rows or n
        with torch.inference_mode(), self.autocast():  # every sample once, in pieces of `rows`
            image = torch.cat(
                [self.model.encode_image(self.images(batch.images[i : i + step])) for i in range(0, n, step)]
            )  # (B, D_T)
            text = torch.cat(
                [self.model.encode_text(tokens[i : i + step]) for i in range(0, n, step)]
            )  # (B, D_T)
            scale = self.model.logit_scale.exp()
        self.forwards += 1
        # ordinary tensors again (inference tensors cannot meet autograd), float32, unit length
        image, text = F.normalize(image.clone().float(), dim=-1), F.normalize(text.clone().float(), dim=-1)
        return image, text, scale.clone().float().reshape(())


class Distill(Term):
    """``weight`` x KL(teacher || student) over the global batch (logged as ``distill_loss``).

    ``teacher(batch) -> (image (B, D_T), text (B, D_T), scale)``: a :class:`LiveTeacher` or a
    :class:`StoredTeacher`; its features are gathered across ranks without grad."""

    name = "distill"
    embeddings = ("image", "text", "logit_scale")
    stat = "distill_loss"

    def __init__(self, teacher: LiveTeacher | StoredTeacher, weight: float = 1.0):
        if weight <= 0:
            raise ValueError(f"need weight > 0, got {weight}")
        self.teacher, self.weight = teacher, float(weight)
        self.batch_fields = tuple(teacher.batch_fields)

    def __repr__(self) -> str:
        return f"Distill({self.teacher!r}, weight={self.weight})"

    def __call__(self, ctx: StepContext) -> TermOutput:
        emb = ctx.emb
        assert emb.image is not None and emb.text is not None and emb.logit_scale is not None
        t_image, t_text, t_scale = self.teacher(ctx.batch)  # (B, D_T), (B, D_T), ()
        t_image, t_text = t_image.to(emb.image.device), t_text.to(emb.image.device)
        t_image_all, t_text_all = mdist.all_gather_nograd(t_image), mdist.all_gather_nograd(t_text)
        loss = distill_kl_local(
            emb.image,
            emb.text,
            ctx.gathered("image"),
            ctx.gathered("text"),
            emb.logit_scale,
            t_image,
            t_text,
            t_image_all,
            t_text_all,
            t_scale.to(emb.image.device),
        )
        stats = {
            self.stat: loss.detach().float().reshape(()),
            "teacher_scale": t_scale.detach().float().reshape(()),
        }
        return TermOutput(loss, stats if ctx.track else {})


def teacher_source(
    teacher: str,
    device: torch.device | str = "cpu",
    autocast: Callable[[], AbstractContextManager[Any]] | None = None,
    rows: int = 0,
) -> LiveTeacher | StoredTeacher:
    """``loss.distill.teacher``'s value -> where the teacher's features come from; a model that
    cannot be loaded is one ConfigError line naming the key. ``rows``: see :class:`LiveTeacher`."""
    if teacher == STORED:
        return StoredTeacher()
    from mmalign.models.hub import resolve
    from mmalign.models.load import load

    # a name (ARCH/TAG, hf-hub:, ORG/NAME) becomes its cached folder; its errors name the key
    path = resolve(teacher, KEY)
    try:
        loaded = load(path, device=device)
    except ConfigError:
        raise
    except UserError as e:
        raise ConfigError(f"config key '{KEY}': {first_line(e)}") from None
    live = LiveTeacher(loaded, teacher, autocast, rows)
    log.info(
        "distillation: teacher %s (embed_dim %d, image %dx%d, logit scale %.4g), frozen, inference mode",
        teacher,
        loaded.model.embed_dim,
        *live.size,
        loaded.logit_scale,
    )
    return live


def check_teacher(cfg: Any) -> None:
    """Before any rank starts (``mmalign train``): ``loss.distill.teacher`` names a model that
    exists (a path, or a name its cache resolves), or, ``stored``, shards whose first sample carries
    the teacher's members (local shards; remote ones are checked when the loader opens them)."""
    from mmalign.config import loss_rules

    if "distill" not in loss_rules.active_parts(cfg):
        return
    teacher = cfg.loss.distill.teacher
    if teacher == STORED:
        from mmalign.data.remote import kind_of
        from mmalign.data.shards import train_shard_lists

        urls = train_shard_lists(cfg.data)[0][0]
        if urls and kind_of(urls[0]) == "local":
            check_teacher_members(urls[:1], KEY, max_member=cfg.data.max_member_bytes)
        return
    from mmalign.models.hub import resolve

    if not resolve(teacher, KEY).exists():
        raise ConfigError(
            f"config key '{KEY}': {teacher} does not exist (a model folder, a run, or a model name)"
        )


def teacher_rows(chunk: int | str) -> int:
    """The teacher's rows per call from ``train.grad_cache_chunk_size``: the chunk when caching,
    pieces of 256 when ``auto`` decides later (it may cache), the whole batch when not caching."""
    if isinstance(chunk, int):
        return chunk
    return 256


def teacher_autocast(
    precision: str, device: torch.device | str
) -> Callable[[], AbstractContextManager[Any]] | None:
    """train.precision's autocast for the teacher's forwards (None in fp32)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return None
    kind = torch.device(device).type
    return lambda: torch.autocast(kind, dtype=dtype)
