"""``mmalign curate`` end to end, on a small pool of random JPEGs scored by a random micro model.

The references are computed here, never by curate's own code:

- CLIP scores and embeddings: the model loaded with ``mmalign.models.load.load``, each sample
  decoded with PIL, preprocessed and encoded *alone* (batch of one) in float32; a score is the
  cosine of the image with each caption line, averaged over the lines;
- the keep-fraction threshold: ``numpy.quantile`` over the whole pool's scores (read back from
  ``OUT/pool/*.parquet``);
- SemDeDup groups: SemDeDup's greedy rule in a Python loop over *all* pairs (best CLIP score
  first, a sample kept unless its cosine with a kept one exceeds 1 - eps), in float64 from the
  stored float16 embeddings; exact groups: equal image bytes, compared as bytes;
- outputs: the input samples' members as this file wrote them; the written tars read with
  ``tarfile``;
- resume after kill -9, remote shards, ``--nproc 2``: a straight one-process run of the same
  command in this process (for the resume: over the same HTTP server; else over local shards).

The model: a fresh micro tower maps every image within cosine ~0.98 of every other (its class
token and positions outweigh the patches), so the saved model has its patch weights scaled up
and its class and position embeddings zeroed; different noise images are then apart (cosine
< ~0.97) and a near copy (pixels +-1) stays near (cosine > ~0.999).

The subprocess tests (kill -9 and resume, ``--nproc 2``) run with OMP_NUM_THREADS=1 and this
process with one torch thread, so that their embeddings are bitwise those of the in-process
reference runs; the kill falls between two shards because the test's HTTP server holds the
requests of shard 1 and later until the kill is done.
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from tests.data.test_data_loader import write_shard
from tests.harness import ROOT, cli_main, pick_seed
from tests.harness.shard_server import serve

N_SHARDS = 4
SIZES = (24, 20, 28, 16)
PREFIX = "abcd"
BAD = {"b007": "corrupt_image", "b008": "missing_caption"}  # skipped samples and their reasons
TWO_CAPTIONS = "a005"
NO_JSON = "d003"
WITH_FOLDER = "d005"  # stored as sub/d005.*: the key curate reports is the tar key without folders


# ---------------------------------------------------------------- the model and the pool


def _save_model(path: Path, seed: int) -> str:
    """A random micro model (as tests/export/test_export.py saves one), made to tell images apart."""
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models import TwoTower
    from mmalign.models.io import save_pretrained
    from mmalign.models.presets import PRESETS

    torch.manual_seed(seed)
    model = TwoTower(copy.deepcopy(PRESETS["micro"]))
    with torch.no_grad():
        model.visual.conv1.weight.mul_(10.0)
        model.visual.class_embedding.zero_()
        model.visual.positional_embedding.zero_()
    save_pretrained(model, path, preprocess=preprocess_cfg(model.image_size))
    return str(path)


def _jpeg(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@dataclass
class PoolData:
    dir: Path  # the input shards 00000.tar ...
    model: str
    samples: dict  # key (without folders) -> (shard, tar key, {ext: bytes}) of every sample written
    order: list  # keys in pool order (shard, then place in it)


def _pixels(rng: np.random.Generator, shard: int) -> np.ndarray:
    """A random image: full-range noise, per pixel (shards 0, 1) or in 2x2 blocks (2, 3)."""
    h, w = (16, 16) if shard % 2 == 0 else (18, 20)
    if shard < 2:
        return rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    blocks = rng.integers(0, 256, (h // 2, w // 2, 3), dtype=np.uint8)
    return np.kron(blocks, np.ones((2, 2, 1), dtype=np.uint8))


def _near(rng: np.random.Generator, pixels: np.ndarray) -> np.ndarray:
    return np.clip(pixels.astype(np.int64) + rng.integers(-1, 2, pixels.shape), 0, 255).astype(np.uint8)


WORDS = (
    "red",
    "blue",
    "cat",
    "dog",
    "tree",
    "car",
    "a",
    "photo",
    "of",
    "small",
    "large",
    "house",
    "bird",
    "sky",
)


def _caption(rng: np.random.Generator, shard: int) -> str:
    """Captions of a length that grows with the shard, so that the shards' score distributions differ."""
    n = int(rng.integers(1 + 2 * shard, 3 + 3 * shard))
    return " ".join(WORDS[int(i)] for i in rng.integers(len(WORDS), size=n))


