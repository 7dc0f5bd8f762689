"""Evaluation's cache-sized tower calls on a CPU (mmalign/models/cpu_chunks.py) and its
prefetching image batches (mmalign/evaluation/features.py): the same features as one call."""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from mmalign.models import TwoTower
from mmalign.models.cpu_chunks import CACHE_BYTES, MIN_ITEMS, image_tokens, in_pieces, piece_size
from mmalign.models.presets import PRESETS


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TwoTower(PRESETS["tiny"]).eval()


def test_piece_sizes(tiny):
    # tiny ViT at 32 px: 8 x 8 patches + the class token, MLP width 4 x 128
    assert image_tokens(tiny.visual) == 65
    assert piece_size(tiny.visual, 65, "cpu") == CACHE_BYTES // (4 * 512 * 65) == 31
    assert piece_size(tiny.visual, 65, "cuda") is None  # a GPU call is never split
    assert piece_size(tiny.text, 10_000, "cpu") == MIN_ITEMS
    assert piece_size(torch.nn.Linear(3, 3), 65, "cpu") is None  # no transformer MLP to size by
    assert image_tokens(torch.nn.Conv2d(3, 3, 1)) is None


def test_pieces_give_the_features_of_one_call(tiny):
    from mmalign.evaluation.features import encode_images, text_encoder
    from mmalign.models.tokenizers import build_tokenizer

    g = torch.Generator().manual_seed(1)
    images = torch.randn(70, 3, 32, 32, generator=g)  # 31 + 31 + 8
    with torch.no_grad():
        whole = tiny.encode_image(images)
        assert torch.equal(in_pieces(tiny.encode_image, images, 100), whole)  # one piece: the call itself
        torch.testing.assert_close(in_pieces(tiny.encode_image, images, 31), whole, atol=1e-5, rtol=1e-5)
        got = encode_images(tiny, images, pre_projection=True)
        torch.testing.assert_close(got["joint"], whole, atol=1e-5, rtol=1e-5)
        tokens = build_tokenizer(PRESETS["tiny"])([f"a photo of a thing number {i}" for i in range(300)])
        torch.testing.assert_close(text_encoder(tiny)(tokens), tiny.encode_text(tokens), atol=1e-5, rtol=1e-5)


def test_prefetched_batches_keep_order_and_raise_the_readers_error(tiny):
    from mmalign.data.transforms import eval_transform
    from mmalign.evaluation.features import embed_images

    g = torch.Generator().manual_seed(2)
    pics = [Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).byte().numpy()) for _ in range(21)]
    preprocess = eval_transform(32)
    with torch.no_grad():
        want = tiny.encode_image(torch.stack([preprocess(p) for p in pics]))
    got = embed_images(tiny, preprocess, iter(pics), batch_size=4)["joint"]  # 6 batches, the last of 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)

    def broken():
        yield from pics[:9]
        raise OSError("shard 3 went away")

    with pytest.raises(OSError, match="shard 3 went away"):
        embed_images(tiny, preprocess, broken(), batch_size=4)
