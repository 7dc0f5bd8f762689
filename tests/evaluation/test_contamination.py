"""mmalign.evaluation.contamination: what a target names, its images' hashes, and the matches.

References are computed here: the images as this file wrote them (pixels compared), the hashes
as ``phash.hash_images`` gives them for those images, and the matches by a loop over every
(pool, eval) pair with ``phash.distance`` (the definition of "within the threshold"), or, for the
semantic matches, a float64 loop over every pair.
"""

from __future__ import annotations

import io
import itertools
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmalign.data import phash
from mmalign.errors import UsageError
from mmalign.evaluation import contamination as cont


def smooth_image(rng: np.random.Generator, side: int = 48) -> Image.Image:
    """A random image with structure at several scales (pHash of pure noise is near-random too,
    but real images are smooth)."""
    base = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((side, side), Image.Resampling.BICUBIC)
    detail = rng.integers(-30, 31, (side, side, 3))
    return Image.fromarray(np.clip(np.asarray(img, np.int64) + detail, 0, 255).astype(np.uint8))


def png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")  # lossless: the pixels read back are the ones written
    return buf.getvalue()


def write_tar(path: Path, members: dict[str, bytes]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def pixels(image) -> np.ndarray:
    return np.asarray(image.convert("RGB"))


# ------------------------------------------------------------------ targets


def test_shard_spec_and_folder_of_tars(tmp_path):
    rng = np.random.default_rng(0)
    images = [smooth_image(rng) for _ in range(7)]
    for s, part in enumerate((images[:4], images[4:])):
        members = {}
        for i, im in enumerate(part):
            key = f"s{s}_{i:03d}"
            members[f"{key}.png"] = png(im)
            members[f"{key}.txt"] = b"a caption"
        members["nokey.txt"] = b"a sample without an image is not an image"
        write_tar(tmp_path / f"{s:05d}.tar", members)
    for target in (str(tmp_path / "{00000..00001}.tar"), str(tmp_path)):
        got = list(cont.eval_images(target))
        assert [k for k, _ in got] == [f"s0_{i:03d}" for i in range(4)] + [f"s1_{i:03d}" for i in range(3)]
        for (_, im), want in zip(got, images):
            np.testing.assert_array_equal(pixels(im), pixels(want))


def test_tar_of_class_folders_as_shards(tmp_path):
    rng = np.random.default_rng(1)
    images = [smooth_image(rng) for _ in range(3)]
    write_tar(tmp_path / "test.tar", {f"./cat/{i:04d}.png": png(im) for i, im in enumerate(images)})
    got = list(cont.eval_images(str(tmp_path / "test.tar")))
    assert [k for k, _ in got] == ["cat/0000", "cat/0001", "cat/0002"]
    for (_, im), want in zip(got, images):
        np.testing.assert_array_equal(pixels(im), pixels(want))


def test_yaml_suite_imagefolder(tmp_path):
    rng = np.random.default_rng(2)
    images = {c: [smooth_image(rng) for _ in range(2)] for c in ("cat", "dog")}
    write_tar(
        tmp_path / "folders.tar",
        {f"./{c}/{i:04d}.png": png(im) for c, ims in images.items() for i, im in enumerate(ims)},
    )
    suite = tmp_path / "mine.yaml"
    suite.write_text(
        "name: mine\ndataset:\n  type: imagefolder\n  path: folders.tar\n  classnames: [cat, dog]\n"
        "tasks:\n  - name: zs\n    type: zeroshot\n    label_field: classname\n    classnames: [cat, dog]\n"
        "    templates: ['a {c}.']\n"
    )
    got = list(cont.eval_images(str(suite)))
    assert len(got) == 4
    want = [im for c in ("cat", "dog") for im in images[c]]
    for (_, im), w in zip(got, want):
        np.testing.assert_array_equal(pixels(im), pixels(w))


def test_clip_benchmark_folder_and_cb_prefix(tmp_path):
    from tests.harness.cb_wds_gen import write_wds

    truth = write_wds(tmp_path / "wds_shapes", n=6, shards=2)
    with tarfile.open(tmp_path / "wds_shapes" / "test" / "0.tar") as tar:
        first = next(m for m in tar.getmembers() if m.name.endswith(".png"))
        first_pixels = pixels(Image.open(io.BytesIO(tar.extractfile(first).read())))
    for target in (f"cb:{tmp_path / 'wds_shapes'}", str(tmp_path / "wds_shapes")):
        got = list(cont.eval_images(target))
        assert [k for k, _ in got] == [t["key"] for t in truth]
        np.testing.assert_array_equal(pixels(got[0][1]), first_pixels)


def test_shipped_suite_name():
    pytest.importorskip("sklearn")
    got = list(itertools.islice(cont.eval_images("digits"), 3))
    assert [k for k, _ in got] == ["digits_0000", "digits_0001", "digits_0002"]


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: "no_such_suite", "is not an evaluation set"),
        (lambda d: str(d / "table.parquet"), "is not an evaluation set"),
        (lambda d: str(d / "empty_folder"), "is not an evaluation set"),
        (lambda d: str(d / "missing.tar"), "shard"),
        (lambda d: str(d / "noshards.yaml"), "names no shards"),
        (lambda d: str(d / "gone.yaml"), "not found"),
        (lambda d: f"cb:{d / 'nowhere'}", "no such folder"),
        (lambda d: "", "is not an evaluation set"),
    ],
)
def test_bad_target_one_line(tmp_path, make, needle):
    (tmp_path / "table.parquet").write_bytes(b"PAR1")
    (tmp_path / "empty_folder").mkdir()
    (tmp_path / "noshards.yaml").write_text("name: noshards\ntasks: []\n")
    (tmp_path / "gone.yaml").write_text(
        "name: gone\ndataset:\n  type: imagefolder\n  path: nowhere.tar\ntasks: []\n"
    )
    with pytest.raises(UsageError) as info:
        list(cont.eval_images(make(tmp_path), what="--decontaminate"))
    message = str(info.value)
    assert needle in message and "\n" not in message and message.startswith(("--decontaminate", "clip_"))


