"""The global sample order (mmalign/data/stream.py): row j of every global batch is lane j's
next sample, whatever the world size, worker count or piece size.

The references are naive and written here: the epoch's sample sequence spelled out shard by
shard, lane sizes counted by hand, the one-process run of the same global batch, a caption
drawn by hand from the sample's seed, open files and buffered samples counted directly.
"""

from __future__ import annotations

import random

import pytest
import torch

import mmalign.data.loader as loader_mod
import mmalign.data.stream as stream_mod
from mmalign.config import AugmentConfig
from mmalign.data.samples import SampleProcessor
from mmalign.data.seeds import CAPTION, draws, sample_seed
from mmalign.data.shard_sizes import ShardIndex
from mmalign.data.stream import EpochOrder, StreamSpec, shard_sequence
from mmalign.data.transforms import train_transform
from tests.data.test_data_loader import TOKENIZER, jpeg, loader_for, make_shards, take, write_shard

AUG = AugmentConfig(crop_scale=[0.5, 1.0], hflip=True, color_jitter=[0.4, 0.4, 0.4, 0.1])  # as loader_for's


def _spec(counts, lanes, mode, seed, sources=None, weights=(1.0,), buffer=1):
    n = len(counts)
    return StreamSpec(
        urls=tuple(f"s{u}.tar" for u in range(n)),
        sources=sources or (tuple(range(n)),),
        weights=tuple(weights),
        mode=mode,
        seed=seed,
        lanes=lanes,
        shuffle_buffer=buffer,
        max_image_pixels=1,
        index=ShardIndex(tuple(counts)),
    )


def _random_spec(rng, mode):
    """Random shard counts (about a third empty), lanes <= the samples (what the loader accepts)."""
    counts = [0 if rng.random() < 0.3 else rng.randint(1, 25) for _ in range(rng.randint(1, 9))]
    if not sum(counts):
        counts.append(rng.randint(1, 25))
    lanes = rng.randint(1, min(sum(counts), 40))
    sources, weights = None, (1.0,)
    if mode == "resampled" and len(counts) > 1 and rng.random() < 0.5:  # two weighted sources
        cut = rng.randint(1, len(counts) - 1)
        sources = (tuple(range(cut)), tuple(range(cut, len(counts))))
        weights = (rng.uniform(0.1, 2), rng.uniform(0.1, 2))
    return _spec(counts, lanes, mode, rng.randrange(2**31), sources, weights)


def _naive(spec, sequence):
    """The epoch's sequence by hand: each occurrence's samples from its rotation on, wrapping
    round; an empty shard is the marker ("empty", u) at its place."""
    out = []
    for u, rotation in sequence:
        count = spec.counts[u]
        out += [("empty", u)] if count == 0 else [(u, (rotation + i) % count) for i in range(count)]
    return out


def _expand(spec, pieces):
    out = []
    for u, first, stop in pieces:
        if first == stop:
            assert first == 0 and spec.counts[u] == 0, (u, first, stop)  # only empty shards give [u, 0, 0]
            out.append(("empty", u))
        else:
            assert 0 <= first < stop <= spec.counts[u], (u, first, stop)
            out += [(u, i) for i in range(first, stop)]
    return out


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
@pytest.mark.integration
def test_lane_pieces_concatenate_to_the_naive_epoch_sequence(mode, seed):
    rng = random.Random(seed)
    for _ in range(300):
        spec = _random_spec(rng, mode)
        order = EpochOrder(spec)
        for epoch in rng.sample(range(1000), 3):
            sequence = shard_sequence(spec, epoch)
            assert len(sequence) == len(spec.urls)
            if mode == "epoch":
                assert sorted(u for u, _ in sequence) == list(range(len(spec.urls)))
                assert all(r == 0 for _, r in sequence)
            else:
                allowed = {u for s, w in zip(spec.sources, spec.weights) if w > 0 for u in s}
                assert all(u in allowed and 0 <= r < max(1, spec.counts[u]) for u, r in sequence)
            naive = _naive(spec, sequence)
            samples = [x for x in naive if x[0] != "empty"]
            lanes = [_expand(spec, order.pieces(j, epoch)) for j in range(spec.lanes)]
            sizes = [sum(x[0] != "empty" for x in lane) for lane in lanes]
            assert max(sizes) - min(sizes) <= 1 and sum(sizes) == len(samples)
            ranges = [order.lane_range(j, epoch) for j in range(spec.lanes)]
            assert ranges[0][0] == 0 and ranges[-1][1] == len(samples)
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))  # contiguous, in lane order
            assert [b - a for a, b in ranges] == sizes
            got = [x for lane in lanes for x in lane]
            # empty shards exactly once, in place, also where the epoch drew fewer samples than lanes
            assert got == naive, (spec.counts, spec.lanes, epoch)