def _build_pool(root: Path, seed: int) -> PoolData:
    """Four shards with exact byte copies (across and inside shards), near copies (a chain of
    two around one image), a sample with two captions, one without .json, one in a folder, a
    corrupt image and a sample without caption."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True)
    pixels: dict[str, np.ndarray] = {}
    images: dict[str, bytes] = {}
    copies = {
        "b003": ("exact", "a002"),
        "b004": ("near", "a003"),
        "b005": ("near", "b004"),
        "c001": ("exact", "a010"),
        "c002": ("exact", "a010"),
        "c003": ("near", "b010"),
        "d001": ("exact", "d000"),
        "d002": ("near", "c020"),
    }
    samples, order = {}, []
    for s, n in enumerate(SIZES):
        shard = []
        for i in range(n):
            key = f"{PREFIX[s]}{i:03d}"
            kind, of = copies.get(key, (None, None))
            if kind == "exact":
                pixels[key], images[key] = pixels[of], images[of]
            else:
                pixels[key] = _near(rng, pixels[of]) if kind == "near" else _pixels(rng, s)
                images[key] = _jpeg(pixels[key])
            lines = [_caption(rng, s)] + ([_caption(rng, s)] if key == TWO_CAPTIONS else [])
            members = {"jpg": images[key], "txt": "\n".join(lines).encode()}
            meta = {"i": i, "src": f"pool-{s}"}
            if s == 2:
                meta["label"] = int(rng.integers(5))  # a field only the third shard has
            if key != NO_JSON:
                members["json"] = json.dumps(meta).encode()
            if BAD.get(key) == "corrupt_image":
                members["jpg"] = b"\xff\xd8 this is not a jpeg"
            if BAD.get(key) == "missing_caption":
                del members["txt"]
            tar_key = f"sub/{key}" if key == WITH_FOLDER else key
            shard.append((tar_key, members))
            samples[key] = (s, tar_key, members)
            order.append(key)
        write_shard(root / f"{s:05d}.tar", shard)
    return PoolData(dir=root, model="", samples=samples, order=order)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One torch thread: the references and curate in this process then run the same kernels as
    the subprocesses (launched with OMP_NUM_THREADS=1), and tiny ops do not wait on a busy core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pool(tmp_path_factory) -> PoolData:
    base = tmp_path_factory.mktemp("curate")
    seed = pick_seed(4321)
    data = _build_pool(base / "pool", seed)
    data.model = _save_model(base / "model", seed)
    return data


def _curate(pool: PoolData, out, *flags, data=None):
    """``mmalign curate`` in this process; asserts it succeeded."""
    run = cli_main(
        "curate",
        "--data",
        data or pool.dir,
        "--model",
        pool.model,
        "--out",
        out,
        "--no-progress",
        "--batch-size",
        "4",
        "--per-shard",
        "10",
        *flags,
    )
    assert run.returncode == 0, run.stderr
    return run


@pytest.fixture(scope="module")
def embedded(pool, tmp_path_factory) -> Path:
    """An out folder of a run without policies (its pool/ holds every shard's embeddings)."""
    out = tmp_path_factory.mktemp("embedded") / "out"
    _curate(pool, out)
    return out


def _out_with_embeddings(embedded: Path, out: Path) -> Path:
    """A fresh out folder holding the embeddings of ``embedded``: a run there only decides and writes."""
    out.mkdir(parents=True)
    shutil.copytree(embedded / "pool", out / "pool")
    return out


def _pool_frame(out: Path) -> pd.DataFrame:
    return pd.concat(
        [pd.read_parquet(out / "pool" / f"{u:05d}.parquet") for u in range(N_SHARDS)], ignore_index=True
    )


def _pool_images(out: Path) -> np.ndarray:
    """(N, D) float16: the stored image embeddings, in pool order."""
    parts = []
    for u in range(N_SHARDS):
        frame = pd.read_parquet(out / "pool" / f"{u:05d}.parquet")
        parts.append(np.load(out / "pool" / f"{u:05d}.image.npy")[frame["image_emb_id"].to_numpy()])
    return np.concatenate(parts)


def _readable(pool: PoolData) -> list[str]:
    return [k for k in pool.order if k not in BAD]


def _read_tar(path: Path) -> dict[str, dict[str, bytes]]:
    """tar key -> {ext: bytes}, with tarfile (not curate's reader)."""
    out: dict[str, dict[str, bytes]] = {}
    with tarfile.open(path) as tar:
        for m in tar.getmembers():
            key, ext = m.name.split(".", 1)
            out.setdefault(key, {})[ext] = tar.extractfile(m).read()
    return out


def _written(out: Path) -> dict[str, dict[str, bytes]]:
    samples: dict[str, dict[str, bytes]] = {}
    for path in sorted(out.glob("[0-9]*.tar")):
        for key, members in _read_tar(path).items():
            assert key not in samples, f"{key} written twice"
            samples[key] = members
    return samples


def _greedy(cos: np.ndarray, scores: np.ndarray, eps: float) -> np.ndarray:
    """(N,) the index of each sample's kept member: visit best score first (ties: lower index),
    keep a sample unless its cosine with an already kept one exceeds 1 - eps, else join the
    first such kept one (a plain loop)."""
    n = len(scores)
    kept, group = [], [0] * n
    for i in sorted(range(n), key=lambda i: (-float(scores[i]), i)):
        near = [k for k in kept if cos[i, k] > 1.0 - eps]
        if near:
            group[i] = near[0]
        else:
            kept.append(i)
            group[i] = i
    return np.array(group)


def _partition(labels) -> set[frozenset]:
    groups: dict = {}
    for i, g in enumerate(np.asarray(labels).tolist()):
        groups.setdefault(g, set()).add(i)
    return {frozenset(g) for g in groups.values()}


def _best_of(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """(N,) bool: each group's member of highest score, ties to the lowest index (a Python loop)."""
    best: dict = {}
    for i, (g, s) in enumerate(zip(labels.tolist(), scores.tolist())):
        if g not in best or s > scores[best[g]]:
            best[g] = i
    keep = np.zeros(labels.size, dtype=bool)
    keep[list(best.values())] = True
    return keep


def _eps_between_gaps(cos: np.ndarray) -> float:
    """An eps whose 1 - eps sits in the middle of the widest gap between the pool's pair cosines
    in [0.95, 0.9999] (so that no pair is near the boundary: the groups are no rounding accident)."""
    values = np.unique(np.concatenate([[0.95, 0.9999], cos[(cos > 0.95) & (cos < 0.9999)]]))
    gaps = np.diff(values)
    i = int(np.argmax(gaps))
    assert gaps[i] > 1e-3, f"no clear gap between near copies and the rest: {values}"
    return float(1.0 - (values[i] + values[i + 1]) / 2)


# ---------------------------------------------------------------- 1. scores


def test_scores_and_embeddings_equal_a_naive_per_sample_encoding(pool, embedded):
    from mmalign.models.load import load

    loaded = load(pool.model)
    frame = _pool_frame(embedded)
    assert frame["key"].tolist() == _readable(pool)
    images = np.concatenate([np.load(embedded / "pool" / f"{u:05d}.image.npy") for u in range(N_SHARDS)])
    texts = {u: np.load(embedded / "pool" / f"{u:05d}.text.npy") for u in range(N_SHARDS)}
    offsets = np.cumsum(
        [0] + [len(pd.read_parquet(embedded / "pool" / f"{u:05d}.parquet")) for u in range(N_SHARDS)]
    )
    for row in frame.itertuples():
        shard, tar_key, members = pool.samples[row.key]
        assert row.tar_key == tar_key
        image = Image.open(io.BytesIO(members["jpg"])).convert("RGB")
        lines = [ln.strip() for ln in members["txt"].decode().splitlines() if ln.strip()]
        with torch.no_grad():
            img = F.normalize(loaded.model.encode_image(loaded.preprocess(image)[None]).float(), dim=-1)[0]
            txt = [
                F.normalize(loaded.model.encode_text(loaded.tokenizer([c])).float(), dim=-1)[0] for c in lines
            ]
        want = float(np.mean([float(img.double() @ t.double()) for t in txt]))
        assert row.captions == len(lines) and row.caption == lines[0]
        assert row.clip_score == pytest.approx(want, abs=1e-5), row.key
        np.testing.assert_allclose(
            images[offsets[shard] + row.image_emb_id].astype(np.float32),
            img.numpy(),
            rtol=0,
            atol=2e-3,
            err_msg=row.key,
        )  # float16 of a unit vector
        for j, t in enumerate(txt):
            np.testing.assert_allclose(
                texts[shard][row.text_emb_id + j].astype(np.float32),
                t.numpy(),
                rtol=0,
                atol=2e-3,
                err_msg=row.key,
            )
    assert frame.set_index("key").loc[TWO_CAPTIONS, "captions"] == 2


def test_embeddings_are_float16_of_the_naive_embedding(pool, embedded):
    """The stored rows are the float32 embedding rounded to float16, not just close to it."""
    from mmalign.models.load import load

    loaded = load(pool.model)
    frame = _pool_frame(embedded)
    stored = _pool_images(embedded)
    for i, key in enumerate(frame["key"]):
        image = Image.open(io.BytesIO(pool.samples[key][2]["jpg"])).convert("RGB")
        with torch.no_grad():
            img = F.normalize(loaded.model.encode_image(loaded.preprocess(image)[None]).float(), dim=-1)[0]
        want = img.numpy().astype(np.float16)
        # a batch of one and a batch of four may differ in the last float32 bits: one float16 ulp at most
        ulp = np.spacing(np.abs(want)).astype(np.float32)
        assert (np.abs(stored[i].astype(np.float32) - want.astype(np.float32)) <= ulp).all(), key


# ---------------------------------------------------------------- 9. bad samples


def test_bad_samples_are_skipped_and_counted_by_reason(pool, embedded):
    frame = _pool_frame(embedded)
    assert not set(BAD) & set(frame["key"])
    report = json.loads((embedded / "curate_report.json").read_text())
    assert report["pool"]["skipped"] == {"corrupt_image": 1, "missing_caption": 1}
    assert report["pool"]["samples"] == sum(SIZES) and report["pool"]["readable"] == sum(SIZES) - len(BAD)


# ---------------------------------------------------------------- 2. the keep-fraction threshold


def test_keep_fraction_threshold_is_the_whole_pools_quantile(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    _curate(pool, out, "--keep-fraction", "0.3")
    scores = _pool_frame(out)["clip_score"].to_numpy()  # float32, as stored
    want = scores >= np.quantile(scores, 0.7)
    decisions = pd.read_parquet(out / "decisions.parquet")
    assert decisions["key"].tolist() == _readable(pool)
    np.testing.assert_array_equal(decisions["kept"].to_numpy(), want)
    assert set(_written(out)) == {pool.samples[k][1] for k in np.array(_readable(pool))[want]}
    # the test tells a pool threshold from per-shard ones: the shards' own top 30% differ
    shards = decisions["shard"].to_numpy()
    per_shard = np.concatenate(
        [scores[shards == u] >= np.quantile(scores[shards == u], 0.7) for u in range(N_SHARDS)]
    )
    assert (per_shard != want).sum() >= 3

    floor = float(np.quantile(scores, 0.85))  # above the fraction's threshold: the floor decides some
    _curate(pool, out, "--keep-fraction", "0.3", "--clip-score-min", f"{floor:.6f}")
    both = pd.read_parquet(out / "decisions.parquet")
    np.testing.assert_array_equal(both["kept"].to_numpy(), want & (scores >= float(f"{floor:.6f}")))
    assert both["kept"].sum() < want.sum()
    floor = float(np.quantile(scores, 0.2))  # below it: the fraction decides
    _curate(pool, out, "--keep-fraction", "0.3", "--clip-score-min", f"{floor:.6f}")
    np.testing.assert_array_equal(pd.read_parquet(out / "decisions.parquet")["kept"].to_numpy(), want)


# ---------------------------------------------------------------- 3. de-duplication


def _brute_force_groups(embedded: Path) -> tuple[np.ndarray, float]:
    """The semantic groups over all pairs (and the eps they are taken at), from the stored embeddings."""
    x = _pool_images(embedded).astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cos = x @ x.T  # (N, N)
    i, j = np.triu_indices(len(x), k=1)
    eps = _eps_between_gaps(cos[i, j])
    return _greedy(cos, _pool_frame(embedded)["clip_score"].to_numpy(), eps), eps


def _byte_groups(pool: PoolData) -> np.ndarray:
    keys = _readable(pool)
    first: dict[bytes, int] = {}
    return np.array([first.setdefault(pool.samples[k][2]["jpg"], i) for i, k in enumerate(keys)])


def test_semantic_dedupe_equals_brute_force_greedy_groups(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    want, eps = _brute_force_groups(embedded)
    _curate(pool, out, "--dedupe", "semantic", "--dedupe-eps", repr(eps), "--dedupe-clusters", "1")
    decisions = pd.read_parquet(out / "decisions.parquet")
    got = decisions["semantic_group"].to_numpy()
    assert _partition(got) == _partition(want)
    np.testing.assert_array_equal(got, want)  # a group is named by its kept member's pool index
    # the pool's planted copies are found: b003~a002, c001~c002~a010, d001~d000 (exact), b004~b005~a003,
    # c003~b010, d002~c020 (near) -- more groups may exist by chance, these must
    index = {k: i for i, k in enumerate(_readable(pool))}
    for members in (
        ("a002", "b003"),
        ("a010", "c001", "c002"),
        ("d000", "d001"),
        ("a003", "b004", "b005"),
        ("b010", "c003"),
        ("c020", "d002"),
    ):
        assert len({int(want[index[k]]) for k in members}) == 1, members
    scores = decisions["clip_score"].to_numpy()
    np.testing.assert_array_equal(decisions["kept"].to_numpy(), _best_of(want, scores))
    assert (decisions["kept"].to_numpy() == decisions["kept_by_semantic"].to_numpy()).all()


def test_exact_dedupe_groups_are_the_byte_equal_images(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    _curate(pool, out, "--dedupe", "exact")
    decisions = pd.read_parquet(out / "decisions.parquet")
    want = _byte_groups(pool)
    assert _partition(decisions["exact_group"].to_numpy()) == _partition(want)
    assert sum(len(g) > 1 for g in _partition(want)) == 3
    np.testing.assert_array_equal(
        decisions["kept"].to_numpy(), _best_of(want, decisions["clip_score"].to_numpy())
    )


def _cos(embedded: Path) -> np.ndarray:
    x = _pool_images(embedded).astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x @ x.T  # (N, N)


def _exact_then_semantic(pool: PoolData, embedded: Path, eps: float) -> np.ndarray:
    """exact + semantic by hand: one kept copy per image bytes (best score), the greedy rule over
    those copies, and an exact copy's group is its kept copy's group."""
    keys, scores, cos = _readable(pool), _pool_frame(embedded)["clip_score"].to_numpy(), _cos(embedded)
    best: dict[bytes, int] = {}
    for i, k in enumerate(keys):
        b = pool.samples[k][2]["jpg"]
        if b not in best or scores[i] > scores[best[b]]:
            best[b] = i
    rep = [best[pool.samples[k][2]["jpg"]] for k in keys]
    reps = sorted(set(rep))
    local = _greedy(cos[np.ix_(reps, reps)], scores[reps], eps)
    group_of_rep = {r: reps[g] for r, g in zip(reps, local)}
    return np.array([group_of_rep[r] for r in rep])


def test_exact_and_semantic_do_not_chain(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    _, eps = _brute_force_groups(embedded)
    run = _curate(
        pool, out, "--dedupe", "exact,semantic", "--dedupe-eps", repr(eps), "--dedupe-clusters", "1"
    )
    decisions = pd.read_parquet(out / "decisions.parquet")
    want = _exact_then_semantic(pool, embedded, eps)
    np.testing.assert_array_equal(decisions["semantic_group"].to_numpy(), want)
    np.testing.assert_array_equal(decisions["combined_group"].to_numpy(), want)
    np.testing.assert_array_equal(decisions["kept"].to_numpy(), want == np.arange(want.size))
    cos = _cos(embedded)
    for i, g in enumerate(want):  # every member within eps of its kept member
        assert cos[i, g] > 1 - eps
        assert decisions["similarity_to_kept"].iat[i] == pytest.approx(cos[i, g], abs=1e-9)
    # the printed summary: kept per policy, the groups' sizes, the report's path
    n = len(want)
    sizes = np.unique(want, return_counts=True)[1]
    multi = sizes[sizes > 1]
    lines = run.stdout.splitlines()
    exact = _byte_groups(pool)
    assert (
        f"  exact: keeps {len(set(exact.tolist()))} of {n} ({100 * len(set(exact.tolist())) / n:.1f}%)"
        in lines
    )
    kept = int((want == np.arange(n)).sum())
    assert f"  dedupe: keeps {kept} of {n} ({100 * kept / n:.1f}%)" in lines
    assert (
        f"  duplicate groups: {multi.size} (largest {multi.max()}, median {np.median(multi):g}, "
        f"{(multi > 10).sum()} of more than 10)" in lines
    )
    near = cos - 2 * np.eye(n)  # not with itself
    near = near.max(axis=1)  # (N,) each sample's nearest other image, all pairs (one cluster)
    assert (
        f"  nearest other image: median cosine {np.quantile(near, 0.5):.4f}, 10% below "
        f"{np.quantile(near, 0.1):.4f} (duplicates: above 1 - eps = {1 - eps:.4f})" in lines
    )
    assert (
        lines[-1] == f"curated {n} samples into {out}: kept {kept} ({100 * kept / n:.1f}%); "
        f"report {out / 'curate_report.html'}"
    )


def test_reason_column_names_the_policy_and_the_duplicated_key(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    _, eps = _brute_force_groups(embedded)
    _curate(
        pool,
        out,
        "--keep-fraction",
        "0.6",
        "--dedupe",
        "exact,semantic",
        "--dedupe-eps",
        repr(eps),
        "--dedupe-clusters",
        "1",
    )
    decisions = pd.read_parquet(out / "decisions.parquet")
    keys, scores = _readable(pool), decisions["clip_score"].to_numpy()
    groups = _exact_then_semantic(pool, embedded, eps)
    low = scores < np.quantile(scores, 0.4)
    seen = set()
    for i, k in enumerate(keys):
        parts, of = [], None
        if low[i]:
            parts.append("clip_score")
        if groups[i] != i:
            of = keys[groups[i]]
            same = pool.samples[k][2]["jpg"] == pool.samples[of][2]["jpg"]
            parts.append(f"{'exact' if same else 'semantic'} duplicate of {of}")
        want = "; ".join(parts) or "kept"
        assert decisions["reason"].iat[i] == want, k
        got = decisions["duplicate_of"].iat[i]
        assert (None if pd.isna(got) else got) == of, k  # null when not a dropped duplicate
        seen.add(want.split(" of ")[0])
    assert {"kept", "clip_score", "exact duplicate", "semantic duplicate"} <= seen  # every kind occurs
    # the HTML report: each shown group's size, its members' cosine to the kept one, the histograms
    page = (out / "curate_report.html").read_text()
    sizes = np.unique(groups, return_counts=True)[1]
    assert f"<b>group of {sizes.max()}</b>" in page
    cos = _cos(embedded)
    dup = [i for i in range(len(keys)) if groups[i] != i]
    assert any(f"cosine to kept {cos[i, groups[i]]:.4f}" in page for i in dup)
    assert "removed duplicate's cosine with its kept member" in page and "highest cosine with another" in page
    report = json.loads((out / "curate_report.json").read_text())
    assert sum(report["dedupe"]["duplicate_similarity"]["counts"]) == len(dup)
    assert report["dedupe"]["group_sizes"]["largest"] == sizes.max()


def _tree(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_policy_dropping_more_than_max_drop_writes_nothing(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    _curate(pool, out, "--keep-fraction", "0.9")  # a previous run's outputs, which must stay as they are
    before = _tree(out)
    eps = 1.5  # cosine > -0.5: nearly every pair of this pool
    run = cli_main(
        "curate",
        "--data",
        pool.dir,
        "--model",
        pool.model,
        "--out",
        out,
        "--no-progress",
        "--dedupe",
        "semantic",
        "--dedupe-eps",
        "1.5",
        "--dedupe-clusters",
        "1",
    )
    assert run.returncode == 2, run.stderr
    lines = run.stderr.strip().splitlines()
    groups = _greedy(_cos(embedded), _pool_frame(embedded)["clip_score"].to_numpy(), eps)
    n, kept = len(groups), len(set(groups.tolist()))
    largest = np.unique(groups, return_counts=True)[1].max()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr
    for words in (
        "semantic",
        f"would drop {n - kept} of {n}",
        "--max-drop 0.5",
        f"largest group holds {largest}",
        "--force",
    ):
        assert words in lines[0], (words, lines[0])
    assert _tree(out) == before  # nothing written, nothing removed
    # a score floor that drops most of the pool is refused too; a keep fraction states its drop
    scores = _pool_frame(embedded)["clip_score"].to_numpy()
    floor = float(np.quantile(scores, 0.8))
    run = cli_main(
        "curate",
        "--data",
        pool.dir,
        "--model",
        pool.model,
        "--out",
        out,
        "--no-progress",
        "--clip-score-min",
        f"{floor:.6f}",
    )
    assert run.returncode == 2 and "--clip-score-min" in run.stderr and "would drop" in run.stderr
    _curate(pool, out, "--keep-fraction", "0.1")
    # --force writes it; --max-drop 1 too
    _curate(pool, out, "--dedupe", "semantic", "--dedupe-eps", "1.5", "--dedupe-clusters", "1", "--force")
    assert pd.read_parquet(out / "decisions.parquet")["kept"].sum() == kept
    _curate(
        pool, out, "--dedupe", "semantic", "--dedupe-eps", "1.5", "--dedupe-clusters", "1", "--max-drop", "1"
    )


# ---------------------------------------------------------------- 7. outputs


def _meta(members: dict) -> dict:
    return json.loads(members["json"]) if "json" in members else {}


def test_new_shards_hold_exactly_the_kept_samples_byte_for_byte(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    groups, eps = _brute_force_groups(embedded)
    _curate(
        pool,
        out,
        "--keep-fraction",
        "0.6",
        "--dedupe",
        "semantic",
        "--dedupe-eps",
        repr(eps),
        "--dedupe-clusters",
        "1",
    )
    decisions = pd.read_parquet(out / "decisions.parquet")
    keys, scores = _readable(pool), decisions["clip_score"].to_numpy()
    by_score = scores >= np.quantile(scores, 0.4)
    by_dedupe = _best_of(groups, scores)
    kept = by_score & by_dedupe
    assert 0 < kept.sum() < min(by_score.sum(), by_dedupe.sum())  # both policies drop something
    written = _written(out)
    assert set(written) == {pool.samples[k][1] for k in np.array(keys)[kept]}
    score_of = dict(zip(keys, scores.tolist()))
    for tar_key, members in written.items():
        key = tar_key.rsplit("/", 1)[-1]
        source = pool.samples[key][2]
        assert set(members) == set(source) | {"json"}, key
        for ext, data in source.items():
            if ext != "json":
                assert members[ext] == data, (key, ext)
        assert json.loads(members["json"]) == {**_meta(source), "clip_score": round(score_of[key], 6)}, key
    # sizes.json and the per-shard tables count what the tars hold
    sizes = json.loads((out / "sizes.json").read_text())
    tars = sorted(p.name for p in out.glob("[0-9]*.tar"))
    assert sorted(sizes) == tars and len(tars) == math.ceil(kept.sum() / 10)
    for name in tars:
        held = list(_read_tar(out / name))
        assert sizes[name] == len(held)
        table = pd.read_parquet(out / name.replace(".tar", ".parquet"))
        assert table["key"].tolist() == [k.rsplit("/", 1)[-1] for k in held]
    assert sum(sizes.values()) == kept.sum()
    # the report
    report = json.loads((out / "curate_report.json").read_text())
    assert report["kept"]["kept"] == kept.sum()
    assert report["kept_by_policy"]["clip_score"]["kept"] == by_score.sum()
    assert report["kept_by_policy"]["semantic"]["kept"] == by_dedupe.sum()
    assert report["kept_by_policy"]["dedupe"]["kept"] == by_dedupe.sum()
    assert sum(report["histogram"]["counts"]) == len(keys)
    page = (out / "curate_report.html").read_text()
    assert '<img src="data:image/jpeg;base64,' in page


def test_keys_only_writes_the_kept_keys_and_no_shards(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    _curate(pool, out, "--keep-fraction", "0.5", "--dedupe", "exact", "--keys-only")
    scores = _pool_frame(out)["clip_score"].to_numpy()
    kept = (scores >= np.quantile(scores, 0.5)) & _best_of(_byte_groups(pool), scores)
    lines = (out / "keep_keys.txt").read_text().splitlines()
    assert lines == [k for k, keep in zip(_readable(pool), kept) if keep]  # in pool order, without folders
    assert not list(out.glob("*.tar")) and not (out / "sizes.json").exists()


def test_false_negative_groups_label_every_sample_and_drop_none(pool, embedded, tmp_path):
    out = _out_with_embeddings(embedded, tmp_path / "out")
    groups, eps = _brute_force_groups(embedded)
    _curate(pool, out, "--false-negative-groups", "dup", "--dedupe-eps", repr(eps), "--dedupe-clusters", "1")
    keys = _readable(pool)
    written = {k.rsplit("/", 1)[-1]: m for k, m in _written(out).items()}
    assert sorted(written) == sorted(keys)  # nothing dropped
    labels = [json.loads(written[k]["json"])["dup"] for k in keys]
    assert _partition(labels) == _partition(groups)  # equal values exactly within one group
    assert sum(len(g) > 1 for g in _partition(groups)) >= 4
    # the label is the key of the member a dedupe would keep
    best = _best_of(groups, _pool_frame(out)["clip_score"].to_numpy())
    for i, k in enumerate(keys):
        assert best[keys.index(labels[i])] and groups[keys.index(labels[i])] == groups[i], k
        assert {
            f: v for f, v in json.loads(written[k]["json"]).items() if f not in ("dup", "clip_score")
        } == _meta(pool.samples[k][2])


# ---------------------------------------------------------------- 8. bad input


def _no_weights(pool: PoolData, tmp_path: Path) -> str:
    folder = tmp_path / "model"
    shutil.copytree(pool.model, folder)
    for p in folder.glob("*.safetensors"):
        p.unlink()
    return str(folder)


@pytest.mark.parametrize(
    "case",
    [
        "no_weights",
        "field_in_first_json",
        "field_in_a_later_shard",
        "fraction_0",
        "fraction_1.5",
        "fraction_nan",
        "missing_shard",
        "dedupe_fuzzy",
    ],
)
def test_bad_input_is_a_one_line_error_with_exit_2(pool, tmp_path, case):
    model, data, flags, words = pool.model, str(pool.dir), [], ()
    if case == "no_weights":
        model, words = _no_weights(pool, tmp_path), ("model",)
    elif case == "field_in_first_json":
        flags, words = ["--false-negative-groups", "src"], ("src", "already")
    elif case == "field_in_a_later_shard":
        flags, words = ["--false-negative-groups", "label"], ("label", "already", "00002.tar")
    elif case.startswith("fraction_"):
        flags, words = ["--keep-fraction", case.split("_")[1]], ("--keep-fraction",)
    elif case == "missing_shard":
        data, words = f"{pool.dir}/{{00000..00004}}.tar", ("not found", "00004.tar")
    elif case == "dedupe_fuzzy":
        flags, words = ["--dedupe", "fuzzy"], ("--dedupe", "fuzzy")
    run = cli_main(
        "curate", "--data", data, "--model", model, "--out", tmp_path / "out", "--no-progress", *flags
    )
    print(run.stderr)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmalign: error:"), run.stderr
    assert "Traceback" not in run.stderr + run.stdout
    for w in words:
        assert w in lines[0], (w, lines[0])


def test_a_run_that_fails_before_embedding_does_not_block_the_corrected_rerun(pool, tmp_path):
    """A typo in --model is a one-line error; the same command with the right path then runs."""
    out = tmp_path / "out"
    run = cli_main(
        "curate", "--data", pool.dir, "--model", f"{pool.model}_typo", "--out", out, "--no-progress"
    )
    assert run.returncode == 2 and "does not exist" in run.stderr
    run = cli_main("curate", "--data", pool.dir, "--model", pool.model, "--out", out, "--no-progress")
    assert run.returncode == 0, run.stderr


@pytest.fixture(scope="module")
def served(pool):
    """The pool over http://127.0.0.1:PORT/ (tests/harness/shard_server.py)."""
    with serve(pool.dir) as server:
        server.spec = f"{server.url}/{{00000..{N_SHARDS - 1:05d}}}.tar"
        yield server


POLICY = ("--keep-fraction", "0.5", "--dedupe", "exact,semantic", "--dedupe-clusters", "1")


def _same_outputs(got: Path, want: Path) -> None:
    """Equal written tars (member names and bytes, in order), decisions and pass-1 tables."""
    tars = sorted(p.name for p in want.glob("[0-9]*.tar"))
    assert sorted(p.name for p in got.glob("[0-9]*.tar")) == tars and tars
    for name in tars:
        with tarfile.open(got / name) as a, tarfile.open(want / name) as b:
            assert [(m.name, a.extractfile(m).read()) for m in a.getmembers()] == [
                (m.name, b.extractfile(m).read()) for m in b.getmembers()
            ], name
    pd.testing.assert_frame_equal(
        pd.read_parquet(got / "decisions.parquet"), pd.read_parquet(want / "decisions.parquet")
    )
    assert json.loads((got / "sizes.json").read_text()) == json.loads((want / "sizes.json").read_text())
    for u in range(N_SHARDS):
        pd.testing.assert_frame_equal(
            pd.read_parquet(got / "pool" / f"{u:05d}.parquet"),
            pd.read_parquet(want / "pool" / f"{u:05d}.parquet"),
        )
        for part in ("image", "text"):
            np.testing.assert_array_equal(
                np.load(got / "pool" / f"{u:05d}.{part}.npy"), np.load(want / "pool" / f"{u:05d}.{part}.npy")
            )


@pytest.fixture(scope="module")
def remote_run(pool, served, tmp_path_factory) -> Path:
    """A straight run of POLICY over http, in this process."""
    out = tmp_path_factory.mktemp("remote") / "out"
    _curate(pool, out, *POLICY, data=served.spec)
    return out


@pytest.fixture(scope="module")
def local_run(pool, embedded, tmp_path_factory) -> Path:
    """POLICY over the local pool (the embeddings of ``embedded``)."""
    out = _out_with_embeddings(embedded, tmp_path_factory.mktemp("local") / "out")
    _curate(pool, out, *POLICY)
    return out


# ---------------------------------------------------------------- 5. remote shards


def test_remote_shards_give_the_decisions_and_samples_of_the_local_pool(remote_run, local_run):
    got, want = (
        pd.read_parquet(remote_run / "decisions.parquet"),
        pd.read_parquet(local_run / "decisions.parquet"),
    )
    pd.testing.assert_frame_equal(got, want)
    assert 0 < got["kept"].sum() < len(got)
    assert _written(remote_run) == _written(local_run)  # the same samples, byte for byte
    for u in range(N_SHARDS):
        np.testing.assert_array_equal(
            np.load(remote_run / "pool" / f"{u:05d}.image.npy"),
            np.load(local_run / "pool" / f"{u:05d}.image.npy"),
        )
    report = json.loads((remote_run / "curate_report.json").read_text())
    assert report["pool"]["skipped"] == {"corrupt_image": 1, "missing_caption": 1}
    assert '<img src="data:image/jpeg;base64,' in (remote_run / "curate_report.html").read_text()


# ---------------------------------------------------------------- 4. resume after kill -9


def _subprocess_env() -> dict:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }


def _curate_cmd(pool: PoolData, data: str, out: Path, *flags) -> list[str]:
    return [
        sys.executable,
        "-m",
        "mmalign.cli",
        "curate",
        "--data",
        data,
        "--model",
        pool.model,
        "--out",
        str(out),
        "--no-progress",
        "--batch-size",
        "4",
        "--per-shard",
        "10",
        *flags,
    ]


@pytest.mark.integration
def test_resume_after_kill_9_equals_a_straight_run(pool, served, remote_run, tmp_path):
    out = tmp_path / "out"
    cmd = _curate_cmd(pool, served.spec, out, *POLICY)
    with served.lock:
        served.requests.clear()  # the probes of this run are the first requests
        served.held = {f"{u:05d}.tar" for u in range(1, N_SHARDS)}
    served.gate.clear()  # shard 1 and later wait: the kill falls between shard 0 and shard 1
    try:
        with open(tmp_path / "log", "w") as log:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=_subprocess_env(), stdout=log, stderr=subprocess.STDOUT
            )
        first = out / "pool" / "00000.json"
        deadline = time.monotonic() + 120
        while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert first.exists(), (proc.poll(), (tmp_path / "log").read_text())
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        served.gate.set()
        served.held = set()
    assert not (out / "pool" / "00001.json").exists() and not (out / "decisions.parquet").exists()
    stamp = {p.name: p.stat().st_mtime_ns for p in (out / "pool").glob("00000.*")}

    resumed = subprocess.run(
        cmd, cwd=ROOT, env=_subprocess_env(), capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr
    assert {
        p.name: p.stat().st_mtime_ns for p in (out / "pool").glob("00000.*")
    } == stamp  # not embedded again
    report = json.loads((out / "curate_report.json").read_text())
    assert report["timing"]["this_run_rank0_embedded_shards"] == N_SHARDS - 1
    _same_outputs(out, remote_run)


# ---------------------------------------------------------------- 6. --nproc 2


def test_ranks_split_the_shards_and_give_the_output_of_one(pool, local_run, tmp_path, monkeypatch):
    """The split torchrun and SLURM launches get (RANK / WORLD_SIZE), in this process: rank 1's
    share embedded first, then rank 0 embeds its own, waits for every shard and decides."""
    from data_pipelines.curate import run as run_mod
    from data_pipelines.curate.decide import Policies
    from data_pipelines.shard_input import input_shards

    out = tmp_path / "out"
    opts = run_mod.Options(data=str(pool.dir), model=pool.model, out=str(out), progress=False, batch_size=4)
    urls = input_shards(opts.data)
    run_mod.outdir.claim(
        out, overwrite=False
    )  # rank 0 takes --out first (the other ranks wait for its stamp)
    part = run_mod.embed_part(opts, urls, out, rank=1, world=2)
    assert part["shards"] == N_SHARDS // 2
    assert sorted(p.name for p in (out / "pool").glob("*.json") if p.name != "stamp.json") == [
        f"{u:05d}.json" for u in range(1, N_SHARDS, 2)
    ]
    monkeypatch.setattr(run_mod, "_rank", lambda: (0, 2))
    policies = Policies(keep_fraction=0.5, dedupe=("exact", "semantic"), dedupe_clusters=1)  # = POLICY
    opts = run_mod.Options(
        data=str(pool.dir),
        model=pool.model,
        out=str(out),
        progress=False,
        batch_size=4,
        per_shard=10,
        policies=policies,
    )
    report = run_mod.curate(opts)
    assert report["processes"] == 2 and report["timing"]["this_run_rank0_embedded_shards"] == N_SHARDS // 2
    _same_outputs(out, local_run)


@pytest.mark.slow
@pytest.mark.integration
def test_two_processes_give_the_output_of_one(pool, local_run, tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(
        _curate_cmd(pool, str(pool.dir), out, *POLICY, "--nproc", "2"),
        cwd=ROOT,
        env=_subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "curate_report.json").read_text())
    assert report["processes"] == 2 and report["timing"]["this_run_rank0_embedded_shards"] == N_SHARDS // 2
    _same_outputs(out, local_run)


def test_nproc_relaunches_the_command_it_was_given(pool, tmp_path, monkeypatch):
    import mmalign.dist.launch as launch

    seen = []
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv: seen.append((nproc, list(argv))) or 0)
    args = [
        "curate",
        "--data",
        str(pool.dir),
        "--model",
        pool.model,
        "--out",
        str(tmp_path / "out"),
        "--no-progress",
        "--nproc",
        "2",
    ]
    run = cli_main(*args)
    assert run.returncode == 0, run.stderr
    assert seen == [(2, args)]
