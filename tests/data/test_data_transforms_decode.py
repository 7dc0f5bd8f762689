"""JPEG draft decoding: a source much larger than the target decodes at reduced DCT scale,
and the crop stays close to the full decode's.

Bound (stated and tested): on 1024-px photo-like JPEGs (gradients, shapes, mild noise,
quality 90) cropped to 224 px, the drafted crop differs from the full decode's by a mean of
at most 1 grey level (of 255; measured 0.3-0.6) and 99% of its values by at most 6
(measured 2-4); the largest differences (up to ~20) sit on sharp edges, where libjpeg's DCT
downscaling and bicubic resampling ring differently.  Evaluation drafts only on request.
"""

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw, JpegImagePlugin
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

from mmalign.config import AugmentConfig
from mmalign.data.samples import SampleProcessor
from mmalign.data.seeds import VIEW, draws
from mmalign.data.shards import open_image
from mmalign.data.transforms import crop_box, eval_transform, train_transform


def photo(rng: random.Random, n: int) -> bytes:
    """An n x n JPEG (quality 90): colour gradients, a dozen filled ellipses, +-8 noise."""
    y, x = np.mgrid[0:n, 0:n] / n
    image = Image.fromarray((np.stack([x, y, (x + y) / 2], -1) * 200 + 20).astype(np.uint8))
    draw = ImageDraw.Draw(image)
    for _ in range(12):
        x0, y0 = rng.randrange(n), rng.randrange(n)
        draw.ellipse(
            [x0, y0, x0 + rng.randrange(n // 25, n // 3), y0 + rng.randrange(n // 25, n // 3)],
            fill=tuple(rng.randrange(256) for _ in range(3)),
        )
    noise = np.random.default_rng(rng.randrange(2**32)).integers(-8, 9, (n, n, 3))
    buf = io.BytesIO()
    Image.fromarray((np.asarray(image) + noise).clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def full_decode_crop(data: bytes, aug: AugmentConfig, rng: random.Random) -> torch.Tensor:
    """Today's path, by hand: full decode, the crop box from the sample's generator, bicubic."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    box = crop_box(image.width, image.height, tuple(aug.crop_scale), tuple(aug.crop_ratio), rng)
    return F.pil_to_tensor(F.resized_crop(image, *box, [224, 224], interpolation=InterpolationMode.BICUBIC))


@pytest.fixture
def drafts(monkeypatch):
    """The requested sizes of every JPEG draft."""
    calls = []
    real = JpegImagePlugin.JpegImageFile.draft

    def spy(self, mode, size):
        calls.append(size)
        return real(self, mode, size)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", spy)
    return calls


@pytest.mark.parametrize("scale", [[0.9, 1.0], [0.3, 1.0]])
def test_a_1024px_jpeg_is_drafted_and_its_crop_stays_close(drafts, scale, seed):
    rng = random.Random(seed)
    aug = AugmentConfig(crop_scale=scale)  # no flip, no jitter: the crop is all that differs
    processor = SampleProcessor(train_transform(224, aug), lambda captions: torch.zeros(len(captions), 4))
    for _ in range(2):
        data, seed = photo(rng, 1024), rng.randrange(10**6)
        row = processor("k", {"jpg": data, "txt": b"a caption"}, seed)
        gen = draws(seed, VIEW)  # the sample's generator of its (first) view: the crop
        want = full_decode_crop(data, aug, gen)
        got = row["image"]
        assert got.dtype == torch.uint8 and got.shape == want.shape == (3, 224, 224)
        diff = (got.float() - want.float()).abs()
        assert diff.mean() <= 1.0 and diff.quantile(0.99) <= 6, (diff.mean(), diff.quantile(0.99))
    assert drafts == [(512, 512)] * 2  # 1/2 scale: the smallest crop (> 448 px) stays >= 224 px there


def test_no_draft_when_the_source_is_not_much_larger(drafts, seed):
    rng = random.Random(seed)
    aug = AugmentConfig(crop_scale=[0.9, 1.0])
    t = train_transform(224, aug)
    data = photo(rng, 256)
    scales = []
    image = open_image(data, None, lambda im: scales.append(t.draft(im)))
    assert scales == [1] and image.size == (256, 256) and drafts == []
    seed = rng.randrange(10**6)
    assert torch.equal(
        t.raw(image, random.Random(seed)), full_decode_crop(data, aug, random.Random(seed))
    )  # exactly today's


def test_eval_drafts_only_on_request(drafts, seed):
    rng = random.Random(seed)
    data = photo(rng, 1024)
    exact = eval_transform(224)(Image.open(io.BytesIO(data)))
    assert drafts == []
    fast = eval_transform(224, draft=True)(Image.open(io.BytesIO(data)))
    assert drafts == [(256, 256)]  # 1/4 scale: the shorter side stays >= 224
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    diff = ((fast - exact) * std * 255).abs()  # in grey levels
    assert diff.mean() <= 1.0 and diff.quantile(0.99) <= 6, (diff.mean(), diff.quantile(0.99))
