"""Worker pieces and uint8 batches: the local batch does not depend on data.worker_batch_size
(resume included), row j of every batch is lane j's next sample, and the uint8 images
normalised on the device equal the float32 path."""

import io
import json
import random
import tarfile

import numpy as np
import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer
from PIL import Image

from mmalign.config import AugmentConfig, ConfigError, DataConfig, load_config
from mmalign.data.batch import Batch
from mmalign.data.device import images_to
from mmalign.data.loader import build_train_loader, worker_shares
from mmalign.data.samples import SampleProcessor, merge
from mmalign.data.stream import LaneStream
from mmalign.data.transforms import train_transform

TOKENIZER = SimpleTokenizer(context_length=12)
AUG = AugmentConfig(crop_scale=[0.5, 1.0], hflip=True, color_jitter=[0.4, 0.4, 0.4, 0.1])
MEAN = (0.48145466, 0.4578275, 0.40821073)  # CLIP's, as every CLIP preprocessing states them
STD = (0.26862954, 0.26130258, 0.27577711)


def jpeg(rng, size=(12, 10)) -> bytes:
    image = Image.frombytes("RGB", size, rng.randbytes(size[0] * size[1] * 3))
    buf = io.BytesIO()
    image.save(buf, format="JPEG")
    return buf.getvalue()