def test_resampled_epoch_with_fewer_samples_than_lanes_gives_each_empty_shard_to_one_lane():
    spec = _spec([2, 0, 9], 4, "resampled", seed=1)  # loader-valid: 11 samples >= 4 lanes
    assert shard_sequence(spec, 0) == [(1, 0), (0, 0), (1, 0)]  # 2 samples drawn for 4 lanes
    order = EpochOrder(spec)
    got = [p for j in range(4) for p in order.pieces(j, 0)]
    assert got.count([1, 0, 0]) == 2  # two occurrences of the empty shard: two pieces in all


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
def test_no_lane_drifts_ahead_over_many_epochs(mode, seed):
    rng = random.Random(seed)
    trials = 0
    while trials < 40:
        counts = [rng.randint(2, 30) for _ in range(rng.randint(1, 6))]
        if mode == "resampled":
            counts = [rng.choice([7, 11])] * len(counts)  # equal counts: N is the same every virtual epoch
        lanes = rng.randint(2, min(sum(counts), 50))
        if sum(counts) % lanes == 0:
            continue
        trials += 1
        order = EpochOrder(_spec(counts, lanes, mode, rng.randrange(2**31)))
        total = [0] * lanes
        for epoch in range(60):
            for j in range(lanes):
                start, stop = order.lane_range(j, epoch)
                total[j] += stop - start
            assert max(total) - min(total) <= 1, (counts, lanes, epoch, total)


def test_resampled_lanes_do_not_drift_with_unequal_shards():
    worst = 0
    for trial in range(20):
        rng = random.Random(trial)
        counts = [rng.randint(1, 30) for _ in range(6)]
        lanes = rng.randint(2, 20)
        order = EpochOrder(_spec(counts, lanes, "resampled", trial))
        total = [0] * lanes
        for epoch in range(60):
            for j in range(lanes):
                start, stop = order.lane_range(j, epoch)
                total[j] += stop - start
            worst = max(worst, max(total) - min(total))
    assert worst <= 1


B = 16  # the global batch of the layout tests


def _global(spec, mode, world, workers, seed, steps, **data):
    """The global batches of a layout, by hand: each step's rank batches joined in rank order."""
    per_rank = [
        take(
            loader_for(
                spec,
                mode=mode,
                workers=workers,
                buffer=24,
                batch=B // world,
                seed=seed,
                rank=r,
                world_size=world,
                **data,
            ),
            steps,
        )
        for r in range(world)
    ]
    out = []
    for t in range(steps):
        parts = [batches[t] for batches in per_rank]
        out.append(
            {
                "keys": [k for p in parts for k in p.keys],
                "captions": [c for p in parts for c in p.captions],
                "seeds": torch.cat([p.seeds for p in parts]),
                "epochs": torch.cat([p.epochs for p in parts]),
                "images": torch.cat([p.images for p in parts]),
            }
        )
    return out


@pytest.mark.parametrize("mode", ["epoch", "resampled", "weighted"])
@pytest.mark.integration
def test_the_global_batch_is_the_same_for_every_layout(tmp_path, mode, seed):
    rng = random.Random(seed)
    data = {}
    if mode == "weighted":  # resampled from two sources, weights 1 : 2
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        make_shards(tmp_path / "a", [rng.randint(6, 12) for _ in range(2)], rng)
        make_shards(tmp_path / "b", [rng.randint(6, 12) for _ in range(2)], rng, shard_id0=5)
        spec = [f"{tmp_path}/a/{{00000..00001}}.tar", f"{tmp_path}/b/{{00005..00006}}.tar"]
        mode, data = "resampled", {"train_weights": [1, 2]}
    else:
        make_shards(tmp_path, [rng.randint(10, 15) for _ in range(4)], rng)  # 40-60 samples < 6 x 16 rows
        spec = f"{tmp_path}/{{00000..00003}}.tar"
    seed, steps = rng.randrange(1000), 6
    reference = _global(spec, mode, 1, 0, seed, steps, **data)
    assert all(len(g["keys"]) == B and g["images"].dtype == torch.uint8 for g in reference)
    if mode == "epoch":
        assert reference[-1]["epochs"].max() >= 1  # the run crosses the end of epoch 0
    layouts = [
        (1, 2, 0),
        (2, 1, 0),
        (2, 2, 0),
        (4, 0, 0),
        (8, 1, 0),
        (1, 2, 3),
    ]  # (world, workers, piece size)
    for world, workers, piece in layouts:
        got = _global(spec, mode, world, workers, seed, steps, worker_batch_size=piece, **data)
        for t, (g, want) in enumerate(zip(got, reference)):
            where = (world, workers, piece, t)
            assert g["keys"] == want["keys"] and g["captions"] == want["captions"], where
            assert torch.equal(g["seeds"], want["seeds"]) and torch.equal(g["epochs"], want["epochs"]), where
            assert torch.equal(g["images"], want["images"]), where


