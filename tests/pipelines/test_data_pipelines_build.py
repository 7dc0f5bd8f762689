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
from tests.harness import ROOT

CLASSES = ["bird", "cat", "dog"]


def png(w=12, h=9) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (w, h), random.randbytes(w * h * 3)).save(buf, format="PNG")
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


def test_image_folder_dir_and_tar_give_the_same_shards(tmp_path, seed):
    rng = random.Random(seed)
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

    samples = list(
        read_samples(expand_urls(f"{tmp_path}/dir/{{00000..{summaries['dir']['shards'] - 1:05d}}}.tar"))
    )
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
    tar_samples = list(
        read_samples(expand_urls(f"{tmp_path}/tar/{{00000..{summaries['tar']['shards'] - 1:05d}}}.tar"))
    )
    assert sorted(s["captions"][0] + s["json"]["source_sha256"] for s in tar_samples) == sorted(
        s["captions"][0] + s["json"]["source_sha256"] for s in samples
    )


def test_table_source_with_resize_and_processes(tmp_path, seed):
    rng = random.Random(seed)
    rows = []
    for i in range(rng.randint(6, 12)):
        (tmp_path / f"im{i}.png").write_bytes(png(rng.randint(20, 40), rng.randint(20, 40)))
        rows.append(
            {"path": f"im{i}.png", "text": f"picture number {i}\nsecond caption {i}", "score": i / 10}
        )
    rows.append({"path": "missing.png", "text": "gone", "score": 0.0})
    for ext in ("csv", "tsv", "parquet"):
        frame = pd.DataFrame(rows)
        target = tmp_path / f"t.{ext}"
        if ext == "parquet":
            frame.to_parquet(target)
        else:
            frame.to_csv(target, sep="\t" if ext == "tsv" else ",", index=False)
        out = tmp_path / f"out_{ext}"
        summary = build_shards(
            table(target, "path", "text"),
            out,
            per_shard=5,
            progress=False,
            processes=2,
            opts=EncodeOptions(resize=16, resize_mode="center_crop"),
        )
        assert summary["written"] == len(rows) - 1 and summary["failures"] == 1
        got = list(read_samples(sorted(str(p) for p in out.glob("*.tar"))))
        assert [s["captions"] for s in got] == [r["text"].split("\n") for r in rows[:-1]]  # input order
        assert all(s["image"].size == (16, 16) for s in got)
    with pytest.raises(Exception, match="no column 'nope'"):
        list(table(tmp_path / "t.csv", "nope", "text"))


def test_hf_sources_from_local_files(tmp_path, seed):
    import datasets

    rng = random.Random(seed)
    n = rng.randint(4, 8)
    images = [png() for _ in range(n)]
    captions = [f"hf caption {i}" for i in range(n)]
    features = datasets.Features({"img": datasets.Image(), "text": datasets.Value("string")})
    ds = datasets.Dataset.from_dict(
        {"img": [{"bytes": b, "path": None} for b in images], "text": captions}, features=features
    )
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


