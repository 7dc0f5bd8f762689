"""The training side of uint8 batches: copy to the device, normalise there.

The loader's workers ship images as uint8 (B, 3, H, W), 4x smaller than float32 in
shared memory and over PCIe; on CUDA the main process gathers them into pinned
memory, so the copy here runs asynchronously (``non_blocking``).  Normalising on the
device applies exactly the operations of torchvision's ``to_tensor`` + ``Normalize``
(``x / 255``, ``- mean``, ``/ std`` in float32, each IEEE-rounded), so the float
batch equals the one the CPU path would have built, bit for bit.
"""

from __future__ import annotations

import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

# device -> (mean, std), each (1, 3, 1, 1) float32 on it: built once per device, since building
# them from Python floats is a blocking host-to-device copy on CUDA (a per-batch stall otherwise)
_CONSTANTS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    found = _CONSTANTS.get(device)
    if found is None:
        # ordinary tensors even when first asked for under inference_mode (they serve training too)
        with torch.inference_mode(False):
            mean = torch.tensor(OPENAI_DATASET_MEAN, dtype=torch.float32, device=device).view(1, 3, 1, 1)
            std = torch.tensor(OPENAI_DATASET_STD, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        found = _CONSTANTS.setdefault(device, (mean, std))  # two threads racing keep one pair
    return found


def normalize_images(images: torch.Tensor) -> torch.Tensor:
    """uint8 (B, 3, H, W) -> float32 (B, 3, H, W), CLIP-normalised, on the images' device."""
    mean, std = _constants(images.device)  # (1, 3, 1, 1) each, read only
    return images.to(torch.float32).div_(255).sub_(mean).div_(std)


def unnormalize_images(images: torch.Tensor) -> torch.Tensor:
    """float32 (B, 3, H, W) CLIP-normalised -> the pixels in [0, 1] they came from (x * std + mean),
    e.g. to resize them for a distillation teacher of another image size."""
    mean, std = _constants(images.device)  # (1, 3, 1, 1) each, read only
    return images.to(torch.float32) * std + mean


def normalize_pixels(pixels: torch.Tensor) -> torch.Tensor:
    """float (B, 3, H, W) pixels in [0, 1] -> CLIP-normalised float32 (the inverse of the above)."""
    mean, std = _constants(pixels.device)
    return (pixels.to(torch.float32) - mean) / std


def images_to(images: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch's images on ``device`` as normalised float32; float input (a custom transform
    that normalises itself) is only moved."""
    moved = images.to(device, non_blocking=True)  # (B, 3, H, W)
    return normalize_images(moved) if moved.dtype == torch.uint8 else moved
