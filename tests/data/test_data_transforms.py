"""Declared augmentations: explicit, logged, reproducible per seed, shapes-safe defaults, checked keys."""

import random

import pytest
import torch
from PIL import Image

from mmalign.config import AugmentConfig, ConfigError, load_config
from mmalign.data.transforms import crop_box, describe, train_transform


def picture(rng):
    w, h = rng.randint(20, 60), rng.randint(20, 60)
    return Image.frombytes("RGB", (w, h), rng.randbytes(w * h * 3))


def test_default_keeps_left_right_and_colours(seed):
    a = load_config(None, []).data.augment
    assert not a.hflip and not any(a.color_jitter) and a.grayscale_prob == 0 and a.blur_prob == 0
    line = describe(a)
    assert "no flip" in line and "no colour jitter" in line and "no grayscale" in line and "no blur" in line
    # with no crop either, the train transform is the identity up to resizing and normalising
    rng = random.Random(seed)
    image = picture(rng).resize((24, 24))
    t = train_transform(16, AugmentConfig(crop_scale=[1.0, 1.0], crop_ratio=[1.0, 1.0]))
    assert torch.equal(t(image, random.Random(1)), t(image, random.Random(2)))


def test_every_declared_augmentation_is_described_and_applied(seed):
    a = AugmentConfig(
        crop_scale=[0.3, 0.9],
        hflip=True,
        color_jitter=[0.4, 0.4, 0.4, 0.1],
        color_jitter_prob=1.0,
        grayscale_prob=0.5,
        blur_prob=0.5,
    )
    line = describe(a, views=2)
    for phrase in (
        "scale [0.3, 0.9]",
        "horizontal flip",
        "colour jitter p=1.0",
        "grayscale p=0.5",
        "gaussian blur p=0.5",
        "2 views",
    ):
        assert phrase in line
    rng = random.Random(seed)
    image = picture(rng)
    t = train_transform(16, a)
    seed = rng.randrange(10**6)
    out = t(image, random.Random(seed))
    assert out.shape == (3, 16, 16)
    assert torch.equal(out, t(image, random.Random(seed)))  # reproducible from the generator alone
    assert not torch.equal(out, t(image, random.Random(seed + 1)))


def test_grayscale_and_flip_do_what_they_say(seed):
    rng = random.Random(seed)
    image = picture(rng)
    gray = train_transform(16, AugmentConfig(crop_scale=[1, 1], crop_ratio=[0.01, 100.0], grayscale_prob=1.0))
    out = gray(image, random.Random(0))
    # normalisation differs per channel; undo it and the channels agree
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073])[:, None, None]
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711])[:, None, None]
    raw = out * std + mean
    assert torch.allclose(raw[0], raw[1], atol=1e-5) and torch.allclose(raw[1], raw[2], atol=1e-5)
    side = rng.randint(20, 60)  # square, with crop ratio 1 and scale 1: the crop is the whole image
    image = image.resize((side, side))
    plain = train_transform(16, AugmentConfig(crop_scale=[1, 1], crop_ratio=[1, 1]))
    flip = train_transform(16, AugmentConfig(crop_scale=[1, 1], crop_ratio=[1, 1], hflip=True))
    base = plain(image, random.Random(0))
    kinds = set()
    for s in range(20):  # each output is the image or its mirror (resampling may differ by rounding)
        out = flip(image, random.Random(s))
        same, mirrored = torch.allclose(out, base, atol=0.05), torch.allclose(out, base.flip(-1), atol=0.05)
        assert same or mirrored
        kinds.add("same" if same else "mirrored")
    assert kinds == {"same", "mirrored"}


def test_crop_box_stays_inside_and_respects_scale(seed):
    rng = random.Random(seed)
    for _ in range(200):
        w, h = rng.randint(5, 300), rng.randint(5, 300)
        lo = rng.uniform(0.05, 1.0)
        top, left, ch, cw = crop_box(w, h, (lo, 1.0), (3 / 4, 4 / 3), rng)
        assert 0 <= top and 0 <= left and top + ch <= h and left + cw <= w and ch > 0 and cw > 0


@pytest.mark.parametrize(
    "override, key",
    [
        ("data.augment.crop_scale=[0.5, 1.5]", "data.augment.crop_scale"),
        ("data.augment.color_jitter=[0.4, 0.4]", "data.augment.color_jitter"),
        ("data.augment.color_jitter=[0.1, 0.1, 0.1, 0.9]", "data.augment.color_jitter"),
        ("data.augment.grayscale_prob=1.5", "data.augment.grayscale_prob"),
        ("data.augment.blur_sigma=[2, 1]", "data.augment.blur_sigma"),
        ("data.views=3", "data.views"),
        ("data.mode=sometimes", "data.mode"),
        ("data.shuffle_buffer=0", "data.shuffle_buffer"),
        ("data.train_weights=[1, 2]", "data.train_weights"),
        ("data.max_image_pixels=0", "data.max_image_pixels"),
    ],
)
def test_bad_data_keys_are_one_line_errors(override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config(None, [override])


def test_weights_need_resampled_mode_and_one_per_source():
    with pytest.raises(ConfigError, match="data.mode=resampled"):
        load_config(None, ["data.train=[a.tar, b.tar]", "data.train_weights=[1, 1]", "data.mode=epoch"])
    cfg = load_config(None, ["data.train=[a.tar, b.tar]", "data.train_weights=[3, 1]"])
    assert cfg.data.train == ["a.tar", "b.tar"] and cfg.data.train_weights == [3, 1]