def test_a_samples_randomness_is_its_own(seed):
    rng = random.Random(seed)
    transform = train_transform(8, AUG)
    processor = SampleProcessor(transform, TOKENIZER)
    two_views = SampleProcessor(transform, TOKENIZER, views=2)
    crops_differ = views_differ = 0
    for i in range(8):
        key = f"shard/{i:09d}"
        captions = [f"caption {i} {j} {rng.random():.6f}" for j in range(4)]
        members = {"jpg": jpeg((40, 32)), "txt": "\n".join(captions).encode()}
        s0, s1 = sample_seed(seed, 0, key.rsplit("/", 1)[-1]), sample_seed(seed, 1, key.rsplit("/", 1)[-1])
        a, again, other = (
            processor(key, members, s0),
            processor(key, dict(members), s0),
            processor(key, members, s1),
        )
        assert a["seed"] == s0 and a["key"] == f"{i:09d}"
        assert a["caption"] == again["caption"] and torch.equal(a["image"], again["image"])
        assert a["caption"] == captions[draws(s0, CAPTION).randrange(len(captions))]  # the caption by hand
        assert other["caption"] == captions[draws(s1, CAPTION).randrange(len(captions))]
        crops_differ += not torch.equal(a["image"], other["image"])
        pair = two_views(key, members, s0)
        assert torch.equal(pair["image"], a["image"])  # the first view is the one-view image
        views_differ += not torch.equal(pair["image"], pair["image2"])
    assert crops_differ >= 1 and views_differ >= 1


def _peak_buffers(monkeypatch, loader, worker, steps):
    """Run one worker's dataset in this process; the most raw samples its lanes' buffers held.

    A buffer only grows inside LaneStream._fill, so the total is measured at the end of each fill."""
    lanes = []

    class Tracked(stream_mod.LaneStream):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            lanes.append(self)

        def _fill(self):
            super()._fill()
            peak[0] = max(peak[0], sum(len(lane.buffer) for lane in lanes))

    peak = [0]
    monkeypatch.setattr(loader_mod, "LaneStream", Tracked)
    dataset = loader_mod._Lanes(loader.spec, loader.processor, [loader.pieces[worker]], {})
    items = iter(dataset)
    for _ in range(steps * len(loader.pieces[worker])):  # one item per piece
        _, info = next(items)
        assert "error" not in info
    return peak[0], len(lanes)


def test_memory_per_worker_is_bounded_and_does_not_grow_with_the_cluster(tmp_path, monkeypatch, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [rng.randint(38, 44) for _ in range(4)], rng)  # >= 152 samples: >= 9 per lane of 16
    spec = f"{tmp_path}/{{00000..00003}}.tar"
    shuffle = 80
    # Bound: a worker holding L lanes buffers at most L * ceil(shuffle_buffer / B) raw samples
    # (each lane refills to its share of the buffer, then hands one on); with B lanes in one
    # worker that is < shuffle_buffer + B, and with one lane per worker it is ceil(shuffle_buffer / B).
    one = loader_for(spec, mode="epoch", workers=0, buffer=shuffle, batch=16)
    peak, lanes = _peak_buffers(monkeypatch, one, 0, steps=8)
    assert lanes == 16 and one.spec.lane_buffer == 5
    assert 16 * (5 - 1) < peak <= 16 * one.spec.lane_buffer  # the buffers do fill, and no further
    many = [
        loader_for(spec, mode="epoch", workers=8, buffer=shuffle, batch=8, rank=r, world_size=8)
        for r in (0, 7)
    ]
    for loader in many:  # 64 lanes over 8 ranks x 8 workers: one lane per worker
        assert loader.spec.lane_buffer == 2
        for worker in (0, 7):
            peak_many, lanes = _peak_buffers(monkeypatch, loader, worker, steps=6)
            assert lanes == 1 and 1 <= peak_many <= 1 * loader.spec.lane_buffer
            assert peak_many < peak  # one worker's share shrinks as the cluster grows


