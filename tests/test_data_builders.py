"""Offline shard builders: class folders (dir and tar), tables, HF datasets on disk; dedupe,
resize, failures in stats, the CLI."""

import io
import json
import os
import random
import tarfile

import pandas as pd
import pytest
from PIL import Image

from data_pipelines.build import EncodeOptions, build_shards
from data_pipelines.sources import Captioner, hf_dataset, image_folder, load_templates, table
from mmalign.cli import main
from mmalign.data.shards import expand_urls, iter_tar_groups, read_samples

CLASSES = ["bird", "cat", "dog"]


def png(w=12, h=9) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (w, h), os.urandom(w * h * 3)).save(buf, format="PNG")
    return buf.getvalue()


def class_folder(root, rng):
    """root/CLASS/NNNN.png with random counts, one exact duplicate and one broken file."""
    files = {}
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(rng.randint(2, 5)):
            data = png()
            (root / c / f"{i:04d}.png").write_bytes(data)
            files[f"{c}/{i:04d}.png"] = data
    dup_of = rng.choice(sorted(files))
    (root / "cat" / "dup.png").write_bytes(files[dup_of])
    (root / "dog" / "broken.png").write_bytes(b"not an image")
    return files


def shard_rows(out):
    return pd.concat([pd.read_parquet(p) for p in sorted(out.glob("*.parquet"))], ignore_index=True)


def test_image_folder_dir_and_tar_give_the_same_shards(tmp_path):
    rng = random.Random()
    files = class_folder(tmp_path / "src", rng)
    with tarfile.open(tmp_path / "src.tar", "w") as tar:
        tar.add(tmp_path / "src", arcname=".")
    tset = load_templates("cifar10")
    assert len(tset["templates"]) == 18 and tset["classnames"][0] == "airplane"
    captioner = Captioner(load_templates("generic")["templates"])
    summaries = {}
    for name, src in (("dir", tmp_path / "src"), ("tar", tmp_path / "src.tar")):
        names, items = image_folder(src, captioner)
        assert names == CLASSES
        summaries[name] = build_shards(items, tmp_path / name, per_shard=4, progress=False)
        assert summaries[name]["written"] == len(files)  # the duplicate and the broken file are out
        assert summaries[name]["duplicates_removed"] == 1 and summaries[name]["failures"] == 1

    samples = list(read_samples(expand_urls(f"{tmp_path}/dir/{{00000..{summaries['dir']['shards'] - 1:05d}}}.tar")))
    assert len(samples) == len(files)
    sizes = json.loads((tmp_path / "dir" / "sizes.json").read_text())
    assert sum(sizes.values()) == len(files) and max(sizes.values()) == 4
    by_class = {}
    for s in samples:
        meta = s["json"]
        assert CLASSES[meta["label"]] == meta["classname"]
        assert s["captions"] == [t.format(c=meta["classname"]) for t in captioner.templates]
        by_class[meta["classname"]] = by_class.get(meta["classname"], 0) + 1
    kept, hashes = {}, set()  # the first of two identical files (in folder order) is the one kept
    for c in CLASSES:
        for f in sorted((tmp_path / "src" / c).iterdir()):
            data = f.read_bytes()
            if f.name != "broken.png" and data not in hashes:
                hashes.add(data)
                kept[c] = kept.get(c, 0) + 1
    assert by_class == kept
    stats = [json.loads(p.read_text()) for p in sorted((tmp_path / "dir").glob("*_stats.json"))]
    assert sum(s["failures"] for s in stats) == 1 and sum(s["successes"] for s in stats) == len(files)
    failed = shard_rows(tmp_path / "dir").query("status == 'failed'")
    assert len(failed) == 1 and "broken.png" in failed["source_path"].iloc[0]
    # the tar source yields the very same images and captions
    tar_samples = list(read_samples(expand_urls(f"{tmp_path}/tar/{{00000..{summaries['tar']['shards'] - 1:05d}}}.tar")))
    assert sorted(s["captions"][0] + s["json"]["source_sha256"] for s in tar_samples) == \
        sorted(s["captions"][0] + s["json"]["source_sha256"] for s in samples)