def test_no_readable_image_is_one_line(tmp_path):
    write_tar(tmp_path / "x.tar", {"a.txt": b"caption only", "b.jpg": b"not a jpeg"})
    with pytest.raises(UsageError, match="holds no readable images"):
        cont.eval_hashes(str(tmp_path / "x.tar"))


# ------------------------------------------------------------------ hashes


def test_eval_hashes_and_cache(tmp_path, monkeypatch):
    rng = np.random.default_rng(3)
    images = [smooth_image(rng) for _ in range(5)]
    write_tar(tmp_path / "e.tar", {f"k{i}.png": png(im) for i, im in enumerate(images)})
    q, i = phash.hash_images(images)
    cache = tmp_path / "cache"
    got = cont.eval_hashes(str(tmp_path / "e.tar"), cache_dir=cache)
    assert got.keys == [f"k{j}" for j in range(5)]
    np.testing.assert_array_equal(got.query, q)
    np.testing.assert_array_equal(got.index, i)
    assert len(list(cache.glob("eval_phash_*.npz"))) == 1

    def refuse(_images):
        raise AssertionError("hashed again although cached")

    monkeypatch.setattr(phash, "hash_images", refuse)
    again = cont.eval_hashes(str(tmp_path / "e.tar"), cache_dir=cache)
    assert again.keys == got.keys
    np.testing.assert_array_equal(again.index, i)
    monkeypatch.undo()
    # the set's file changed: hashed again, into a new cache file
    write_tar(tmp_path / "e.tar", {f"k{j}.png": png(im) for j, im in enumerate(images[:3])})
    changed = cont.eval_hashes(str(tmp_path / "e.tar"), cache_dir=cache)
    assert len(changed) == 3 and len(list(cache.glob("eval_phash_*.npz"))) == 2


