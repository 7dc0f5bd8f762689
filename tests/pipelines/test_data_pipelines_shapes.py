import hashlib
import json
import tarfile

import pandas as pd

from data_pipelines import shapes
from mmalign.data.shards import expand_urls, read_samples


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_generator_is_deterministic_by_seed(tmp_path):
    a = shapes.generate_split(tmp_path / "a", "val", 30, seed=7, per_shard=20)
    b = shapes.generate_split(tmp_path / "b", "val", 30, seed=7, per_shard=20)
    c = shapes.generate_split(tmp_path / "c", "val", 30, seed=8, per_shard=20)
    assert a == b == c == {"00000.tar": 20, "00001.tar": 10}
    assert _digest(tmp_path / "a/val/00000.tar") == _digest(tmp_path / "b/val/00000.tar")
    assert _digest(tmp_path / "a/val/00000.tar") != _digest(tmp_path / "c/val/00000.tar")


def test_train_and_val_differ(tmp_path):
    shapes.generate_split(tmp_path, "train", 10, seed=1, per_shard=10)
    shapes.generate_split(tmp_path, "val", 10, seed=1, per_shard=10)
    assert _digest(tmp_path / "train/00000.tar") != _digest(tmp_path / "val/00000.tar")


def test_img2dataset_layout(shapes_dir):
    split = shapes_dir / "train"
    assert json.loads((split / "sizes.json").read_text()) == {"00000.tar": 200, "00001.tar": 200}
    stats = json.loads((split / "00001_stats.json").read_text())
    assert stats["count"] == stats["successes"] == 200 and stats["failures"] == 0
    with tarfile.open(split / "00001.tar") as tar:
        names = tar.getnames()[:3]
    assert names == ["000010000.jpg", "000010000.txt", "000010000.json"]
    table = pd.read_parquet(split / "00001.parquet")
    assert len(table) == 200 and {"key", "caption", "status", "sha256", "width", "height"} <= set(
        table.columns
    )
    assert table["key"].iloc[0] == "000010000"


def test_captions_describe_the_attributes(shapes_dir):
    samples = list(read_samples(expand_urls(f"{shapes_dir}/val/00000.tar")))
    assert len(samples) == 120
    for s in samples:
        meta = s["json"]
        assert len(s["captions"]) == 2 and s["captions"][0] != s["captions"][1]
        for cap in s["captions"]:
            assert meta["shape"] in cap and meta["colour"] in cap
        assert s["image"].size == (64, 64)
    # the attribute vocabularies are all exercised
    assert {s["json"]["shape"] for s in samples} == set(shapes.SHAPES)


def test_brace_expansion():
    assert expand_urls("d/{00000..00002}.tar") == ["d/00000.tar", "d/00001.tar", "d/00002.tar"]
    assert expand_urls(["a.tar", "b/{0..1}.tar"]) == ["a.tar", "b/0.tar", "b/1.tar"]


def test_shards_shapes_honours_per_shard(tmp_path, capsys):
    from mmalign.cli import main

    out = tmp_path / "s"
    assert (
        main(
            [
                "shards",
                "shapes",
                "--out",
                str(out),
                "--n-train",
                "30",
                "--n-val",
                "7",
                "--per-shard",
                "20",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    assert json.loads((out / "train" / "sizes.json").read_text()) == {"00000.tar": 20, "00001.tar": 10}
    assert json.loads((out / "val" / "sizes.json").read_text()) == {"00000.tar": 7}
    for bad in (["--per-shard", "0"], ["--per-shard", "10001"], ["--resize", "32"], ["--input", "x"]):
        assert main(["shards", "shapes", "--out", str(tmp_path / "bad"), *bad]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("mmalign: error:") and "\n" not in err
    assert not (tmp_path / "bad").exists()