def test_table_source_with_resize_and_processes(tmp_path):
    rng = random.Random()
    rows = []
    for i in range(rng.randint(6, 12)):
        (tmp_path / f"im{i}.png").write_bytes(png(rng.randint(20, 40), rng.randint(20, 40)))
        rows.append({"path": f"im{i}.png", "text": f"picture number {i}\nsecond caption {i}", "score": i / 10})
    rows.append({"path": "missing.png", "text": "gone", "score": 0.0})
    for ext in ("csv", "tsv", "parquet"):
        frame = pd.DataFrame(rows)
        target = tmp_path / f"t.{ext}"
        if ext == "parquet":
            frame.to_parquet(target)
        else:
            frame.to_csv(target, sep="\t" if ext == "tsv" else ",", index=False)
        out = tmp_path / f"out_{ext}"
        summary = build_shards(table(target, "path", "text"), out, per_shard=5, progress=False, processes=2,
                               opts=EncodeOptions(resize=16, resize_mode="center_crop"))
        assert summary["written"] == len(rows) - 1 and summary["failures"] == 1
        got = list(read_samples(sorted(str(p) for p in out.glob("*.tar"))))
        assert [s["captions"] for s in got] == [r["text"].split("\n") for r in rows[:-1]]  # input order
        assert all(s["image"].size == (16, 16) for s in got)
    with pytest.raises(Exception, match="no column 'nope'"):
        list(table(tmp_path / "t.csv", "nope", "text"))


def test_hf_sources_from_local_files(tmp_path):
    import datasets

    rng = random.Random()
    n = rng.randint(4, 8)
    images = [png() for _ in range(n)]
    captions = [f"hf caption {i}" for i in range(n)]
    features = datasets.Features({"img": datasets.Image(), "text": datasets.Value("string")})
    ds = datasets.Dataset.from_dict({"img": [{"bytes": b, "path": None} for b in images], "text": captions},
                                    features=features)
    ds.save_to_disk(str(tmp_path / "disk"))
    ds.to_parquet(str(tmp_path / "data.parquet"))
    for fmt, path in (("disk", tmp_path / "disk"), ("parquet", tmp_path / "data.parquet")):
        items = list(hf_dataset(path, fmt, image_col="img", caption_col="text"))
        assert [i.captions for i in items] == [[c] for c in captions]
        assert [i.image for i in items] == images  # the encoded bytes, not re-encoded
    class_folder(tmp_path / "folder", rng)
    os.remove(tmp_path / "folder" / "dog" / "broken.png")
    items = list(hf_dataset(tmp_path / "folder", "imagefolder", captioner=Captioner(["a {c}"])))
    assert {tuple(i.captions) for i in items} == {(f"a {c}",) for c in CLASSES}
    assert all(i.meta["classname"] == CLASSES[i.meta["label"]] for i in items)


def test_cli_builds_shards_and_reports_mistakes(tmp_path, capsys):
    rng = random.Random()
    files = class_folder(tmp_path / "src", rng)
    code = main(["shards", "imagefolder", "--input", str(tmp_path / "src"), "--out", str(tmp_path / "out"),
                 "--templates", "generic", "--templates-per-image", "1", "--per-shard", "3", "--no-progress",
                 "--resize", "8"])
    assert code == 0
    groups = [g for p in sorted((tmp_path / "out").glob("*.tar")) for g in iter_tar_groups(str(p))]
    assert len(groups) == len(files)
    assert all(g["txt"].count(b"\n") == 0 for g in groups)  # one template each
    assert main(["shards", "imagefolder", "--input", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert main(["shards", "imagefolder", "--input", str(tmp_path / "src"), "--out", str(tmp_path / "x"),
                 "--templates", "nope"]) == 2
    assert "unknown template set 'nope'" in capsys.readouterr().err


def test_cifar10_tar_when_present(tmp_path):
    from pathlib import Path

    src = Path(__file__).resolve().parents[2] / "shared" / "data" / "cifar10" / "test.tar"
    if not src.is_file():
        pytest.skip("../shared/data/cifar10 not present")
    tset = load_templates("cifar10")
    names, items = image_folder(src, Captioner(tset["templates"], per_image=2, seed=0), tset["classnames"])
    first = [next(items) for _ in range(30)]
    summary = build_shards(iter(first), tmp_path, per_shard=20, progress=False)
    assert summary["written"] + summary["duplicates_removed"] == 30
    s = next(read_samples([str(tmp_path / "00000.tar")]))
    assert s["image"].size == (32, 32) and len(s["captions"]) == 2
    assert names[s["json"]["label"]] == s["json"]["classname"] and s["json"]["classname"] in s["captions"][0]
