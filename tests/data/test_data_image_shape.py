"""Thin images (1 x N) are refused from their header, before a decode or a resize that would
blow them up to S x S*N; every photo shape up to 20:1 passes."""

from __future__ import annotations

import io
import time
import tracemalloc

import pytest
import torch
from PIL import Image

from mmalign.data.image_shape import MAX_ASPECT, ImageShapeError
from mmalign.data.shards import BadSample, decode_sample, open_image
from mmalign.data.transforms import eval_transform


def _png(size) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


def test_a_1x20000_png_is_refused_from_its_header_quickly_and_cheaply():
    data = _png((1, 20000))
    assert len(data) < 2000  # a few hundred bytes that would cost gigabytes resized
    tracemalloc.start()
    start = time.monotonic()
    with pytest.raises(BadSample) as e:
        open_image(data, max_pixels=40_000_000)  # under the pixel cap: the shape check refuses it
    elapsed = time.monotonic() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert e.value.reason == "extreme_aspect" and "1x20000" in str(e.value)
    assert elapsed < 1.0 and peak < 5 << 20  # not decoded, not resized (4.9 GB at 224)
    raw = {"__key__": "k", "png": data, "txt": b"a strip"}
    with pytest.raises(BadSample) as e:
        decode_sample(raw)
    assert e.value.reason == "extreme_aspect"


@pytest.mark.parametrize("size", [(2 * MAX_ASPECT, 2), (2, 2 * MAX_ASPECT), (728, 90), (3, 3)])
def test_shapes_up_to_the_bound_are_read_and_transformed(size):
    image = open_image(_png(size))
    assert image.size == size
    assert eval_transform(16)(image).shape == (3, 16, 16)


@pytest.mark.parametrize("size", [(2 * MAX_ASPECT + 1, 2), (2, 2 * MAX_ASPECT + 1), (1, 20000)])
def test_shapes_past_the_bound_are_refused(size):
    long, short = max(size), min(size)
    assert long / short > MAX_ASPECT  # the reference: the definition
    with pytest.raises(BadSample) as e:
        open_image(_png(size))
    assert e.value.reason == "extreme_aspect"


def test_the_eval_transform_refuses_a_thin_image_decoded_elsewhere():
    image = Image.new("RGB", (1, 20000))  # handed over already decoded (a library caller)
    with pytest.raises(ImageShapeError, match="1x20000"):
        eval_transform(224)(image)
    assert isinstance(eval_transform(8)(Image.new("RGB", (8, 8))), torch.Tensor)


def test_embed_skips_a_thin_image_in_a_folder(tmp_path, caplog):
    from mmalign.search.embed import open_data

    Image.new("RGB", (1, 20000)).save(tmp_path / "strip.png")
    Image.new("RGB", (12, 10)).save(tmp_path / "photo.png")
    samples, _ = open_data(tmp_path)
    assert [s["key"] for s in samples] == ["photo"]
    assert "strip.png" in caplog.text and "20000:1" in caplog.text
