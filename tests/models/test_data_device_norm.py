"""uint8 batches normalised on the device (mmalign/data/device.py): bit for bit torchvision's
``to_tensor`` + ``Normalize`` (the reference), with the mean / std constants built once per
device, not per batch (on CUDA each construction from Python floats is a blocking
host-to-device copy)."""

from __future__ import annotations

import numpy as np
import torch
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD
from PIL import Image
from torchvision.transforms import Normalize
from torchvision.transforms.functional import to_tensor

from mmalign.data import device as dev


def _images(gen, n=4, size=12) -> list[Image.Image]:
    raw = torch.randint(0, 256, (n, size, size, 3), dtype=torch.uint8, generator=gen).numpy()
    raw[0, 0, 0] = (0, 128, 255)  # the ends of the range
    return [Image.fromarray(np.ascontiguousarray(a)) for a in raw]


def test_equal_to_torchvision_bit_for_bit_over_repeated_batches(gen):
    reference = Normalize(OPENAI_DATASET_MEAN, OPENAI_DATASET_STD)
    for _ in range(3):  # later batches use the cached constants
        images = _images(gen)
        want = torch.stack([reference(to_tensor(im)) for im in images])  # (B, 3, H, W) float32
        uint8 = torch.stack(
            [torch.from_numpy(np.array(im)).permute(2, 0, 1) for im in images]
        )  # (B, 3, H, W)
        got = dev.images_to(uint8, torch.device("cpu"))
        assert got.dtype == torch.float32 and torch.equal(got, want)


def test_the_constants_are_built_once_per_device(monkeypatch, gen):
    monkeypatch.setattr(dev, "_CONSTANTS", {}, raising=False)  # (absent before the cache)
    built = []
    real = torch.tensor

    def counted(*args, **kwargs):
        built.append(str(kwargs.get("device")))
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counted)
    batch = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=gen)
    first = dev.normalize_images(batch)
    for _ in range(4):
        assert torch.equal(dev.normalize_images(batch), first)
    assert built == ["cpu", "cpu"]  # mean and std, once
    meta = dev.normalize_images(batch.to("meta"))  # another device: its own pair, once
    dev.normalize_images(batch.to("meta"))
    assert meta.device.type == "meta" and built == ["cpu", "cpu", "meta", "meta"]
    # the cached constants are read, never written by the in-place normalisation
    mean, std = dev._CONSTANTS[torch.device("cpu")]
    assert torch.equal(mean.reshape(-1), real(OPENAI_DATASET_MEAN)) and torch.equal(
        std.reshape(-1), real(OPENAI_DATASET_STD)
    )


def test_constants_first_built_under_inference_mode_serve_autograd_later(gen):
    batch = torch.randint(0, 256, (2, 3, 8, 8), dtype=torch.uint8, generator=gen)
    dev._CONSTANTS.pop(torch.device("cpu"), None)
    with torch.inference_mode():  # an evaluation first
        dev.normalize_images(batch)
    x = dev.normalize_images(batch).requires_grad_(True)  # then training: an ordinary tensor
    (x * dev._CONSTANTS[torch.device("cpu")][1]).sum().backward()  # the constant may be saved for backward
    assert x.grad is not None
