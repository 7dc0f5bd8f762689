"""``mmalign curate --dedupe perceptual`` end to end, on a small generated pool of edited copies.

The pool: smooth random images (bicubic-upsampled 6x6 noise, JPEG), each with one edited copy
(mirrored, cropped, re-encoded at a lower quality, resized down or up), byte copies, and a pair
of images with the same colour histogram (one image's quadrants swapped).

The references are computed here, never by curate's kernels: each sample's image decoded with
PIL and hashed with :func:`mmalign.data.phash.hash_images`; pairs compared one by one with
:func:`mmalign.data.phash.distance`; the greedy, non-chaining grouping written as a plain loop
(samples visited best CLIP score first, ties by pool order; a sample joins the first kept
sample within the distance, else it is kept); exact groups by equal bytes; the union with
semantic de-duplication: the same loop, a sample joining a kept one within the distance *or*
with cosine > 1 - eps (float64 from the stored float16 embeddings).
"""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from mmalign.data import phash
from tests.data.test_data_loader import write_shard
from tests.harness import cli_main, pick_seed
from tests.pipelines.test_curate_cli import _save_model

SIDE = 64
ORIGINALS = 15  # each gets one edit, three per kind
EDITS = ("flip", "crop", "jpeg", "smaller", "larger")
OTHERS = 6  # unrelated images in the second shard


def _smooth(rng: np.random.Generator) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).resize(
        (SIDE, SIDE), Image.Resampling.BICUBIC
    )


def _jpeg(image: Image.Image, quality: int = 90) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


# crops of a 64 px image, resized back: 60 px at a grid position of the hash's crop views, 56 px at
# another, and 60 px half a grid step (1 px) off in one axis, the worst place
CROPS = ((2, 2, 62, 62), (4, 2, 60, 58), (2, 3, 62, 63))
OFF_GRID = 2  # the index in CROPS of the crop between grid positions


def _edit(kind: str, data: bytes, variant: int = 0) -> bytes:
    """One edit of a stored JPEG, as a pool would hold it."""
    image = Image.open(io.BytesIO(data)).convert("RGB")
    if kind == "flip":
        return _jpeg(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT))
    if kind == "crop":
        box = CROPS[variant % len(CROPS)]
        return _jpeg(image.crop(box).resize((SIDE, SIDE), Image.Resampling.BICUBIC))
    if kind == "jpeg":
        return _jpeg(image, quality=50)
    if kind == "smaller":
        return _jpeg(image.resize((40, 40), Image.Resampling.BILINEAR))
    assert kind == "larger"
    return _jpeg(image.resize((96, 96), Image.Resampling.BICUBIC))


def _quadrants_swapped(data: bytes) -> bytes:
    """The same pixels (so the same colour histogram) in another layout, stored losslessly."""
    a = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    h = SIDE // 2
    swapped = np.concatenate(
        [np.concatenate([a[h:, h:], a[h:, :h]], 1), np.concatenate([a[:h, h:], a[:h, :h]], 1)], 0
    )
    buf = io.BytesIO()
    Image.fromarray(swapped).save(buf, format="PNG")
    return buf.getvalue()


@dataclass
class Pool:
    dir: Path
    order: list  # keys in pool order
    images: dict  # key -> (ext, bytes)
    edit_of: dict  # edited key -> (kind, original key)
    exact_of: dict  # byte copy key -> the key it copies
    histogram_pair: tuple  # (an image's key, its quadrant-swapped copy's key)
    model: str = ""


