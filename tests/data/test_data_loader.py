"""The streaming loader: exact mid-epoch resume, epoch coverage across ranks x workers,
sample-granular splitting with few shards, weighted sources, batch contents."""

import io
import json
import random
import tarfile

import pytest
import torch
from open_clip.tokenizer import SimpleTokenizer
from PIL import Image

from mmalign.config import AugmentConfig, ConfigError, DataConfig
from mmalign.data.loader import build_train_loader
from mmalign.data.transforms import train_transform

TOKENIZER = SimpleTokenizer(context_length=12)


def jpeg(size=(12, 10)) -> bytes:
    image = Image.frombytes("RGB", size, random.randbytes(size[0] * size[1] * 3))
    buf = io.BytesIO()
    image.save(buf, format="JPEG")
    return buf.getvalue()


def write_shard(path, samples):
    """samples: list of (key, {ext: bytes})."""
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def make_shards(root, sizes, rng, shard_id0=0):
    """Shards of random images with 1-3 caption lines and a class id; returns all keys."""
    keys = []
    for s, n in enumerate(sizes, start=shard_id0):
        samples = []
        for i in range(n):
            key = f"{s:05d}{i:04d}"
            caps = "\n".join(f"caption {key} {j} {rng.random():.6f}" for j in range(rng.randint(1, 3)))
            meta = {"key": key, "label": rng.randrange(5)}
            samples.append((key, {"jpg": jpeg(), "txt": caps.encode(), "json": json.dumps(meta).encode()}))
            keys.append(key)
        write_shard(root / f"{s:05d}.tar", samples)
    return keys


def loader_for(spec, *, mode, workers=2, buffer=7, batch=5, seed=0, rank=0, world_size=1, **data):
    aug = AugmentConfig(crop_scale=[0.5, 1.0], hflip=True, color_jitter=[0.4, 0.4, 0.4, 0.1])
    cfg = DataConfig(train=spec, mode=mode, workers=workers, shuffle_buffer=buffer, augment=aug, **data)
    return build_train_loader(
        cfg, train_transform(8, aug), TOKENIZER, batch, seed=seed, rank=rank, world_size=world_size
    )


def take(loader, n):
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    del it
    return out


@pytest.mark.parametrize("mode", ["resampled", "epoch"])
def test_resume_mid_epoch_yields_exactly_the_uninterrupted_samples(tmp_path, mode, seed):
    rng = random.Random(seed)
    sizes = [rng.randint(8, 16) for _ in range(3)]
    make_shards(tmp_path, sizes, rng)
    spec = f"{tmp_path}/{{00000..00002}}.tar"
    seed = rng.randrange(1000)
    total = 2 * sum(sizes) // 5 + 2  # crosses at least one epoch boundary in epoch mode
    cut = rng.randrange(3, total - 3, 2)  # odd: the resumed run must start on the second worker

    reference = take(loader_for(spec, mode=mode, seed=seed), total)

    first = loader_for(spec, mode=mode, seed=seed)
    head = take(first, cut)  # the DataLoader has prefetched beyond `cut` by now
    state = json.loads(json.dumps(first.state_dict()))
    resumed = loader_for(spec, mode=mode, seed=seed)
    resumed.load_state_dict(state)
    tail = take(resumed, total - cut)

    got = head + tail
    assert [b.keys for b in got] == [b.keys for b in reference]
    assert [b.captions for b in got] == [b.captions for b in reference]
    for a, b in zip(got, reference):  # the same crops, flips and jitter
        assert torch.equal(a.images, b.images)
    # a different seed gives a different stream (the comparison above can fail)
    other = take(loader_for(spec, mode=mode, seed=seed + 1), 3)
    assert [b.keys for b in other] != [b.keys for b in reference[:3]]


def test_resume_in_process_and_iterating_again_continues(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [rng.randint(6, 12), rng.randint(6, 12)], rng)
    spec = f"{tmp_path}/{{00000..00001}}.tar"
    reference = take(loader_for(spec, mode="epoch", workers=0), 8)
    loader = loader_for(spec, mode="epoch", workers=0)
    got = take(loader, 3) + take(loader, 5)  # a second iter() continues after consumed batches
    assert [b.keys for b in got] == [b.keys for b in reference]


