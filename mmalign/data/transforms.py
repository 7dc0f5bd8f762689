"""Image preprocessing.

The eval transform is open_clip's (resize the shortest side, centre crop, CLIP
normalisation).  The train transform adds only the augmentations the config
declares: every augmentation is a statement of what the model learns to ignore.

The train transform draws all of its random parameters from a ``random.Random``
passed per call, never from torch's global RNG: the loader seeds that generator
per sample, so a resumed run reproduces the very same crops and flips, and
``workers=0`` leaves the training process's RNG untouched.
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

_fallback_rng = random.Random(0)  # only for callers that pass no generator


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


def eval_transform(image_size: int) -> T.Compose:
    return T.Compose(
        [
            T.Resize(image_size, interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop(image_size),
            _to_rgb,
            T.ToTensor(),
            T.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD),
        ]
    )


def crop_box(width: int, height: int, scale: tuple, ratio: tuple, rng: random.Random) -> tuple[int, int, int, int]:
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


class TrainTransform:
    """PIL image (+ generator) -> normalised (3, S, S) tensor with the declared augmentations."""

    def __init__(self, image_size: int, augment: AugmentConfig):
        self.size = int(image_size)
        self.aug = augment
        self.normalize = T.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)

    def __call__(self, image: Image.Image, rng: random.Random | None = None) -> torch.Tensor:
        rng = rng or _fallback_rng
        a = self.aug
        image = image.convert("RGB")
        top, left, h, w = crop_box(image.width, image.height, tuple(a.crop_scale), tuple(a.crop_ratio), rng)
        image = F.resized_crop(image, top, left, h, w, [self.size, self.size],
                               interpolation=T.InterpolationMode.BICUBIC)
        if a.hflip and rng.random() < 0.5:
            image = F.hflip(image)
        if any(a.color_jitter) and rng.random() < a.color_jitter_prob:
            image = self._jitter(image, rng)
        if a.grayscale_prob and rng.random() < a.grayscale_prob:
            image = F.rgb_to_grayscale(image, num_output_channels=3)
        if a.blur_prob and rng.random() < a.blur_prob:
            image = image.filter(ImageFilter.GaussianBlur(rng.uniform(*a.blur_sigma)))
        return self.normalize(F.to_tensor(image))

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
    parts = [f"random-resized-crop scale [{lo}, {hi}] ratio [{a.crop_ratio[0]:.3g}, {a.crop_ratio[1]:.3g}] "
             "(invariant to framing)"]
    parts.append("horizontal flip (invariant to left/right)" if a.hflip else "no flip (left/right matters)")
    if any(a.color_jitter) and a.color_jitter_prob > 0:
        b, c, s, h = a.color_jitter
        parts.append(f"colour jitter p={a.color_jitter_prob} brightness {b} contrast {c} saturation {s} hue {h} "
                     "(invariant to lighting and hue)")
    else:
        parts.append("no colour jitter (colours matter)")
    parts.append(f"grayscale p={a.grayscale_prob} (invariant to colour)" if a.grayscale_prob else "no grayscale")
    if a.blur_prob:
        parts.append(f"gaussian blur p={a.blur_prob} sigma [{a.blur_sigma[0]}, {a.blur_sigma[1]}] (invariant to focus)")
    else:
        parts.append("no blur")
    if views == 2:
        parts.append("2 views per image (image-image positives)")
    return "augment: " + "; ".join(parts)