def make_shards(root, sizes, rng):
    """Shards of random images with 1-3 caption lines; every 9th sample has a corrupt image."""
    for s, n in enumerate(sizes):
        with tarfile.open(root / f"{s:05d}.tar", "w") as tar:
            for i in range(n):
                key = f"{s:05d}{i:04d}"
                caps = "\n".join(f"caption {key} {j}" for j in range(rng.randint(1, 3)))
                image = rng.randbytes(200) if i % 9 == 4 else jpeg(rng)
                for ext, data in (("jpg", image), ("txt", caps.encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return f"{root}/{{00000..{len(sizes) - 1:05d}}}.tar"


def loader_for(spec, *, piece=0, mode="epoch", workers=2, batch=7, seed=0):
    cfg = DataConfig(
        train=spec, mode=mode, workers=workers, shuffle_buffer=6, augment=AUG, worker_batch_size=piece
    )
    return build_train_loader(cfg, train_transform(8, AUG), TOKENIZER, batch, seed=seed)


def take(loader, n):
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    del it
    return out


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.keys == b.keys and a.captions == b.captions and a.skipped == b.skipped
        for name in ("images", "tokens", "epochs"):
            assert getattr(a, name).dtype == getattr(b, name).dtype and torch.equal(
                getattr(a, name), getattr(b, name)
            ), name


def test_worker_shares():
    assert worker_shares(7, 2, 256) == [[4], [3]]
    assert worker_shares(7, 2, 2) == [[2, 2], [2, 1]]
    assert worker_shares(7, 2, 1) == [[1, 1, 1, 1], [1, 1, 1, 0]]  # same count of pieces per worker
    assert worker_shares(3, 4, 8) == [[1], [1], [1], [0]]
    for b, k, p in ((4096, 8, 256), (100, 3, 7), (5, 1, 2)):
        shares = worker_shares(b, k, p)
        assert sum(map(sum, shares)) == b and len({len(s) for s in shares}) == 1
        assert max(max(s) for s in shares) <= p


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
def test_piece_size_changes_nothing_resume_included(tmp_path, mode, seed):
    rng = random.Random(seed)
    spec = make_shards(tmp_path, [rng.randint(10, 16) for _ in range(3)], rng)
    seed = rng.randrange(1000)
    total = 9  # 63 samples: past the epoch end (<= 48 samples) in epoch mode
    reference = take(loader_for(spec, mode=mode, seed=seed), total)  # default: one piece per worker
    assert reference[0].images.dtype == torch.uint8 and reference[0].images.shape == (7, 3, 8, 8)
    assert sum(reference[-1].skipped.values()) > 0  # the corrupt images were met and counted
    assert_same(take(loader_for(spec, mode=mode, seed=seed, piece=2), total), reference)
    # resume: pieces of 1 (one of them empty per batch), then pieces of 3 after the checkpoint
    cut = rng.randrange(2, total - 2)
    first = loader_for(spec, mode=mode, seed=seed, piece=1)
    head = take(first, cut)
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader_for(spec, mode=mode, seed=seed, piece=3)
    resumed.load_state_dict(state)
    assert_same(head + take(resumed, total - cut), reference)
    other = take(loader_for(spec, mode=mode, seed=seed + 1, piece=2), 2)  # the comparison can fail
    assert [b.keys for b in other] != [b.keys for b in reference[:2]]


def test_row_j_of_every_batch_is_lane_js_next_sample(tmp_path, seed):
    """Naive reference: run each of the B = 7 lanes alone, in this process, and take one sample
    of each per batch; the loader's two workers, in pieces of 2, must give the same rows."""
    rng = random.Random(seed)
    spec = make_shards(tmp_path, [rng.randint(10, 16) for _ in range(3)], rng)
    loader = loader_for(spec, piece=2)
    got = take(loader, 5)
    processor = SampleProcessor(train_transform(8, AUG), TOKENIZER)
    lanes = [LaneStream(loader.spec, lane, processor).samples() for lane in range(7)]
    for batch in got:
        rows = [next(lane)[0] for lane in lanes]
        assert batch.keys == [r["key"] for r in rows]
        assert torch.equal(batch.images, torch.stack([r["image"] for r in rows]))


def test_uint8_normalised_on_the_device_equals_the_float32_path(seed):
    rng = random.Random(seed)
    size = 16
    images = [Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3)) for _ in range(5)]
    whole = AugmentConfig(crop_scale=[1.0, 1.0], crop_ratio=[1.0, 1.0])  # the crop is the image itself
    t = train_transform(size, whole)
    raw = torch.stack([t.raw(im, random.Random(0)) for im in images])  # (5, 3, S, S) uint8
    assert raw.dtype == torch.uint8
    # today's float32 path, by hand: HWC uint8 -> CHW float / 255, minus mean, over std
    mean = torch.tensor(MEAN, dtype=torch.float32)[:, None, None]
    std = torch.tensor(STD, dtype=torch.float32)[:, None, None]
    want = torch.stack(
        [(torch.from_numpy(np.array(im)).permute(2, 0, 1).float() / 255 - mean) / std for im in images]
    )
    assert torch.equal(images_to(raw, torch.device("cpu")), want)
    assert torch.equal(torch.stack([t(im, random.Random(0)) for im in images]), want)  # the transform's own
    if torch.cuda.is_available():  # pinned, asynchronous copy, normalised on the GPU
        pinned = merge([{"images": raw[:2]}, {"images": raw[2:]}], pin_memory=True)["images"]
        assert pinned.is_pinned()
        assert torch.equal(images_to(pinned, torch.device("cuda")).cpu(), want)
    floats = torch.randn(2, 3, 4, 4)  # a custom transform's float output is only moved
    assert images_to(floats, torch.device("cpu")) is floats


def test_merge_joins_in_order_and_leaves_out_empty_pieces():
    a = Batch(
        torch.zeros(2, 3, 1, 1, dtype=torch.uint8), torch.zeros(2, 4, dtype=torch.long), keys=["a", "b"]
    )
    b = Batch(torch.ones(1, 3, 1, 1, dtype=torch.uint8), torch.ones(1, 4, dtype=torch.long), keys=["c"])
    out = merge([a, None, b])
    assert out.keys == ["a", "b", "c"] and out.images[:, 0, 0, 0].tolist() == [0, 0, 1]


def test_worker_batch_size_is_checked():
    with pytest.raises(ConfigError, match="data.worker_batch_size"):
        load_config(None, ["data.worker_batch_size=-1"])