def _build(root: Path, seed: int) -> Pool:
    """Shard 0: the originals and an image whose swapped copy is in shard 1; shard 1: the edits,
    byte copies (of an original and of an edited copy), the swapped copy, unrelated images."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    images, edit_of, exact_of = {}, {}, {}
    first = [f"o{i:03d}" for i in range(ORIGINALS)] + ["h000"]
    for key in first:
        images[key] = ("jpg", _jpeg(_smooth(rng)))
    second = []
    for i in range(ORIGINALS):
        kind = EDITS[i % len(EDITS)]
        key = f"e{i:03d}"
        images[key] = ("jpg", _edit(kind, images[f"o{i:03d}"][1], i // len(EDITS)))
        edit_of[key] = (kind, f"o{i:03d}")
        second.append(key)
    for key, of in (("x000", "o003"), ("x001", "e000")):  # a copy of an original, of an edited copy
        images[key] = images[of]
        exact_of[key] = of
        second.append(key)
    images["h001"] = ("png", _quadrants_swapped(images["h000"][1]))
    second.append("h001")
    for i in range(OTHERS):
        images[f"u{i:03d}"] = ("jpg", _jpeg(_smooth(rng)))
        second.append(f"u{i:03d}")
    for s, keys in enumerate((first, second)):
        samples = [
            (k, {images[k][0]: images[k][1], "txt": f"a picture {k}".encode(), "json": b'{"n": 1}'})
            for k in keys
        ]
        write_shard(root / f"{s:05d}.tar", samples)
    return Pool(root, first + second, images, edit_of, exact_of, ("h000", "h001"))


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> Pool:
    base = tmp_path_factory.mktemp("perceptual")
    seed = pick_seed(2026)
    data = _build(base / "pool", seed)
    data.model = _save_model(base / "model", seed)
    return data


def _curate(pool: Pool, out: Path, *flags, model: bool = False, ok: bool = True):
    args = [
        "curate",
        "--data",
        pool.dir,
        "--out",
        out,
        "--no-progress",
        "--batch-size",
        "8",
        "--per-shard",
        "10",
    ]
    run = cli_main(*args, *(["--model", pool.model] if model else []), *flags)
    if ok:
        assert run.returncode == 0, run.stderr
    return run


# ---------------------------------------------------------------- the naive references


def _hashes(pool: Pool) -> tuple[np.ndarray, np.ndarray]:
    images = [Image.open(io.BytesIO(pool.images[k][1])).convert("RGB") for k in pool.order]
    return phash.hash_images(images)  # (N, Q, W), (N, V, W)


def _greedy(n: int, order: list[int], near) -> np.ndarray:
    """(N,) each sample's kept member: visit ``order``; join the first kept sample ``near`` it."""
    group = np.arange(n)
    kept: list[int] = []
    for i in order:
        hit = next((k for k in kept if near(i, k)), None)
        if hit is None:
            kept.append(i)
        else:
            group[i] = hit
    return group


def _visit(rows: list[int], scores: np.ndarray | None) -> list[int]:
    if scores is None:
        return sorted(rows)
    return sorted(rows, key=lambda i: (-float(scores[i]), i))


def _reference(pool: Pool, *, exact: bool, scores=None, cos=None, eps=None, perceptual=True) -> np.ndarray:
    """The naive grouping: exact first (one kept copy of equal bytes, best score), then the
    greedy over the kept copies, by perceptual distance and/or cosine; copies follow their kept one."""
    query, index = _hashes(pool)
    n = len(pool.order)
    data = [pool.images[k][1] for k in pool.order]
    rep = list(range(n))
    if exact:
        for i in _visit(list(range(n)), scores):
            rep[i] = next(j for j in _visit(list(range(n)), scores) if data[j] == data[i])

    def near(i: int, k: int) -> bool:
        close = (
            perceptual and phash.distance(query[i], index[i], query[k], index[k]) <= phash.DEFAULT_DISTANCE
        )
        return close or (cos is not None and cos[i, k] > 1.0 - eps)

    reps = sorted(set(rep))
    group = _greedy(n, _visit(reps, scores), near)
    return group[rep]


def _decisions(out: Path) -> pd.DataFrame:
    return pd.read_parquet(out / "decisions.parquet")


def _written_keys(out: Path) -> dict[str, dict]:
    found = {}
    for path in sorted(out.glob("[0-9]*.tar")):
        with tarfile.open(path) as tar:
            for m in tar.getmembers():
                key, ext = m.name.split(".", 1)
                found.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return found