def _count_open_files(monkeypatch):
    """Patch the stream's open_shard; returns [open now, most open at once]."""
    real, count = stream_mod.open_shard, [0, 0]

    class Counted:
        def __init__(self, f):
            self._f, self._open = f, True
            count[0] += 1
            count[1] = max(count[1], count[0])

        def close(self):
            if self._open:
                self._open = False
                count[0] -= 1
            self._f.close()

        def __getattr__(self, name):
            return getattr(self._f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

    monkeypatch.setattr(stream_mod, "open_shard", lambda *a, **k: Counted(real(*a, **k)))
    return count


@pytest.mark.parametrize("mode", ["epoch", "resampled"])
def test_a_worker_with_many_lanes_keeps_few_shards_open(tmp_path, monkeypatch, mode, seed):
    rng = random.Random(seed)
    make_shards(tmp_path, [rng.randint(8, 14) for _ in range(5)], rng)
    spec, lanes, limit, steps = f"{tmp_path}/{{00000..00004}}.tar", 10, 4, 14  # > one epoch (<= 70 samples)
    seed = rng.randrange(1000)

    def run():
        count = _count_open_files(monkeypatch)
        loader = loader_for(spec, mode=mode, workers=0, buffer=30, batch=lanes, seed=seed)
        batches, open_now = [], []
        for batch in iter(loader):
            batches.append(batch)
            open_now.append(count[0])
            if len(batches) == steps:
                break
        return batches, open_now, count[1]

    plain, _, plain_peak = run()  # default MAX_OPEN_LANES (64): every lane keeps its shard open
    assert plain_peak > limit + 1  # the counting sees them (the check below can fail)
    monkeypatch.setattr(loader_mod, "MAX_OPEN_LANES", limit)
    closing, open_now, peak = run()
    assert max(open_now) <= limit + 1 and peak <= limit + 1
    for a, b in zip(closing, plain, strict=True):
        assert a.keys == b.keys and a.captions == b.captions
        assert (
            torch.equal(a.images, b.images)
            and torch.equal(a.seeds, b.seeds)
            and torch.equal(a.epochs, b.epochs)
        )


def test_epoch_mode_with_bad_data_reads_each_good_sample_once_in_every_layout(tmp_path, seed):
    rng = random.Random(seed)
    good = make_shards(tmp_path, [rng.randint(8, 12) for _ in range(3)], rng)
    bad_key = "000030001"
    samples = [(f"00003{i:04d}", {"jpg": jpeg(), "txt": f"caption {i}".encode()}) for i in range(6)]
    samples[1] = (bad_key, {"jpg": rng.randbytes(200), "txt": b"a corrupt image"})
    write_shard(tmp_path / "00003.tar", samples)
    good += [k for k, _ in samples if k != bad_key]
    (tmp_path / "00004.tar").write_bytes(rng.randbytes(3000))  # no tar at all
    spec, lanes = f"{tmp_path}/{{00000..00004}}.tar", 8
    steps = -(-(len(good) + 1) // lanes) + 2  # every lane is past epoch 0
    seed = rng.randrange(1000)
    skips = []
    for world, workers in ((1, 0), (2, 2)):
        loaders = [
            loader_for(
                spec,
                mode="epoch",
                workers=workers,
                buffer=16,
                batch=lanes // world,
                seed=seed,
                rank=r,
                world_size=world,
            )
            for r in range(world)
        ]
        seen = []
        for loader in loaders:
            for b in take(loader, steps):
                seen += [k for k, e in zip(b.keys, b.epochs.tolist()) if e == 0]
        assert sorted(seen) == sorted(good), (world, workers)  # each good sample once, the bad one never
        total = {}
        for loader in loaders:
            for reason, n in loader.skipped().items():
                total[reason] = total.get(reason, 0) + n
        assert total.get("corrupt_image", 0) >= 1 and total.get("unreadable_shard", 0) >= 1, total
        skips.append(total)
    assert skips[0] == skips[1]


def test_the_shard_index_keeps_every_stride_th_offset_and_reads_each_shard_once(tmp_path, monkeypatch):
    """A stride above the minimum (forced: a tiny offset budget): every shard's offsets equal a
    direct header pass at that stride, the first shard (whose count sets the stride) included,
    and each shard is opened once."""
    from mmalign.data import shard_sizes as ss

    make_shards(tmp_path, [70, 50, 33], random.Random(0))
    urls = [str(tmp_path / f"{s:05d}.tar") for s in range(3)]
    opened = []
    real = ss.open_shard
    monkeypatch.setattr(ss, "open_shard", lambda url, *a: (opened.append(url), real(url, *a))[1])
    monkeypatch.setattr(ss, "MAX_OFFSETS", 4)  # 3 x 70 samples > 4 x 32: the stride doubles to 64
    index = ss.shard_sizes(urls)
    assert sorted(opened) == sorted(urls)
    monkeypatch.setattr(ss, "open_shard", real)
    assert index.stride == 64 and index.counts == (70, 50, 33)
    assert [list(o) for o in index.offsets] == [list(ss.count_samples(u, stride=64)[1]) for u in urls]
    assert index.start(0, 69) == (index.offsets[0][1], 64)  # the offset below sample 69: sample 64's
