"""Bad data is skipped and counted by reason, never fatal: hand-built broken shards."""

import io
import random
import tarfile

from open_clip.tokenizer import SimpleTokenizer
from PIL import Image

from mmalign.config import AugmentConfig, DataConfig
from mmalign.data.loader import build_train_loader
from mmalign.data.transforms import train_transform

TOKENIZER = SimpleTokenizer(context_length=12)
MAX_PIXELS = 900  # a 40x40 image (1600 pixels) is a "bomb" under this limit


def jpeg(size=(10, 10)) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", size, random.randbytes(size[0] * size[1] * 3)).save(buf, format="JPEG")
    return buf.getvalue()


def good(key):
    return key, {"jpg": jpeg(), "txt": f"a caption of {key}".encode(), "json": b'{"label": 1}'}


def bad_samples(prefix):
    """One sample per reason, with the reason expected."""
    broken = bytearray(jpeg())
    broken[len(broken) // 3 :] = random.randbytes(len(broken) - len(broken) // 3)
    return [
        ("corrupt_image", (f"{prefix}1", {"jpg": random.randbytes(300), "txt": b"random bytes"})),
        ("corrupt_image", (f"{prefix}2", {"jpg": bytes(broken[:40]), "txt": b"cut jpeg"})),
        ("missing_caption", (f"{prefix}3", {"jpg": jpeg(), "json": b'{"label": 2}'})),
        ("empty_caption", (f"{prefix}4", {"jpg": jpeg(), "txt": b"  \n \n"})),
        ("caption_not_utf8", (f"{prefix}5", {"jpg": jpeg(), "txt": b"caf\xe9 \xff\xfe"})),
        ("decompression_bomb", (f"{prefix}6", {"jpg": jpeg((40, 40)), "txt": b"too many pixels"})),
        ("extreme_aspect", (f"{prefix}9", {"jpg": jpeg((1, 25)), "txt": b"a 1 x 25 strip"})),
        ("missing_image", (f"{prefix}7", {"txt": b"a caption without an image"})),
        ("bad_json", (f"{prefix}8", {"jpg": jpeg(), "txt": b"ok", "json": b"{not json"})),
    ]


def tar_bytes(samples) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def loader(spec, batch=4, **kw):
    aug = AugmentConfig()
    cfg = DataConfig(train=spec, mode="epoch", max_image_pixels=MAX_PIXELS, **kw)
    return build_train_loader(cfg, train_transform(8, aug), TOKENIZER, batch, seed=1)


def test_each_kind_of_bad_sample_is_skipped_and_counted_in_order(tmp_path):
    # No shuffling, one shard, one lane (a global batch of 1), in-process: the order of events
    # is the write order.
    bad = bad_samples("bad")
    goods = [good(f"good{i}") for i in range(len(bad))]
    samples = [s for pair in zip((b for _, b in bad), goods) for s in pair]  # the last good one comes last
    raw = tar_bytes(samples + [good("cutoff")])
    cut = raw.index(b"cutoff.jpg") + 512 + 20  # inside the data of the last sample's first member
    (tmp_path / "00000.tar").write_bytes(raw[:cut])

    pil_limit = Image.MAX_IMAGE_PIXELS
    n = len(goods)
    batches = [
        b
        for _, b in zip(
            range(2 * n), iter(loader(str(tmp_path / "00000.tar"), workers=0, shuffle_buffer=1, batch=1))
        )
    ]
    assert Image.MAX_IMAGE_PIXELS == pil_limit  # in-process reading leaves PIL's global alone
    assert [b.keys[0] for b in batches[:n]] == [k for k, _ in goods]
    expected = {}
    for reason, _ in bad:
        expected[reason] = expected.get(reason, 0) + 1
    assert batches[n - 1].skipped == dict(sorted(expected.items()))
    # the next epoch starts after the truncated tail was met (once per shard read)
    assert [b.keys[0] for b in batches[n:]] == [k for k, _ in goods]
    assert [int(b.epochs[0]) for b in batches] == [0] * n + [1] * n
    assert batches[-1].skipped["truncated_tar"] == 1
    assert batches[-1].skipped["corrupt_image"] == 2 * expected["corrupt_image"]


def test_bad_shards_never_crash_a_multi_worker_run(tmp_path, seed):
    rng = random.Random(seed)
    goods = [good(f"g{i:03d}") for i in range(rng.randint(12, 20))]
    split = rng.randint(3, len(goods) - 3)
    bad = bad_samples("b")
    (tmp_path / "00000.tar").write_bytes(tar_bytes(goods[:split] + [b for _, b in bad]))
    truncated = tar_bytes(goods[split:] + [good("lost")])
    (tmp_path / "00001.tar").write_bytes(truncated[: truncated.index(b"lost.jpg") + 600])
    (tmp_path / "00002.tar").write_bytes(rng.randbytes(2000))  # not a tar at all
    (tmp_path / "00003.tar").write_bytes(b"")  # an empty file

    ld = loader(f"{tmp_path}/{{00000..00003}}.tar", workers=2, shuffle_buffer=5)
    seen, skipped = [], {}
    for _, batch in zip(range(12), iter(ld)):
        seen += [k for k, e in zip(batch.keys, batch.epochs.tolist()) if e == 0]
        skipped = batch.skipped
    assert sorted(seen) == sorted(k for k, _ in goods)  # every good sample, once, in epoch 0
    assert set(skipped) == {r for r, _ in bad} | {"truncated_tar", "unreadable_shard"}
    assert ld.skipped() == skipped  # aggregated over both workers, same as carried in the batch


def test_missing_id_field_is_a_counted_skip(tmp_path):
    samples = [good("a"), ("b", {"jpg": jpeg(), "txt": b"no label", "json": b'{"other": 1}'}), good("c")]
    (tmp_path / "00000.tar").write_bytes(tar_bytes(samples))
    batches = take_n(
        loader(str(tmp_path / "00000.tar"), workers=0, shuffle_buffer=1, batch=1, id_field="label"), 2
    )
    assert [b.keys[0] for b in batches] == ["a", "c"] and [b.ids.tolist() for b in batches] == [[1], [1]]
    assert batches[1].skipped == {"missing_id": 1}


def take_n(ld, n):
    return [b for _, b in zip(range(n), iter(ld))]


def _unusable_shards(tmp_path, n=2):
    """Shards where no sample can be used: captions without images, corrupt JPEGs, non-UTF-8 captions."""
    for s in range(n):
        samples = []
        for i in range(30):
            kind = i % 3
            members = (
                {"txt": b"a caption without an image"}
                if kind == 0
                else {"jpg": random.randbytes(200), "txt": b"random bytes"}
                if kind == 1
                else {"jpg": jpeg(), "txt": b"caf\xe9 \xff"}
            )
            samples.append((f"{s}{i:03d}", members))
        (tmp_path / f"{s:05d}.tar").write_bytes(tar_bytes(samples))
    return f"{tmp_path}/{{00000..{n - 1:05d}}}.tar"


import pytest  # noqa: E402

from mmalign.config import ConfigError  # noqa: E402


@pytest.mark.parametrize("mode", ["resampled", "epoch"])
@pytest.mark.parametrize("workers", [0, 1])
def test_shards_without_a_usable_sample_stop_with_one_line(tmp_path, mode, workers):
    """Today's failure: both modes looped forever (millions of skips, no step)."""
    import time

    spec = _unusable_shards(tmp_path)
    cfg = DataConfig(
        train=spec,
        mode=mode,
        max_image_pixels=MAX_PIXELS,
        workers=workers,
        shuffle_buffer=4,
        max_consecutive_skips=500,
    )
    t0 = time.time()
    with pytest.raises(ConfigError) as err:
        next(iter(build_train_loader(cfg, train_transform(8, AugmentConfig()), TOKENIZER, 4, seed=1)))
    assert time.time() - t0 < 60
    msg = str(err.value)
    assert (
        "\n" not in msg and "500 samples in a row were skipped" in msg and "data.max_consecutive_skips" in msg
    )
    for reason in ("missing_image", "corrupt_image", "caption_not_utf8"):
        assert reason in msg


def test_default_consecutive_skip_limit():
    assert DataConfig().max_consecutive_skips == 10_000


def test_consecutive_skip_limit_counts_only_unbroken_runs(tmp_path):
    """Good samples reset the run: 3 bad ones between goods never reach a limit of 4."""
    samples = []
    for i in range(40):
        samples.append(good(f"g{i:03d}"))
        samples += [(f"b{i:03d}{j}", {"txt": b"no image"}) for j in range(3)]
    (tmp_path / "00000.tar").write_bytes(tar_bytes(samples))
    cfg = DataConfig(
        train=str(tmp_path / "00000.tar"),
        mode="epoch",
        max_image_pixels=MAX_PIXELS,
        workers=0,
        shuffle_buffer=1,
        max_consecutive_skips=4,
    )
    batches = [
        b
        for _, b in zip(
            range(3),
            iter(build_train_loader(cfg, train_transform(8, AugmentConfig()), TOKENIZER, 20, seed=1)),
        )
    ]
    # 20 lanes of 8 samples (2 good ones each): no lane meets more than 3 bad ones in a row
    assert sorted(k for b in batches[:2] for k in b.keys) == [f"g{i:03d}" for i in range(40)]


def test_cli_train_on_unusable_shards_exits_2_with_one_line(tmp_path):
    from tests.harness import cli_main

    spec = _unusable_shards(tmp_path)
    proc = cli_main(
        "train",
        "--set",
        "model.preset=micro",
        "--set",
        f"data.train={spec}",
        "--set",
        "data.workers=0",
        "--set",
        "train.steps=2",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "monitor.probe_size=0",
        "--set",
        "data.max_consecutive_skips=1000",
        "--set",
        "train.global_batch_size=8",
        "--set",
        "eval.suite=none",
        "--set",
        f"output={tmp_path / 'run'}",
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [ln for ln in proc.stderr.replace("\r", "\n").splitlines() if "mmalign: error:" in ln]
    assert len(errors) == 1 and "1000 samples in a row were skipped" in errors[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