def test_cli_builds_shards_and_reports_mistakes(tmp_path, capsys, seed):
    rng = random.Random(seed)
    files = class_folder(tmp_path / "src", rng)
    code = main(
        [
            "shards",
            "imagefolder",
            "--input",
            str(tmp_path / "src"),
            "--out",
            str(tmp_path / "out"),
            "--templates",
            "generic",
            "--templates-per-image",
            "1",
            "--per-shard",
            "3",
            "--no-progress",
            "--resize",
            "8",
        ]
    )
    assert code == 0
    groups = [g for p in sorted((tmp_path / "out").glob("*.tar")) for g in iter_tar_groups(str(p))]
    assert len(groups) == len(files)
    assert all(g["txt"].count(b"\n") == 0 for g in groups)  # one template each
    assert (
        main(["shards", "imagefolder", "--input", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")])
        == 2
    )
    assert (
        main(
            [
                "shards",
                "imagefolder",
                "--input",
                str(tmp_path / "src"),
                "--out",
                str(tmp_path / "x"),
                "--templates",
                "nope",
            ]
        )
        == 2
    )
    assert "unknown template set 'nope'" in capsys.readouterr().err


def test_cifar10_tar_when_present(tmp_path):

    src = ROOT.parent / "shared" / "data" / "cifar10" / "test.tar"
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


def jpeg(w=12, h=9, mode="RGB") -> bytes:
    buf = io.BytesIO()
    Image.frombytes(mode, (w, h), random.randbytes(w * h * len(mode))).save(buf, format="JPEG", quality=75)
    return buf.getvalue()


def sorted_class_tree(root, per_class=8):
    """root/CLASS/NNNN.jpg, the sorted-folder layout of CIFAR's class tars."""
    files = {}
    for c in CLASSES:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            files[f"{c}/{i:04d}.jpg"] = data = jpeg()
            (root / c / f"{i:04d}.jpg").write_bytes(data)
    return files


def shard_members(out, shard=None):
    tars = sorted(out.glob("*.tar")) if shard is None else [out / f"{shard:05d}.tar"]
    return [g for p in tars for g in iter_tar_groups(str(p))]


@pytest.mark.parametrize("form", ["dir", "tar", "tar.gz"])
def test_imagefolder_shards_are_shuffled_and_keep_their_source(tmp_path, form):
    files = sorted_class_tree(tmp_path / "src")
    src = tmp_path / "src"
    if form != "dir":
        src = tmp_path / f"src.{form}"
        with tarfile.open(src, "w:gz" if form == "tar.gz" else "w") as tar:
            tar.add(tmp_path / "src", arcname=".")
    base = [
        "shards",
        "imagefolder",
        "--input",
        str(src),
        "--templates",
        "generic",
        "--per-shard",
        "6",
        "--no-progress",
    ]
    assert main(base + ["--out", str(tmp_path / "a")]) == 0
    assert main(base + ["--out", str(tmp_path / "b")]) == 0
    assert main(base + ["--out", str(tmp_path / "c"), "--seed", "1"]) == 0
    assert (
        main(base + ["--out", str(tmp_path / "plain"), "--no-shuffle", "--templates-per-image", "all"]) == 0
    )
    generic = load_templates("generic")["templates"]
    for g in shard_members(tmp_path / "a"):  # one caption per image by default, a template of the set
        (caption,) = g["txt"].decode().split("\n")
        assert caption in {t.format(c=json.loads(g["json"])["classname"]) for t in generic}
    assert len({g["txt"] for g in shard_members(tmp_path / "a")}) > len(
        CLASSES
    )  # drawn per image, not per class
    for g in shard_members(tmp_path / "plain"):  # 'all': every template, the old behaviour
        assert g["txt"].decode().split("\n") == [
            t.format(c=json.loads(g["json"])["classname"]) for t in generic
        ]
    first = [json.loads(g["json"]) for g in shard_members(tmp_path / "a", 0)]
    # 6 of 24 samples all from one of 3 classes of 8 has probability 3*C(8,6)/C(24,6) < 1e-3 per seed
    assert len({m["classname"] for m in first}) > 1
    assert {json.loads(g["json"])["classname"] for g in shard_members(tmp_path / "plain", 0)} == {"bird"}
    order = lambda out: [json.loads(g["json"])["source_path"] for g in shard_members(out)]  # noqa: E731
    assert order(tmp_path / "a") == order(tmp_path / "b") != order(tmp_path / "c")  # seeded
    assert sorted(order(tmp_path / "a")) == sorted(files) == order(tmp_path / "plain")
    for g in shard_members(tmp_path / "a"):  # each .json names its file; the JPEG is that file's bytes
        meta = json.loads(g["json"])
        assert meta["source_path"].split("/")[0] == meta["classname"]
        assert g["jpg"] == files[meta["source_path"]]


def test_jpegs_needing_no_resize_are_stored_as_is(tmp_path):
    from data_pipelines.build import encode
    from data_pipelines.sources import Item

    small, grey, png_ = jpeg(12, 9), jpeg(12, 9, "L"), png(12, 9)
    as_is = lambda data, **kw: encode(Item(data, ["x"]), EncodeOptions(**kw))["jpg"] == data  # noqa: E731
    assert as_is(small)
    assert as_is(small, resize=9)  # the shorter side is already 9
    assert not as_is(small, resize=9, resize_mode="center_crop")  # 12x9 -> 9x9
    assert not as_is(small, resize=6)
    assert not as_is(grey) and not as_is(png_)  # re-encoded as RGB JPEG, as before
    out = encode(Item(small, ["x"]), EncodeOptions(resize=6))
    assert (out["width"], out["height"]) == (8, 6) and Image.open(io.BytesIO(out["jpg"])).size == (8, 6)
    assert "error" in encode(Item(small[: len(small) // 2], ["x"]), EncodeOptions())  # truncated: a failure
    (tmp_path / "cat").mkdir()
    (tmp_path / "cat" / "0000.jpg").write_bytes(small)
    build_shards(image_folder(tmp_path, Captioner(["a {c}"]))[1], tmp_path / "out", progress=False)
    assert shard_members(tmp_path / "out")[0]["jpg"] == small