@pytest.fixture(scope="module")
def model_free(pool, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("free") / "out"
    run = _curate(pool, out, "--dedupe", "perceptual", "--max-drop", "0.9")
    assert "hashing (no model)" not in run.stderr
    return out


# ---------------------------------------------------------------- 1. without a model


def test_pass_1_stores_each_images_hashes_and_their_version(pool, model_free):
    query, index = _hashes(pool)
    stored = np.concatenate([np.load(model_free / "pool" / f"{u:05d}.phash.npy") for u in range(2)])
    np.testing.assert_array_equal(stored, np.concatenate([query, index], axis=1))
    for u in range(2):
        assert (
            json.loads((model_free / "pool" / f"{u:05d}.json").read_text())["phash_version"] == phash.VERSION
        )


def test_perceptual_groups_equal_the_naive_greedy_and_catch_each_edit(pool, model_free):
    frame = _decisions(model_free)
    assert frame["key"].tolist() == pool.order
    want = _reference(pool, exact=False)
    np.testing.assert_array_equal(frame["perceptual_group"].to_numpy(), want)
    np.testing.assert_array_equal(frame["kept"].to_numpy(), want == np.arange(len(want)))
    at = {k: i for i, k in enumerate(pool.order)}
    for kind in EDITS:
        copies = [e for e, (k, _) in pool.edit_of.items() if k == kind]
        found = [e for e in copies if want[at[e]] == at[pool.edit_of[e][1]]]
        assert len(found) >= len(copies) - 1, (kind, copies, found)  # each kind, all or all but one
        for e in found:
            row = frame.iloc[at[e]]
            assert row["reason"] == f"perceptual duplicate of {pool.edit_of[e][1]}"
            assert row["duplicate_of"] == pool.edit_of[e][1]
            query, index = _hashes(pool)
            o = at[pool.edit_of[e][1]]
            assert row["perceptual_distance"] == phash.distance(
                query[at[e]], index[at[e]], query[o], index[o]
            )


def test_a_crop_between_grid_positions_is_within_the_decontamination_distance(pool):
    """The bound of the crop views: a crop half a grid step off costs a few bits more than one on the
    grid; every such copy is within decontamination's looser default (the default here + 2 bits)."""
    from mmalign.evaluation.contamination import DEFAULT_DISTANCE

    query, index = _hashes(pool)
    at = {k: i for i, k in enumerate(pool.order)}
    off = [
        e
        for e, (k, _) in pool.edit_of.items()
        if k == "crop" and int(e[1:]) // len(EDITS) % len(CROPS) == OFF_GRID
    ]
    assert off
    for e in off:
        i, o = at[e], at[pool.edit_of[e][1]]
        assert phash.distance(query[i], index[i], query[o], index[o]) <= DEFAULT_DISTANCE, e


def test_two_images_with_one_colour_histogram_are_not_grouped(pool, model_free):
    a, b = pool.histogram_pair
    pixels = [np.asarray(Image.open(io.BytesIO(pool.images[k][1])).convert("RGB")) for k in (a, b)]
    for c in range(3):  # the premise: the same colour histogram, another picture
        np.testing.assert_array_equal(
            np.bincount(pixels[0][..., c].ravel(), minlength=256),
            np.bincount(pixels[1][..., c].ravel(), minlength=256),
        )
    assert not np.array_equal(pixels[0], pixels[1])
    frame = _decisions(model_free).set_index("key")
    assert frame.loc[a, "kept"] and frame.loc[b, "kept"]
    assert frame.loc[a, "perceptual_group"] != frame.loc[b, "perceptual_group"]


def test_a_run_without_a_model_writes_the_kept_samples_and_no_scores(pool, model_free):
    frame = _decisions(model_free)
    assert frame["clip_score"].isna().all()
    written = _written_keys(model_free)
    assert sorted(written) == sorted(frame.loc[frame["kept"], "key"])
    for key, members in written.items():
        ext, data = pool.images[key]
        assert members[ext] == data
        assert "clip_score" not in json.loads(members["json"])
    report = json.loads((model_free / "curate_report.json").read_text())
    assert report["model"] is None and report["clip_score"] is None
    assert "No model" in (model_free / "curate_report.html").read_text()


def test_report_counts_the_distances_to_the_kept_member(pool, model_free):
    want = _reference(pool, exact=False)
    query, index = _hashes(pool)
    moved = np.flatnonzero(want != np.arange(len(want)))
    bits = [phash.distance(query[i], index[i], query[want[i]], index[want[i]]) for i in moved]
    report = json.loads((model_free / "curate_report.json").read_text())
    hist = report["dedupe"]["perceptual_distance"]
    assert hist["counts"] == np.bincount(bits, minlength=len(hist["counts"])).tolist()
    assert report["dedupe"]["perceptual_groups"]["samples_in_duplicate_groups"] == len(
        set(moved) | set(want[moved])
    )
    assert "bits from kept" in (model_free / "curate_report.html").read_text()


def test_exact_first_then_perceptual_over_the_kept_copies(pool, tmp_path):
    out = tmp_path / "out"
    _curate(pool, out, "--dedupe", "exact,perceptual", "--max-drop", "0.9")
    frame = _decisions(out)
    want = _reference(pool, exact=True)
    np.testing.assert_array_equal(frame["combined_group"].to_numpy(), want)
    np.testing.assert_array_equal(frame["kept"].to_numpy(), want == np.arange(len(want)))
    reasons = dict(zip(frame["key"], frame["reason"]))
    assert reasons["x000"] == "exact duplicate of o003"
    at = {k: i for i, k in enumerate(pool.order)}
    kept_flip = pool.order[want[at["e000"]]]  # the byte copy of an edited copy follows it
    assert want[at["x001"]] == want[at["e000"]] and kept_flip == "o000"
    assert reasons["x001"] == "perceptual duplicate of o000"


def test_false_negative_groups_without_a_model_are_the_perceptual_groups(pool, tmp_path):
    out = tmp_path / "out"
    _curate(pool, out, "--false-negative-groups", "dup")
    want = _reference(pool, exact=False)
    written = _written_keys(out)
    assert sorted(written) == sorted(pool.order)  # nothing dropped
    for i, key in enumerate(pool.order):
        assert json.loads(written[key]["json"])["dup"] == pool.order[want[i]]


# ---------------------------------------------------------------- 2. with a model: the union


@pytest.fixture(scope="module")
def embedded(pool, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("embedded") / "out"
    _curate(pool, out, model=True)
    return out


def _cos(out: Path) -> np.ndarray:
    parts = []
    for u in range(2):
        frame = pd.read_parquet(out / "pool" / f"{u:05d}.parquet")
        parts.append(np.load(out / "pool" / f"{u:05d}.image.npy")[frame["image_emb_id"].to_numpy()])
    x = np.concatenate(parts).astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T


def _scores(out: Path) -> np.ndarray:
    return np.concatenate(
        [pd.read_parquet(out / "pool" / f"{u:05d}.parquet")["clip_score"].to_numpy() for u in range(2)]
    )


def _union_eps(pool: Pool, cos: np.ndarray, scores: np.ndarray) -> float:
    """An eps (halfway between two of the pool's pair cosines) at which the naive union differs
    from each detector alone, so the test tells a union from either."""
    alone = _reference(pool, exact=True, scores=scores)
    values = np.unique(cos[np.triu_indices_from(cos, 1)])[::-1]
    for hi, lo in zip(values[:-1], values[1:]):
        eps = 1.0 - (hi + lo) / 2
        union = _reference(pool, exact=True, scores=scores, cos=cos, eps=eps)
        semantic = _reference(pool, exact=True, scores=scores, cos=cos, eps=eps, perceptual=False)
        if not np.array_equal(union, alone) and not np.array_equal(union, semantic):
            return float(eps)
    pytest.fail("no eps tells the union from each detector alone")


def test_perceptual_and_semantic_group_by_the_naive_union(pool, embedded, tmp_path):
    cos, scores = _cos(embedded), _scores(embedded)
    eps = _union_eps(pool, cos, scores)
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(embedded / "pool", out / "pool")
    flags = ["--dedupe", "exact,perceptual,semantic", "--dedupe-eps", repr(eps), "--dedupe-clusters", "1"]
    _curate(pool, out, *flags, "--force", model=True)
    frame = _decisions(out)
    want = _reference(pool, exact=True, scores=scores, cos=cos, eps=eps)
    np.testing.assert_array_equal(frame["combined_group"].to_numpy(), want)
    np.testing.assert_array_equal(frame["kept"].to_numpy(), want == np.arange(len(want)))
    alone = _reference(pool, exact=True, scores=scores)
    np.testing.assert_array_equal(frame["perceptual_group"].to_numpy(), alone)
    query, index = _hashes(pool)
    data = [pool.images[k][1] for k in pool.order]
    for i in np.flatnonzero(want != np.arange(len(want))):  # which detector the reason names
        k = want[i]
        near = phash.distance(query[i], index[i], query[k], index[k]) <= phash.DEFAULT_DISTANCE
        close = cos[i, k] > 1.0 - eps
        name = (
            "exact"
            if data[i] == data[k]
            else " and ".join(w for w, on in (("perceptual", near), ("semantic", close)) if on)
        )
        assert frame["reason"].iat[i] == f"{name} duplicate of {pool.order[k]}"


def test_a_pool_embedded_before_hashing_is_hashed_without_the_model(pool, embedded, tmp_path):
    """Hashes and their version removed, as an older mmalign left them: the run says it hashes,
    and its hashes and decisions are a fresh pool's."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(embedded / "pool", out / "pool")
    for u in range(2):
        (out / "pool" / f"{u:05d}.phash.npy").unlink()
        stats_path = out / "pool" / f"{u:05d}.json"
        stats = json.loads(stats_path.read_text())
        del stats["phash_version"]
        stats_path.write_text(json.dumps(stats))
    run = _curate(pool, out, "--dedupe", "perceptual", "--max-drop", "0.9", model=True)
    assert "have no perceptual hashes" in run.stdout and "(no model)" in run.stdout
    for u in range(2):
        np.testing.assert_array_equal(
            np.load(out / "pool" / f"{u:05d}.phash.npy"), np.load(embedded / "pool" / f"{u:05d}.phash.npy")
        )
    frame = _decisions(out)
    np.testing.assert_array_equal(
        frame["perceptual_group"].to_numpy(), _reference(pool, exact=False, scores=_scores(embedded))
    )
    again = _curate(pool, out, "--dedupe", "perceptual", "--max-drop", "0.9")  # no model: the same pool
    assert "have no perceptual hashes" not in again.stdout
    pd.testing.assert_frame_equal(_decisions(out), frame)


# ---------------------------------------------------------------- 3. bad input


@pytest.mark.parametrize(
    "case",
    [
        "distance_64",
        "distance_negative",
        "distance_word",
        "semantic_no_model",
        "fraction_no_model",
        "max_drop",
    ],
)
def test_bad_input_is_one_line_and_exit_2(pool, tmp_path, case):
    flags, words = ["--dedupe", "perceptual"], ()
    if case.startswith("distance_"):
        value = {"distance_64": str(phash.BITS), "distance_negative": "-1", "distance_word": "four"}[case]
        flags += ["--perceptual-distance", value]
        words = ("--perceptual-distance", value)
    elif case == "semantic_no_model":
        flags, words = ["--dedupe", "perceptual,semantic"], ("semantic", "--model")
    elif case == "fraction_no_model":
        flags += ["--keep-fraction", "0.5"]
        words = ("--keep-fraction", "--model")
    elif case == "max_drop":
        flags += ["--max-drop", "0.05"]
        words = ("perceptual", "--max-drop", "--perceptual-distance")
    out = tmp_path / "out"
    run = _curate(pool, out, *flags, ok=False)
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmalign: error:"), run.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    assert not (out / "decisions.parquet").exists()


def test_a_model_run_refuses_a_pool_hashed_without_one(pool, model_free, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(model_free / "pool", out / "pool")
    run = _curate(pool, out, "--dedupe", "perceptual", model=True, ok=False)
    assert run.returncode == 2 and "hashed without a model" in run.stderr, run.stderr


def test_a_run_without_a_model_does_not_hash_into_an_embedded_pool(pool, embedded, tmp_path):
    """A shard of a model's pool still to embed (here: its result removed) needs the model."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copytree(embedded / "pool", out / "pool")
    (out / "pool" / "00001.json").unlink()
    run = _curate(pool, out, "--dedupe", "perceptual", ok=False)
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1, run.stderr
    assert "--model" in lines[0] and "00001.tar" in lines[0], lines[0]
    assert not (out / "pool" / "00001.json").exists()


def test_a_pool_without_images_is_one_line(tmp_path):
    """Samples with captions and no image: counted skips, then one line naming the reason, exit 2."""
    samples = [(f"t{i:03d}", {"txt": b"a caption", "json": b"{}"}) for i in range(3)]
    write_shard(tmp_path / "00000.tar", samples)
    run = cli_main(
        "curate", "--data", tmp_path / "00000.tar", "--out", tmp_path / "out", "--dedupe", "perceptual"
    )
    assert run.returncode == 2
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "holds no readable samples" in errors[0] and "missing_image 3" in errors[0]
