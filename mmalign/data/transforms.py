"""Image preprocessing.

The eval transform is open_clip's (resize the shortest side, centre crop, CLIP
normalisation).  The train transform adds only the augmentations the config
declares: every augmentation is a statement of what the model learns to ignore.

The train transform draws all of its random parameters from a ``random.Random``
passed per call, never from torch's global RNG: the loader seeds that generator
per sample, so a resumed run reproduces the very same crops and flips, and
``workers=0`` leaves the training process's RNG untouched.

The train transform's :meth:`TrainTransform.raw` output is uint8: the loader ships
uint8 batches (4x smaller than float32) and normalises on the training device
(:mod:`mmalign.data.device`).  Calling the transform gives the normalised float
tensor, element for element the same numbers.

A JPEG much larger than the target is decoded at 1/2, 1/4 or 1/8 scale (libjpeg's
DCT scaling, PIL's ``draft``) when every crop the transform can draw stays at
least the target size there: the result is close to, not equal to, the full decode
(tests/data/test_data_transforms_decode.py states the bound).

The eval transform refuses an image thinner than ``image_shape.MAX_ASPECT``:1 before its
resize (:class:`ImageShapeError`), whoever decoded it: the resize scales the shorter side.
"""

from __future__ import annotations

import math
import random

import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image, ImageFilter
from torchvision import transforms as T
from torchvision.transforms import functional as F

from mmalign.config import AugmentConfig
from mmalign.data.image_shape import ImageShapeError, shape_problem

_fallback_rng = random.Random(0)  # only for callers that pass no generator
DRAFT = "mmalign_draft"  # image.info key: (full width, full height, DCT scale) of a drafted JPEG


def _check_shape(image):
    """The eval transform's first step: a thin image never reaches Resize, whoever decoded it."""
    if isinstance(image, Image.Image):
        why = shape_problem(*image.size)
        if why is not None:
            raise ImageShapeError(why)
    return image


def draft_scale(min_side: float, target: int) -> int:
    """The largest JPEG DCT scale (8, 4, 2; 1 = none) that keeps ``min_side`` >= ``target`` pixels."""
    for scale in (8, 4, 2):
        if min_side / scale >= target:
            return scale
    return 1