def _epoch0_keys(loaders, batches):
    seen = []
    for loader in loaders:
        for b in take(loader, batches):
            seen += [k for k, e in zip(b.keys, b.epochs.tolist()) if e == 0]
    return seen


def test_epoch_mode_reads_each_sample_once_across_ranks_and_workers(tmp_path, seed):
    rng = random.Random(seed)
    # 8 shards of 7 for 2 ranks x 2 workers: each slot owns 14 samples per epoch.
    keys = make_shards(tmp_path, [7] * 8, rng)
    spec = f"{tmp_path}/{{00000..00007}}.tar"
    loaders = [loader_for(spec, mode="epoch", rank=r, world_size=2, batch=5) for r in range(2)]
    seen = _epoch0_keys(loaders, 8)  # 4 batches of 5 per slot > 14
    assert sorted(seen) == sorted(keys)


def test_fewer_shards_than_lanes_splits_a_shard_by_sample(tmp_path, seed):
    rng = random.Random(seed)
    keys = make_shards(tmp_path, [rng.randint(9, 13)], rng)
    spec = f"{tmp_path}/00000.tar"
    loaders = [loader_for(spec, mode="epoch", rank=r, world_size=2, batch=4) for r in range(2)]
    seen = _epoch0_keys(loaders, 4)  # 8 lanes of 1-2 samples each: 4 batches are past epoch 0
    assert sorted(seen) == sorted(keys)
    # resampled mode with one shard and 4 slots makes progress as well
    batches = take(loader_for(spec, mode="resampled", rank=1, world_size=2, batch=4), 3)
    assert all(set(b.keys) <= set(keys) for b in batches)


def test_weighted_sources(tmp_path, seed):
    rng = random.Random(seed)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    keys_a = make_shards(tmp_path / "a", [6, 6], rng)
    keys_b = make_shards(tmp_path / "b", [6, 6], rng, shard_id0=7)
    specs = [f"{tmp_path}/a/{{00000..00001}}.tar", f"{tmp_path}/b/{{00007..00008}}.tar"]
    only_b = take(loader_for(specs, mode="resampled", train_weights=[0, 1], workers=1), 4)
    assert {k for b in only_b for k in b.keys} <= set(keys_b)
    mixed = take(loader_for(specs, mode="resampled", train_weights=[1, 1], workers=1, batch=6), 10)
    got = {k for b in mixed for k in b.keys}
    assert got & set(keys_a) and got & set(keys_b)


def test_batch_contents_views_and_ids(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [10], rng)
    loader = loader_for(f"{tmp_path}/00000.tar", mode="epoch", workers=0, batch=4, views=2, id_field="label")
    batch = take(loader, 1)[0]
    assert batch.images.shape == batch.images2.shape == (4, 3, 8, 8)
    assert not torch.equal(batch.images, batch.images2)  # independently augmented views
    assert batch.tokens.shape == (4, 12) and batch.tokens.dtype == torch.long
    assert batch.ids.dtype == torch.long and batch.ids.shape == (4,)
    for key, caption, label in zip(batch.keys, batch.captions, batch.ids.tolist()):
        assert caption.startswith(f"caption {key} ")
        assert 0 <= label < 5
    assert batch.skipped == {}


def test_resume_with_other_workers_continues_but_another_global_batch_is_refused(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [6, 6], rng)
    spec = f"{tmp_path}/{{00000..00001}}.tar"
    reference = take(loader_for(spec, mode="epoch", workers=0), 5)
    loader = loader_for(spec, mode="epoch", workers=0)
    head = take(loader, 2)
    other = loader_for(spec, mode="epoch", workers=2)  # the workers may change: lanes are per row
    other.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    assert [b.keys for b in head + take(other, 3)] == [b.keys for b in reference]
    wider = loader_for(spec, mode="epoch", workers=0, batch=6)
    with pytest.raises(ConfigError, match="global batch"):
        wider.load_state_dict(loader.state_dict())


def test_too_few_samples_for_one_global_batch_is_an_error_not_a_hang(tmp_path, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [3], rng)  # 3 samples for a global batch of 2 ranks x 2 rows
    with pytest.raises(ConfigError, match="too few samples") as e:
        loader_for(f"{tmp_path}/00000.tar", mode="epoch", rank=1, world_size=2, batch=2)
    assert "\n" not in str(e.value) and "3 samples" in str(e.value) and "(4)" in str(e.value)