def test_what_cannot_be_read_is_counted_and_said(tmp_path, monkeypatch):
    """A bad image and a damaged tar in the evaluation set: the rest is hashed, and both are
    counted (kept through the cache), said in one line by curate's and training's checks."""
    from mmalign.run import contamination_check

    rng = np.random.default_rng(5)
    images = [smooth_image(rng) for _ in range(4)]
    write_tar(
        tmp_path / "a.tar", {"k0.png": png(images[0]), "k1.jpg": b"not a jpeg", "k2.png": png(images[1])}
    )
    write_tar(tmp_path / "b.tar", {"k3.png": png(images[2]), "k4.png": png(images[3])})
    whole = (tmp_path / "b.tar").read_bytes()
    (tmp_path / "b.tar").write_bytes(whole[: len(whole) // 2 + 100])  # cut inside k4's member
    target = f"{tmp_path}/a.tar::{tmp_path}/b.tar"
    got = cont.eval_hashes(target, cache_dir=tmp_path / "cache")
    assert got.keys == ["k0", "k2", "k3"]
    np.testing.assert_array_equal(got.index, phash.hash_images([images[0], images[1], images[2]])[1])
    assert got.skipped == {cont.NO_IMAGE: 1, cont.DAMAGED_TAR: 1}
    again = cont.eval_hashes(target, cache_dir=tmp_path / "cache")  # read from the cache
    assert again.skipped == got.skipped
    assert got.skip_line("x") == (
        f"mmalign: x: {target}: skipped 1 damaged tar(s), read up to the damage, 1 sample(s) without "
        "a readable image; the 3 images read are the ones checked"
    )
    assert cont.eval_hashes(f"{tmp_path}/a.tar::{tmp_path}/a.tar").skip_line("x").count("skipped 2 ") == 1
    clean = tmp_path / "c.tar"
    write_tar(clean, {"k0.png": png(images[0])})
    assert cont.eval_hashes(str(clean)).skip_line("x") is None

    monkeypatch.setenv("MMALIGN_CACHE", str(tmp_path / "mcache"))
    heard: list[str] = []
    contamination_check.target_hashes(target, say=heard.append)
    assert heard[-1] == got.skip_line("data.decontaminate")


# ------------------------------------------------------------------ matches


def naive_matches(pq, pi, eq, ei, radius):
    """Every (pool, eval) pair through phash.distance; per pool row the first nearest within radius."""
    rows, evals, dists = [], [], []
    for a in range(len(pq)):
        d = [phash.distance(pq[a], pi[a], eq[b], ei[b]) for b in range(len(eq))]
        if d and min(d) <= radius:
            rows.append(a)
            evals.append(int(np.argmin(d)))  # the first of the nearest
            dists.append(min(d))
    return rows, evals, dists


def edited(image: Image.Image, kind: str) -> Image.Image:
    w, h = image.size
    if kind == "flip":
        return image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    if kind == "crop":
        c = round(w * 29 / 32)
        return image.crop((w - c, 0, w, c)).resize((w, h), Image.Resampling.BICUBIC)
    if kind == "jpeg":
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=70)
        return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return image.resize((w * 3 // 4, h * 3 // 4), Image.Resampling.BILINEAR)


def test_matches_equal_brute_force_on_images():
    rng = np.random.default_rng(4)
    evals = [smooth_image(rng) for _ in range(16)]
    kinds = ("flip", "crop", "jpeg", "resize")
    pool = [edited(evals[j], kinds[j % 4]) for j in range(0, 16, 2)] + [smooth_image(rng) for _ in range(16)]
    order = rng.permutation(len(pool))
    pool = [pool[k] for k in order]
    pq, pi = phash.hash_images(pool)
    eq, ei = phash.hash_images(evals)
    for radius in (0, phash.DEFAULT_DISTANCE, 10, 30):
        rows, others, dist = cont.matches(pq, pi, eq, ei, radius)
        want = naive_matches(pq, pi, eq, ei, radius)
        assert (rows.tolist(), others.tolist(), dist.tolist()) == want, radius
    rows, others, _ = cont.matches(pq, pi, eq, ei, phash.DEFAULT_DISTANCE)
    planted = {int(np.flatnonzero(order == k)[0]): k * 2 for k in range(8)}  # pool row -> its eval image
    assert {r: o for r, o in zip(rows.tolist(), others.tolist()) if r in planted} == planted


def test_matches_equal_brute_force_on_random_hashes():
    rng = np.random.default_rng(5)
    w = phash.WORDS
    m, n = 30, 60
    eq = rng.integers(0, 2**63, (m, phash.QUERIES, w), dtype=np.uint64)
    ei = rng.integers(0, 2**63, (m, phash.VIEWS, w), dtype=np.uint64)
    pq = rng.integers(0, 2**63, (n, phash.QUERIES, w), dtype=np.uint64)
    pi = rng.integers(0, 2**63, (n, phash.VIEWS, w), dtype=np.uint64)
    ei[:, 0], pi[:, 0] = eq[:, 0], pq[:, 0]  # as hash_images gives them: the whole view is both
    for a in range(0, n, 3):  # planted near copies, either way round, at 0..8 flipped bits
        b, flips = int(rng.integers(m)), rng.choice(phash.BITS, int(rng.integers(0, 9)), replace=False)
        noise = np.zeros(w, np.uint64)
        for f in flips:
            noise[f // 64] |= np.uint64(1) << np.uint64(f % 64)
        if a % 2:
            pq[a, int(rng.integers(phash.QUERIES))] = ei[b, int(rng.integers(phash.VIEWS))] ^ noise
        else:
            pi[a, int(rng.integers(phash.VIEWS))] = eq[b, int(rng.integers(phash.QUERIES))] ^ noise
    pi[7], pq[7] = ei[3].copy(), eq[3].copy()  # two eval images at the same distance: the first wins
    ei[20], eq[20] = ei[3].copy(), eq[3].copy()
    for radius in (0, 3, 8, 20):
        rows, others, dist = cont.matches(pq, pi, eq, ei, radius)
        assert (rows.tolist(), others.tolist(), dist.tolist()) == naive_matches(pq, pi, eq, ei, radius)
    rows, others, _ = cont.matches(pq, pi, eq, ei, 0)
    assert dict(zip(rows.tolist(), others.tolist()))[7] == 3


def test_matches_bad_radius():
    z = np.zeros((1, phash.QUERIES, phash.WORDS), np.uint64)
    zi = np.zeros((1, phash.VIEWS, phash.WORDS), np.uint64)
    for bad in (-1, phash.BITS, 2.5):
        with pytest.raises(ValueError, match="0.."):
            cont.matches(z, zi, z, zi, bad)


def test_semantic_matches_equal_brute_force():
    rng = np.random.default_rng(6)
    evals = rng.standard_normal((40, 16))
    pool = rng.standard_normal((90, 16))
    pool[::4] = evals[rng.integers(0, 40, len(pool[::4]))] + 0.01 * rng.standard_normal((23, 16))
    eps = 0.01
    rows, others, cos = cont.semantic_matches(pool.astype(np.float16), evals.astype(np.float32), eps, block=7)
    pool16 = pool.astype(np.float16).astype(np.float64)
    pu = pool16 / np.linalg.norm(pool16, axis=1, keepdims=True)
    eu = evals / np.linalg.norm(evals, axis=1, keepdims=True)
    want_rows, want_others = [], []
    for a in range(len(pu)):
        sims = [float(pu[a] @ eu[b]) for b in range(len(eu))]
        if max(sims) > 1 - eps:
            want_rows.append(a)
            want_others.append(int(np.argmax(sims)))
    assert rows.tolist() == want_rows and others.tolist() == want_others
    assert len(want_rows) == 23
    np.testing.assert_allclose(cos, [pu[a] @ eu[b] for a, b in zip(want_rows, want_others)], atol=1e-5)


def test_semantic_matches_empty_eval():
    rows, others, cos = cont.semantic_matches(np.ones((3, 4)), np.zeros((0, 4)), 0.1)
    assert rows.size == others.size == cos.size == 0


def test_fingerprint_follows_the_hash_version(tmp_path, monkeypatch):
    write_tar(tmp_path / "e.tar", {"k.png": png(smooth_image(np.random.default_rng(7)))})
    first = cont.fingerprint(cont.resolve(str(tmp_path / "e.tar")))
    assert first == cont.fingerprint(cont.resolve(str(tmp_path / "e.tar")))
    monkeypatch.setattr(phash, "VERSION", phash.VERSION + 1)
    assert cont.fingerprint(cont.resolve(str(tmp_path / "e.tar"))) != first
