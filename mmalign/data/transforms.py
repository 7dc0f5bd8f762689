"""Image preprocessing.

The eval transform is open_clip's (resize the shortest side, centre crop, CLIP
normalisation).  The train transform adds only the augmentations the config
declares: every augmentation is a statement of what the model learns to ignore.
"""

from __future__ import annotations

from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from torchvision import transforms as T

from mmalign.config import AugmentConfig


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


def train_transform(image_size: int, augment: AugmentConfig) -> T.Compose:
    steps = [
        T.RandomResizedCrop(
            image_size, scale=tuple(augment.crop_scale), interpolation=T.InterpolationMode.BICUBIC
        ),
    ]
    if augment.hflip:
        steps.append(T.RandomHorizontalFlip())
    steps += [_to_rgb, T.ToTensor(), T.Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)]
    return T.Compose(steps)


def describe(augment: AugmentConfig) -> str:
    """One log line that states the declared invariances."""
    lo, hi = augment.crop_scale
    parts = [f"random-resized-crop scale [{lo}, {hi}] (invariant to framing)"]
    parts.append("horizontal flip (invariant to left/right)" if augment.hflip else "no flip (left/right matters)")
    return "augment: " + "; ".join(parts)
