"""``mmalign curate --decontaminate``: evaluation images planted in a training pool are dropped.

The issue's test: CIFAR-10 test images, each with one edit (a mirror, a 28-30 px crop resized
back, a JPEG re-encode at quality 60-85, a resize), planted among clean CIFAR-10 train images;
curate with ``--decontaminate`` over a tar of test images must drop >= 95% of the planted ones,
each named with the test image it came from, and no clean train image. The truth is what this
file planted, not what curate computes. Plus the flags' one-line errors.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from tests.harness import ROOT, cli_main, pick_seed

CIFAR = ROOT / ".." / "shared" / "data" / "cifar10"
N_EVAL = 300  # test images in the evaluation set
N_PLANTED = 200  # of them, edited copies in the pool (50 of each edit)
N_CLEAN = 300  # train images in the pool
EDITS = ("flip", "crop", "jpeg", "resize")


def _images(path: Path, n: int, rng: np.random.Generator) -> list[tuple[str, bytes]]:
    """``n`` (name, JPEG bytes) drawn at random from a tar of class folders."""
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jpg")]
        chosen = sorted(rng.choice(len(members), n, replace=False).tolist())
        return [(members[i].name.removeprefix("./"), tar.extractfile(members[i]).read()) for i in chosen]


def _jpeg(image: Image.Image, quality: int = 95) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _edit(data: bytes, kind: str, rng: np.random.Generator) -> bytes:
    image = Image.open(io.BytesIO(data)).convert("RGB")
    w, h = image.size
    if kind == "flip":
        return _jpeg(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    if kind == "crop":
        side = int(rng.integers(28, 31))  # 28..30 of 32 px, anywhere, resized back
        x, y = int(rng.integers(0, w - side + 1)), int(rng.integers(0, h - side + 1))
        return _jpeg(image.crop((x, y, x + side, y + side)).resize((w, h), Image.Resampling.BICUBIC))
    if kind == "jpeg":
        return _jpeg(image, quality=int(rng.integers(60, 86)))
    side = int(rng.choice([24, 48, 64]))
    return _jpeg(image.resize((side, side), Image.Resampling.BILINEAR))


def _write(path: Path, samples: list[tuple[str, bytes, str]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, image, caption in samples:
            for ext, data in (("jpg", image), ("txt", caption.encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    if not (CIFAR / "test.tar").is_file() or not (CIFAR / "train.tar").is_file():
        pytest.skip(f"CIFAR-10 tars not found in {CIFAR}")
    rng = np.random.default_rng(pick_seed(43))
    root = tmp_path_factory.mktemp("decontaminate")
    test = _images(CIFAR / "test.tar", N_EVAL, rng)
    train = _images(CIFAR / "train.tar", N_CLEAN, rng)
    with tarfile.open(root / "eval.tar", "w") as tar:  # the evaluation set: a tar of class folders
        for name, data in test:
            info = tarfile.TarInfo(f"./{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pool, truth = [], {}
    for j, i in enumerate(rng.choice(N_EVAL, N_PLANTED, replace=False).tolist()):
        key = f"p{j:04d}"
        kind = EDITS[j % len(EDITS)]
        pool.append((key, _edit(test[i][1], kind, rng), "a photo"))
        truth[key] = (test[i][0].removesuffix(".jpg"), kind)
    pool += [(f"c{j:04d}", data, "a photo") for j, (_, data) in enumerate(train)]
    order = rng.permutation(len(pool))
    pool = [pool[k] for k in order]
    half = len(pool) // 2
    (root / "pool").mkdir()
    _write(root / "pool" / "00000.tar", pool[:half])
    _write(root / "pool" / "00001.tar", pool[half:])
    out = root / "out"
    run = cli_main(
        "curate",
        "--data",
        root / "pool",
        "--out",
        out,
        "--decontaminate",
        root / "eval.tar",
        "--no-progress",
    )
    assert run.returncode == 0, run.stderr + run.stdout
    return out, truth


def test_planted_test_images_are_found(planted):
    out, truth = planted
    frame = pd.read_parquet(out / "decisions.parquet")
    dropped = frame[~frame["kept"]]
    clean = frame[frame["key"].str.startswith("c")]
    assert clean["kept"].all(), clean[~clean["kept"]][["key", "reason"]].to_string()
    found = {k for k in dropped["key"] if k in truth}
    assert len(found) >= 0.95 * len(truth), f"found {len(found)} of {len(truth)}"
    by_kind = {kind: sum(1 for k, (_, kd) in truth.items() if kd == kind and k in found) for kind in EDITS}
    assert all(v > 0 for v in by_kind.values()), by_kind
    report = json.loads((out / "curate_report.json").read_text())["decontamination"]
    matches = {m["pool_key"]: m for m in report["matches"]}
    assert set(matches) == set(dropped["key"])
    for key in found:  # each named with the test image it was made from
        assert matches[key]["eval_key"] == truth[key][0], (key, matches[key], truth[key])
        reason = dropped.set_index("key").loc[key, "reason"]
        assert f"image {truth[key][0]} (" in reason and "near-duplicate of" in reason
    assert report["targets"][0]["images"] == N_EVAL and report["targets"][0]["skipped"] == {}
    page = (out / "curate_report.html").read_text()
    assert page.count("class='pair'") == len(matches)
    assert page.count("data:image/jpeg") >= 2 * len(matches)  # both sides of every pair


def test_kept_shards_hold_no_planted_image(planted):
    out, truth = planted
    kept = set()
    for tar_path in sorted(out.glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            kept |= {Path(m.name).stem for m in tar.getmembers()}
    missed = {k for k in truth if k in kept}
    assert len(missed) <= 0.05 * len(truth)
    assert sum(1 for k in kept if k.startswith("c")) == N_CLEAN


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--decontaminate", "no_such_suite"], "is not an evaluation set"),
        (["--decontaminate", "x.parquet"], "is not an evaluation set"),
        (["--decontaminate", "{TMP}/missing.tar"], "not found"),
        (["--decontaminate", "{TMP}/e.tar", "--decontaminate-distance", "64"], "--decontaminate-distance"),
        (["--decontaminate", "{TMP}/e.tar", "--decontaminate-distance", "-1"], "--decontaminate-distance"),
    ],
)
def test_bad_flags_one_line(tmp_path, flags, needle):
    _write(tmp_path / "e.tar", [("k", _jpeg(Image.new("RGB", (8, 8))), "x")])
    (tmp_path / "pool").mkdir()
    _write(tmp_path / "pool" / "00000.tar", [("k", _jpeg(Image.new("RGB", (8, 8))), "x")])
    flags = [f.replace("{TMP}", str(tmp_path)) for f in flags]
    run = cli_main("curate", "--data", tmp_path / "pool", "--out", tmp_path / "out", *flags)
    assert run.returncode == 2, run.stderr + run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], run.stderr
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- with a model: semantic matches too


def _smooth(rng: np.random.Generator, side: int = 48) -> Image.Image:
    base = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    return Image.fromarray(base).resize((side, side), Image.Resampling.BICUBIC)


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: curate reads the pixels written here
    return buf.getvalue()


def test_with_a_model_semantic_and_perceptual(tmp_path):
    """Reference: phash.distance over every (pool, eval) pair, and the model run here on each image
    alone (float32, cosines in float64); a pool sample is dropped when either is within its bound.
    Samples whose cosine lies within 2e-3 of 1 - eps are not judged (pool embeddings are float16)."""
    import torch

    from mmalign.data import phash
    from mmalign.evaluation.contamination import DEFAULT_DISTANCE
    from mmalign.models.load import load
    from tests.pipelines.test_curate_cli import _save_model

    rng = np.random.default_rng(pick_seed(11))
    model = _save_model(tmp_path / "model", 0)
    evals = [_smooth(rng) for _ in range(8)]
    with tarfile.open(tmp_path / "eval.tar", "w") as tar:
        for i, im in enumerate(evals):
            data = _png(im)
            info = tarfile.TarInfo(f"e{i}.png")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    pool = [evals[0], evals[1], evals[2].transpose(Image.Transpose.FLIP_LEFT_RIGHT)]
    pool += [_smooth(rng) for _ in range(21)]
    (tmp_path / "pool").mkdir()
    with tarfile.open(tmp_path / "pool" / "00000.tar", "w") as tar:
        for i, im in enumerate(pool):
            for ext, data in (("png", _png(im)), ("txt", b"a photo")):
                info = tarfile.TarInfo(f"s{i:03d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    eps = 0.02
    run = cli_main(
        "curate",
        "--data",
        tmp_path / "pool",
        "--model",
        model,
        "--out",
        tmp_path / "out",
        "--decontaminate",
        tmp_path / "eval.tar",
        "--dedupe-eps",
        eps,
        "--force",
        "--no-progress",
    )
    assert run.returncode == 0, run.stderr + run.stdout

    loaded = load(model)

    def emb(images) -> np.ndarray:  # (n, D) float64 unit rows, each image embedded alone in float32
        with torch.no_grad():
            rows = [
                loaded.model.encode_image(loaded.preprocess(im.convert("RGB"))[None]).float() for im in images
            ]
        return torch.nn.functional.normalize(torch.cat(rows), dim=-1).double().numpy()

    cos = emb(pool) @ emb(evals).T  # (24, 8)
    pq, pi = phash.hash_images(pool)
    eq, ei = phash.hash_images(evals)
    bits = np.array(
        [[phash.distance(pq[a], pi[a], eq[b], ei[b]) for b in range(8)] for a in range(len(pool))]
    )
    frame = pd.read_parquet(tmp_path / "out" / "decisions.parquet").set_index("key")
    report = json.loads((tmp_path / "out" / "curate_report.json").read_text())["decontamination"]
    by = {m["pool_key"]: m for m in report["matches"]}
    assert report["semantic_eps"] == eps
    judged = 0
    for a in range(len(pool)):
        key = f"s{a:03d}"
        if np.abs(cos[a] - (1 - eps)).min() < 2e-3:
            continue
        judged += 1
        perceptual = bits[a].min() <= DEFAULT_DISTANCE
        semantic = cos[a].max() > 1 - eps
        assert bool(frame.loc[key, "kept"]) == (not (perceptual or semantic)), (
            key,
            bits[a].min(),
            cos[a].max(),
        )
        if perceptual or semantic:
            want = (
                "perceptual+semantic"
                if perceptual and semantic
                else "perceptual"
                if perceptual
                else "semantic"
            )
            assert by[key]["by"] == want
            nearest = int(np.argmin(bits[a])) if perceptual else int(np.argmax(cos[a]))
            assert by[key]["eval_key"] == f"e{nearest}"
            assert by[key]["distance_bits"] == int(bits[a, nearest])
            assert abs(by[key]["cosine"] - cos[a, nearest]) < 2e-3
    assert judged >= 20
    assert {"s000", "s001", "s002"} <= set(by)  # the copies and the mirror


def test_targets_repeat_and_comma_lists():
    from data_pipelines.curate.decontaminate import parse_targets

    assert parse_targets(["a.tar,b.tar", "cifar10", " a.tar ", ""]) == ("a.tar", "b.tar", "cifar10")
    assert parse_targets([]) == ()


def test_two_targets_and_the_drop_guard(tmp_path):
    rng = np.random.default_rng(pick_seed(12))
    images = [_smooth(rng) for _ in range(6)]
    for name, part in (("a.tar", images[:3]), ("b.tar", images[3:])):
        _write(tmp_path / name, [(f"{name[0]}{i}", _png(im), "x") for i, im in enumerate(part)])
    (tmp_path / "pool").mkdir()
    _write(tmp_path / "pool" / "00000.tar", [(f"s{i}", _png(im), "x") for i, im in enumerate(images[1:5])])
    args = ["curate", "--data", tmp_path / "pool", "--no-progress", "--decontaminate"]
    refused = cli_main(*args, f"{tmp_path / 'a.tar'},{tmp_path / 'b.tar'}", "--out", tmp_path / "o1")
    assert refused.returncode == 2
    assert (
        len(refused.stderr.strip().splitlines()) == 1
        and "--decontaminate would drop 4 of 4" in refused.stderr
    )
    assert not (tmp_path / "o1" / "decisions.parquet").exists()
    run = cli_main(
        *args, tmp_path / "a.tar", "--decontaminate", tmp_path / "b.tar", "--out", tmp_path / "o2", "--force"
    )
    assert run.returncode == 0, run.stderr
    report = json.loads((tmp_path / "o2" / "curate_report.json").read_text())["decontamination"]
    pairs = {(m["pool_key"], Path(m["target"]).name, m["eval_key"]) for m in report["matches"]}
    assert pairs == {
        ("s0", "a.tar", "a1"),
        ("s1", "a.tar", "a2"),
        ("s2", "b.tar", "b0"),
        ("s3", "b.tar", "b1"),
    }
    assert [t["matched_pool_samples"] for t in report["targets"]] == [2, 2]