def draft_jpeg(image: Image.Image, min_side: float, target: int) -> int:
    """Before decoding: let a JPEG decode at the largest scale that keeps ``min_side`` (in full-size
    pixels) >= ``target``; returns the scale used (1: none, e.g. not a JPEG, already decoded or
    not large enough).  ``image.info[DRAFT]`` records the full size and scale for the crop."""
    width, height = image.size
    scale = draft_scale(min_side, target)
    if scale == 1 or image.format != "JPEG":
        return 1
    done = image.draft(image.mode, (width // scale, height // scale))  # None once decoded
    if done is None:
        return 1
    scale = round(width / done[1][2])  # PIL's own choice (the same power of two)
    image.info[DRAFT] = (width, height, scale)
    return scale


def _to_rgb(image):
    return image.convert("RGB")


def preprocess_cfg(image_size: int) -> dict:
    """What an exported model needs to rebuild the eval transform (open_clip keys)."""
    return {
        "size": image_size,
        "mode": "RGB",
        "mean": list(OPENAI_DATASET_MEAN),
        "std": list(OPENAI_DATASET_STD),
        "interpolation": "bicubic",
        "resize_mode": "shortest",
    }


class _EvalDraft:
    """A not yet decoded JPEG whose shorter side is >= 2x the target decodes at reduced scale."""

    def __init__(self, size: int):
        self.size = size

    def __call__(self, image):
        if isinstance(image, Image.Image):
            draft_jpeg(image, min(image.size), self.size)
        return image


def eval_transform(image_size: int, *, draft: bool = False, resize_mode: str = "shortest") -> T.Compose:
    """open_clip's eval preprocessing.  ``draft=True`` lets large JPEGs that are not yet decoded
    (``Image.open``) decode at reduced scale: faster, close but not equal; off by default so that
    evaluation stays exactly clip_benchmark's.  ``resize_mode="squash"``: the whole image resized
    to the square, no crop (SigLIP's preprocessing; open_clip's name for it)."""
    if resize_mode == "squash":
        resize = [T.Resize((image_size, image_size), interpolation=T.InterpolationMode.BICUBIC)]
    else:
        resize = [T.Resize(image_size, interpolation=T.InterpolationMode.BICUBIC), T.CenterCrop(image_size)]
    return T.Compose(
        [_check_shape]
        + ([_EvalDraft(image_size)] if draft else [])
        + resize
        + [
            _to_rgb,
            T.ToTensor(),
            T.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD),
        ]
    )


def crop_box(
    width: int, height: int, scale: tuple, ratio: tuple, rng: random.Random
) -> tuple[int, int, int, int]:
    """A random crop (top, left, h, w) covering ``scale`` of the area at an aspect in ``ratio``.

    Ten tries at a uniformly drawn area and log-uniform aspect; if none fits, the
    largest centred crop whose aspect is clamped into ``ratio``.
    """
    area = width * height
    log_lo, log_hi = math.log(ratio[0]), math.log(ratio[1])
    for _ in range(10):
        target = area * rng.uniform(scale[0], scale[1])
        aspect = math.exp(rng.uniform(log_lo, log_hi))
        w = int(round(math.sqrt(target * aspect)))
        h = int(round(math.sqrt(target / aspect)))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, height - h), rng.randint(0, width - w), h, w
    aspect = width / height
    if aspect < ratio[0]:
        w, h = width, int(round(width / ratio[0]))
    elif aspect > ratio[1]:
        h, w = height, int(round(height * ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def min_crop_side(width: int, height: int, scale: tuple, ratio: tuple) -> float:
    """A lower bound on either side of any box :func:`crop_box` can return for this image."""
    least = scale[0] * width * height
    return (
        min(
            math.sqrt(least * ratio[0]),
            math.sqrt(least / ratio[1]),  # the ten tries
            width,
            height,
            width / ratio[0],
            height * ratio[1],
        )
        - 1
    )  # the fallback; -1: rounding


class TrainTransform:
    """PIL image (+ generator) -> normalised (3, S, S) tensor with the declared augmentations;
    :meth:`raw` gives the same image as uint8 (the loader's batches)."""

    def __init__(self, image_size: int, augment: AugmentConfig):
        self.size = int(image_size)
        self.aug = augment
        self.normalize = T.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        return self.normalize(F.to_tensor(self._augment(image, rng)))  # (3, S, S) float32

    def raw(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        return F.pil_to_tensor(self._augment(image, rng))  # (3, S, S) uint8

    def draft(self, image: Image.Image) -> int:
        """Call on an opened, not yet decoded image: a JPEG decodes at 1/2, 1/4 or 1/8 scale when
        the smallest crop this transform can draw still has >= size pixels per side there, so
        each crop is still downsampled.  Returns the scale (1 = full decode)."""
        a = self.aug
        smallest = min_crop_side(image.width, image.height, tuple(a.crop_scale), tuple(a.crop_ratio))
        return draft_jpeg(image, smallest, self.size)

    def _augment(self, image: Image.Image, rng: random.Random | None) -> Image.Image:
        rng = rng or _fallback_rng
        a = self.aug
        # a drafted JPEG: the crop is drawn on the full-size grid (the same draws and framing as
        # the full decode) and read from the reduced image at fractional coordinates
        width, height, scale = image.info.get(DRAFT, (image.width, image.height, 1))
        image = image.convert("RGB")
        top, left, h, w = crop_box(width, height, tuple(a.crop_scale), tuple(a.crop_ratio), rng)
        if scale == 1:
            image = F.resized_crop(
                image, top, left, h, w, [self.size, self.size], interpolation=T.InterpolationMode.BICUBIC
            )
        else:
            box = (left / scale, top / scale, (left + w) / scale, (top + h) / scale)
            image = image.resize((self.size, self.size), Image.Resampling.BICUBIC, box=box)
        if a.hflip and rng.random() < 0.5:
            image = F.hflip(image)
        if any(a.color_jitter) and rng.random() < a.color_jitter_prob:
            image = self._jitter(image, rng)
        if a.grayscale_prob and rng.random() < a.grayscale_prob:
            image = F.rgb_to_grayscale(image, num_output_channels=3)
        if a.blur_prob and rng.random() < a.blur_prob:
            image = image.filter(ImageFilter.GaussianBlur(rng.uniform(*a.blur_sigma)))
        return image

    def _jitter(self, image: Image.Image, rng: random.Random) -> Image.Image:
        brightness, contrast, saturation, hue = self.aug.color_jitter
        ops = []
        if brightness:
            ops.append((F.adjust_brightness, rng.uniform(max(0.0, 1 - brightness), 1 + brightness)))
        if contrast:
            ops.append((F.adjust_contrast, rng.uniform(max(0.0, 1 - contrast), 1 + contrast)))
        if saturation:
            ops.append((F.adjust_saturation, rng.uniform(max(0.0, 1 - saturation), 1 + saturation)))
        if hue:
            ops.append((F.adjust_hue, rng.uniform(-hue, hue)))
        rng.shuffle(ops)  # the order of the adjustments is random too, as in SimCLR/ColorJitter
        for op, factor in ops:
            image = op(image, factor)
        return image


def train_transform(image_size: int, augment: AugmentConfig) -> TrainTransform:
    return TrainTransform(image_size, augment)


def describe(augment: AugmentConfig, views: int = 1) -> str:
    """One log line that states the declared invariances."""
    a = augment
    lo, hi = a.crop_scale
    parts = [
        f"random-resized-crop scale [{lo}, {hi}] ratio [{a.crop_ratio[0]:.3g}, {a.crop_ratio[1]:.3g}] "
        "(invariant to framing)"
    ]
    parts.append("horizontal flip (invariant to left/right)" if a.hflip else "no flip (left/right matters)")
    if any(a.color_jitter) and a.color_jitter_prob > 0:
        b, c, s, h = a.color_jitter
        parts.append(
            f"colour jitter p={a.color_jitter_prob} brightness {b} contrast {c} saturation {s} hue {h} "
            "(invariant to lighting and hue)"
        )
    else:
        parts.append("no colour jitter (colours matter)")
    parts.append(
        f"grayscale p={a.grayscale_prob} (invariant to colour)" if a.grayscale_prob else "no grayscale"
    )
    if a.blur_prob:
        parts.append(
            f"gaussian blur p={a.blur_prob} sigma [{a.blur_sigma[0]}, {a.blur_sigma[1]}] (invariant to focus)"
        )
    else:
        parts.append("no blur")
    if views == 2:
        parts.append("2 views per image (image-image positives)")
    return "augment: " + "; ".join(parts)
