"""Shards written by img2dataset (and by tar writers in other formats) load unchanged."""

import io
import json
import random
import tarfile

import pandas as pd
import pytest
from open_clip.tokenizer import SimpleTokenizer
from PIL import Image

from mmalign.config import DataConfig
from mmalign.data.loader import build_train_loader
from mmalign.data.shards import read_samples
from mmalign.data.tario import iter_samples, read_sample_at
from mmalign.data.transforms import train_transform


def jpeg(w, h) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (w, h), random.randbytes(w * h * 3)).save(buf, format="JPEG")
    return buf.getvalue()


def img2dataset_shard(out, shard_id, n, rng):
    """What img2dataset writes for one shard: KEY.jpg/.txt/.json via a PAX tar, plus .parquet and _stats.json.

    Keys are the shard id times 10^k plus the index (here k=4, 9 digits), and failed
    downloads leave gaps in the key sequence.
    """
    rows, expected = [], {}
    with tarfile.open(out / f"{shard_id:05d}.tar", "w", format=tarfile.PAX_FORMAT) as tar:
        for i in range(n):
            key = f"{shard_id * 10**4 + i:09d}"
            if rng.random() < 0.2:  # a failed download: only a parquet row
                rows.append(
                    {
                        "url": f"http://x/{key}.jpg",
                        "key": key,
                        "caption": None,
                        "status": "failed_to_download",
                        "error_message": "timeout",
                        "width": None,
                        "height": None,
                        "sha256": None,
                    }
                )
                continue
            w, h = rng.randint(8, 30), rng.randint(8, 30)
            caption = f"photo {key} of a thing"
            meta = {
                "url": f"http://x/{key}.jpg",
                "key": key,
                "status": "success",
                "error_message": None,
                "width": w,
                "height": h,
                "original_width": w * 4,
                "original_height": h * 4,
                "exif": "{}",
                "sha256": "0" * 64,
                "caption": caption,
            }
            for ext, data in (
                ("jpg", jpeg(w, h)),
                ("txt", caption.encode()),
                ("json", json.dumps(meta).encode()),
            ):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.uname, info.gname, info.mtime = len(data), "bigdata", "bigdata", 1_700_000_000
                tar.addfile(info, io.BytesIO(data))
            rows.append(
                {
                    k: meta[k]
                    for k in ("url", "key", "caption", "status", "error_message", "width", "height", "sha256")
                }
            )
            expected[key] = caption
    pd.DataFrame(rows).to_parquet(out / f"{shard_id:05d}.parquet")
    (out / f"{shard_id:05d}_stats.json").write_text(
        json.dumps(
            {
                "count": n,
                "successes": len(expected),
                "failed_to_download": n - len(expected),
                "failed_to_resize": 0,
            }
        )
    )
    return expected


def test_img2dataset_shards_load_unchanged(tmp_path, seed):
    rng = random.Random(seed)
    expected = {}
    for shard_id in range(2):
        expected.update(img2dataset_shard(tmp_path, shard_id, rng.randint(10, 20), rng))
    spec = f"{tmp_path}/{{00000..00001}}.tar"
    cfg = DataConfig(train=spec, mode="epoch", workers=2, shuffle_buffer=4, id_field="key")
    loader = build_train_loader(
        cfg, train_transform(8, cfg.augment), SimpleTokenizer(context_length=10), 3, seed=0
    )
    seen = {}
    for _, batch in zip(range(2 * len(expected)), iter(loader)):
        for key, caption, epoch in zip(batch.keys, batch.captions, batch.epochs.tolist()):
            if epoch == 0:
                assert key not in seen
                seen[key] = caption
        if min(batch.epochs.tolist()) >= 1 and len(seen) == len(expected):
            break
    assert seen == expected
    assert loader.skipped() == {}
    # the evaluation reader agrees
    assert {
        s["key"]: s["captions"][0] for s in read_samples([f"{tmp_path}/00000.tar", f"{tmp_path}/00001.tar"])
    } == expected


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT, tarfile.USTAR_FORMAT])
def test_tar_formats_long_names_and_offsets(tmp_path, fmt, seed):
    rng = random.Random(seed)
    # ustar keeps long paths as a directory prefix (<= 155) plus a name (<= 100)
    folder, limit = ("d" * 60, 90) if fmt == tarfile.USTAR_FORMAT else ("dir", 250)
    names = []
    with tarfile.open(tmp_path / "a.tar", "w", format=fmt) as tar:
        d = tarfile.TarInfo(folder)
        d.type = tarfile.DIRTYPE
        tar.addfile(d)
        for i in range(rng.randint(3, 7)):
            key = f"{folder}/" + "k" * rng.randint(1, limit - 20) + f"{i:03d}"
            names.append(key)
            for ext in ("jpg", "txt"):
                data = f"{key}.{ext}".encode() * rng.randint(1, 300)
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    with open(tmp_path / "a.tar", "rb") as f:
        samples = list(iter_samples(f))
        assert [s.key for s in samples] == names
        for s in samples:
            assert s.members["txt"] == f"{s.key}.txt".encode() * (
                len(s.members["txt"]) // len(f"{s.key}.txt")
            )
        pick = rng.choice(samples)  # random access by offset gives back the same sample
        again = read_sample_at(f, pick.offset, pick.index)
        assert (again.key, again.members) == (pick.key, pick.members)
