"""Bad data is skipped and counted by reason, never fatal: hand-built broken shards."""

import io
import json
import os
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
    Image.frombytes("RGB", size, os.urandom(size[0] * size[1] * 3)).save(buf, format="JPEG")
    return buf.getvalue()


def good(key):
    return key, {"jpg": jpeg(), "txt": f"a caption of {key}".encode(), "json": b'{"label": 1}'}


def bad_samples(prefix):
    """One sample per reason, with the reason expected."""
    broken = bytearray(jpeg())
    broken[len(broken) // 3 :] = os.urandom(len(broken) - len(broken) // 3)
    return [
        ("corrupt_image", (f"{prefix}1", {"jpg": os.urandom(300), "txt": b"random bytes"})),
        ("corrupt_image", (f"{prefix}2", {"jpg": bytes(broken[:40]), "txt": b"cut jpeg"})),
        ("missing_caption", (f"{prefix}3", {"jpg": jpeg(), "json": b'{"label": 2}'})),
        ("empty_caption", (f"{prefix}4", {"jpg": jpeg(), "txt": b"  \n \n"})),
        ("caption_not_utf8", (f"{prefix}5", {"jpg": jpeg(), "txt": b"caf\xe9 \xff\xfe"})),
        ("decompression_bomb", (f"{prefix}6", {"jpg": jpeg((40, 40)), "txt": b"too many pixels"})),
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
    # No shuffling, one shard, in-process: the order of events is the write order.
    bad = bad_samples("bad")
    goods = [good(f"good{i}") for i in range(len(bad))]
    samples = [s for pair in zip((b for _, b in bad), goods) for s in pair]  # the last good one comes last
    raw = tar_bytes(samples + [good("cutoff")])
    cut = raw.index(b"cutoff.jpg") + 512 + 20  # inside the data of the last sample's first member
    (tmp_path / "00000.tar").write_bytes(raw[:cut])

    pil_limit = Image.MAX_IMAGE_PIXELS
    batches = [b for _, b in zip(range(2), iter(loader(str(tmp_path / "00000.tar"), workers=0,
                                                       shuffle_buffer=1, batch=len(goods))))]
    assert Image.MAX_IMAGE_PIXELS == pil_limit  # in-process reading leaves PIL's global alone
    assert batches[0]["keys"] == [k for k, _ in goods]
    expected = {}
    for reason, _ in bad:
        expected[reason] = expected.get(reason, 0) + 1
    assert batches[0]["skipped"] == dict(sorted(expected.items()))
    # the next epoch starts after the truncated tail was met (once per shard read)
    assert batches[1]["keys"] == [k for k, _ in goods]
    assert batches[1]["skipped"]["truncated_tar"] == 1
    assert batches[1]["skipped"]["corrupt_image"] == 2 * expected["corrupt_image"]


def test_bad_shards_never_crash_a_multi_worker_run(tmp_path):
    rng = random.Random()
    goods = [good(f"g{i:03d}") for i in range(rng.randint(12, 20))]
    split = rng.randint(3, len(goods) - 3)
    bad = bad_samples("b")
    (tmp_path / "00000.tar").write_bytes(tar_bytes(goods[:split] + [b for _, b in bad]))
    truncated = tar_bytes(goods[split:] + [good("lost")])
    (tmp_path / "00001.tar").write_bytes(truncated[: truncated.index(b"lost.jpg") + 600])
    (tmp_path / "00002.tar").write_bytes(os.urandom(2000))  # not a tar at all
    (tmp_path / "00003.tar").write_bytes(b"")  # an empty file

    ld = loader(f"{tmp_path}/{{00000..00003}}.tar", workers=2, shuffle_buffer=5)
    seen, skipped = [], {}
    for _, batch in zip(range(12), iter(ld)):
        seen += [k for k, e in zip(batch["keys"], batch["epochs"].tolist()) if e == 0]
        skipped = batch["skipped"]
    assert sorted(seen) == sorted(k for k, _ in goods)  # every good sample, once, in epoch 0
    assert set(skipped) == {r for r, _ in bad} | {"truncated_tar", "unreadable_shard"}
    assert ld.skipped() == skipped  # aggregated over both workers, same as carried in the batch


def test_missing_id_field_is_a_counted_skip(tmp_path):
    samples = [good("a"), ("b", {"jpg": jpeg(), "txt": b"no label", "json": b'{"other": 1}'}), good("c")]
    (tmp_path / "00000.tar").write_bytes(tar_bytes(samples))
    batch = next(iter(loader(str(tmp_path / "00000.tar"), workers=0, shuffle_buffer=1, batch=2, id_field="label")))
    assert batch["keys"] == ["a", "c"] and batch["ids"].tolist() == [1, 1]
    assert batch["skipped"] == {"missing_id": 1}
