"""data.decontaminate (issue 43, point 4): ``mmalign train`` states at start-up how many images of an
evaluation set have near-duplicates in (a sample of) its training shards, and refuses to start in
strict mode.

The expected counts are computed here by brute force: every (training sample, evaluation image)
pair of the images this file wrote, hashed by ``phash.hash_images`` and compared with
``phash.distance`` (the definition of "within the threshold").
"""

from __future__ import annotations

import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from mmalign.config import load_config
from mmalign.data import phash
from mmalign.errors import ConfigError
from mmalign.evaluation import contamination
from mmalign.run import contamination_check as cc
from tests.evaluation.test_contamination import write_tar
from tests.harness import cli_main

PER_SHARD = 12
SHARDS = 3
EVAL = 10


def smooth_image(rng: np.random.Generator, side: int = 40) -> Image.Image:
    """A random image with structure at several scales, as photos have."""
    base = rng.integers(0, 256, (6, 6, 3), dtype=np.uint8)
    img = Image.fromarray(base).resize((side, side), Image.Resampling.BICUBIC)
    detail = rng.integers(-25, 26, (side, side, 3))
    return Image.fromarray(np.clip(np.asarray(img, np.int64) + detail, 0, 255).astype(np.uint8))


def encoded(image: Image.Image, fmt: str = "PNG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format=fmt, **kw)
    return buf.getvalue()


def edits(image: Image.Image) -> list[tuple[str, bytes]]:
    """The edits of curate's bench, each as (extension, stored bytes)."""
    w, h = image.size
    return [
        ("png", encoded(image.transpose(Image.Transpose.FLIP_LEFT_RIGHT))),
        (
            "png",
            encoded(image.crop((0, 0, w * 9 // 10, h * 9 // 10)).resize((w, h), Image.Resampling.BICUBIC)),
        ),
        ("jpg", encoded(image, "JPEG", quality=70)),
        ("png", encoded(image.resize((w * 3 // 4, h * 3 // 4), Image.Resampling.BILINEAR))),
    ]


def make_data(root: Path, planted: int, seed: int = 0) -> tuple[str, str]:
    """An evaluation tar of EVAL images and SHARDS training shards of PER_SHARD samples, the first
    ``planted`` evaluation images among them, each edited (flip, crop, JPEG, resize in turn).
    Returns (training shard spec, evaluation target)."""
    rng = np.random.default_rng(seed)
    evals = [smooth_image(rng) for _ in range(EVAL)]
    (root / "eval").mkdir(parents=True)
    write_tar(root / "eval" / "00000.tar", {f"e{i:03d}.png": encoded(im) for i, im in enumerate(evals)})
    samples = [("png", encoded(smooth_image(rng))) for _ in range(SHARDS * PER_SHARD - planted)]
    for i in range(planted):
        samples.insert(int(rng.integers(0, len(samples) + 1)), edits(evals[i])[i % 4])
    (root / "train").mkdir()
    for s in range(SHARDS):
        members = {}
        for j, (ext, data) in enumerate(samples[s * PER_SHARD : (s + 1) * PER_SHARD]):
            key = f"{s:02d}_{j:04d}"
            members[f"{key}.{ext}"] = data
            members[f"{key}.txt"] = b"a random picture"
        write_tar(root / "train" / f"{s:05d}.tar", members)
    return f"{root}/train/{{00000..{SHARDS - 1:05d}}}.tar", str(root / "eval" / "00000.tar")


def images_of(tar: Path) -> list[Image.Image]:
    with tarfile.open(tar) as t:
        return [
            Image.open(io.BytesIO(t.extractfile(m).read())).convert("RGB")
            for m in t.getmembers()
            if m.name.endswith((".png", ".jpg"))
        ]


def reference(root: Path, radius: int) -> tuple[int, int]:
    """(evaluation images with a training sample within ``radius``, training samples with an
    evaluation image within it), over every pair."""
    train = [im for s in range(SHARDS) for im in images_of(root / "train" / f"{s:05d}.tar")]
    tq, ti = phash.hash_images(train)
    eq, ei = phash.hash_images(images_of(root / "eval" / "00000.tar"))
    near = np.array(
        [
            [phash.distance(tq[a], ti[a], eq[b], ei[b]) <= radius for b in range(len(eq))]
            for a in range(len(tq))
        ]
    )  # (train, eval)
    return int(near.any(axis=0).sum()), int(near.any(axis=1).sum())


def config(tmp_path: Path, train: str, target: str, *more: str):
    return load_config(
        None,
        [
            "model.preset=micro",
            f"data.train={train}",
            f"data.decontaminate={target}",
            f"output={tmp_path / 'run'}",
            *more,
        ],
    )


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MMALIGN_CACHE", str(tmp_path / "cache"))


def test_planted_evaluation_images_are_counted_exactly(tmp_path):
    train, target = make_data(tmp_path, planted=6)
    want_eval, want_samples = reference(tmp_path, phash.DEFAULT_DISTANCE)
    assert want_eval >= 3 and want_samples >= 3  # most edits are near at the default distance: not vacuous
    said: list[str] = []
    cfg = config(tmp_path, train, target, f"data.decontaminate_distance={phash.DEFAULT_DISTANCE}")
    result = cc.check(cfg, said.append)
    assert (result["eval_found"], result["samples_found"]) == (want_eval, want_samples)
    assert result["samples_checked"] == SHARDS * PER_SHARD and result["estimate"] == want_samples
    line = said[-1]
    assert line.startswith(f"mmalign: data.decontaminate: {want_eval} of the {EVAL} images of {target} ")
    assert f"checked {SHARDS * PER_SHARD} samples from {SHARDS} of {SHARDS} shards" in line
    assert f"; {want_samples} in all, within" in line  # every sample checked: a count, no "~"
    for m in result["matches"]:  # each listed copy is within the distance of the evaluation image it names
        with tarfile.open(m["shard"]) as t:
            (name,) = [n for n in t.getnames() if n.startswith(m["key"] + ".") and not n.endswith(".txt")]
            image = Image.open(io.BytesIO(t.extractfile(name).read())).convert("RGB")
        with tarfile.open(target) as t:
            original = Image.open(io.BytesIO(t.extractfile(m["eval_key"] + ".png").read())).convert("RGB")
        (q, i), (eq, ei) = phash.hash_images([image]), phash.hash_images([original])
        assert m["distance"] == phash.distance(q[0], i[0], eq[0], ei[0]) <= phash.DEFAULT_DISTANCE


def test_a_sample_of_the_shards_is_checked_and_extrapolated(tmp_path):
    train, target = make_data(tmp_path, planted=8)
    cfg = config(tmp_path, train, target, "data.decontaminate_samples=15")
    said: list[str] = []
    result = cc.check(cfg, said.append)
    assert result["samples_checked"] == 15 and result["shards_read"] == 2 and result["shards"] == SHARDS
    assert result["pool_samples"] == SHARDS * PER_SHARD  # the part-read shard counted from its headers
    assert result["estimate"] == round(result["samples_found"] * SHARDS * PER_SHARD / 15)
    assert f"from 2 of {SHARDS} shards" in said[-1] and f"~{result['estimate']} in all" in said[-1]
    again = cc.check(cfg, said.append)  # the draw is seeded
    assert again["matches"] == result["matches"]
    sizes = {f"{s:05d}.tar": 2 * PER_SHARD for s in range(SHARDS)}  # what a builder's sizes.json says wins
    (tmp_path / "train" / "sizes.json").write_text(json.dumps(sizes))
    listed = cc.check(cfg, said.append)
    assert listed["pool_samples"] == 2 * SHARDS * PER_SHARD and listed["pool_samples_exact"]
    assert listed["estimate"] == round(listed["samples_found"] * 2 * SHARDS * PER_SHARD / 15)


def test_clean_shards_say_zero(tmp_path):
    train, target = make_data(tmp_path, planted=0)
    assert reference(tmp_path, phash.DEFAULT_DISTANCE) == (0, 0)
    said: list[str] = []
    result = cc.check(config(tmp_path, train, target, "data.decontaminate_strict=true"), said.append)
    assert result["eval_found"] == 0 and result["matches"] == []
    assert said[-1].startswith(f"mmalign: data.decontaminate: 0 of the {EVAL} images of {target} ")


def test_the_second_start_reads_the_cached_hashes(tmp_path, monkeypatch):
    train, target = make_data(tmp_path, planted=2)
    hashed = []
    real = contamination.eval_images

    def counting(*a, **kw):
        for item in real(*a, **kw):
            hashed.append(item[0])
            yield item

    monkeypatch.setattr(contamination, "eval_images", counting)
    cfg = config(tmp_path, train, target)
    first = cc.check(cfg, lambda line: None)
    assert len(hashed) == EVAL
    assert any((tmp_path / "cache" / "decontaminate").iterdir())  # under MMALIGN_CACHE
    second = cc.check(cfg, lambda line: None)
    assert len(hashed) == EVAL  # no image of the target read again
    assert second["eval_found"] == first["eval_found"] and second["matches"] == first["matches"]


def test_bad_target_is_one_line(tmp_path):
    train, _ = make_data(tmp_path, planted=0)
    for target in (str(tmp_path / "nothing_here"), "not-a-suite", str(tmp_path / "train" / "00000.txt")):
        with pytest.raises(ConfigError) as e:
            cc.check(config(tmp_path, train, target), lambda line: None)
        text = str(e.value)
        assert "\n" not in text and text.startswith("config key 'data.decontaminate'"), text
    (tmp_path / "empty").mkdir()
    write_tar(tmp_path / "empty" / "00000.tar", {"a.txt": b"no image"})
    with pytest.raises(ConfigError, match="no readable image"):
        cc.check(config(tmp_path, train, str(tmp_path / "empty" / "00000.tar")), lambda line: None)


def test_the_result_reaches_the_run_directory_and_the_headline(tmp_path):
    train, target = make_data(tmp_path, planted=3)
    cfg = config(tmp_path, train, target)
    result = cc.check(cfg, lambda line: None)
    out = tmp_path / "run"
    out.mkdir()
    with cc.handed_over(result):
        assert cc.handed(cfg) == result
        cc.record(cfg, out)
    assert cc.ENV not in os.environ
    stored = json.loads((out / "decontamination.json").read_text())
    assert stored["eval_found"] == result["eval_found"]
    (note,) = cc.note_lines(out)
    assert f"{result['eval_found']} of its {EVAL} images" in note and target in note
    other = config(tmp_path, train, target, "data.decontaminate_distance=1")
    with cc.handed_over(result):
        assert cc.handed(other) is None  # another check's result is not recorded as this one's


def test_a_resume_states_the_stored_result_and_another_config_checks_again(tmp_path, monkeypatch):
    train, target = make_data(tmp_path, planted=3)
    cfg = config(tmp_path, train, target)
    out = tmp_path / "run"
    out.mkdir()
    with cc.handed_over(cc.check(cfg, lambda line: None)):
        cc.record(cfg, out)
    checks = []
    monkeypatch.setattr(cc, "check", lambda cfg, say=print: checks.append(cfg) or {})
    said: list[str] = []
    found = cc.at_start(cfg, out, "latest", said.append)
    assert checks == [] and found == cc.stored(out) and said[-1].endswith("(as checked at the run's start)")
    cc.at_start(cfg, out, None, said.append)  # a fresh start checks
    cc.at_start(config(tmp_path, train, target, "data.decontaminate_samples=5"), out, "latest", said.append)
    assert len(checks) == 2
    assert cc.at_start(config(tmp_path, train, "null"), out, None) is None  # off: nothing checked


def _train(out: Path, train: str, target: str, *overrides: str):
    """``mmalign train`` of the micro preset on ``train`` with ``data.decontaminate: target``."""
    sets = ["model.preset=micro", f"data.train={train}", f"data.decontaminate={target}", *overrides]
    return cli_main("train", "--output", out, *[a for o in sets for a in ("--set", o)])


def test_strict_refuses_to_start_in_one_line(tmp_path):
    train, target = make_data(tmp_path, planted=4)
    out = tmp_path / "run"
    res = _train(out, train, target, "data.decontaminate_strict=true", "eval.suite=none")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    want_eval, _ = reference(tmp_path, int(load_config(None, []).data.decontaminate_distance))
    assert "data.decontaminate_strict" in lines[0] and f"{want_eval} of the {EVAL} images" in lines[0]
    assert not out.exists()  # nothing started, no run directory left behind
    res = _train(out, train, "nope")
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "data.decontaminate" in lines[0], res.stderr[-2000:]
    assert not out.exists()


@pytest.mark.integration
def test_a_run_warns_and_records_the_check(tmp_path):
    train, target = make_data(tmp_path, planted=4)
    out = tmp_path / "run"
    res = _train(
        out,
        train,
        target,
        "data.workers=0",
        "data.shuffle_buffer=10",
        "train.global_batch_size=8",
        "train.steps=2",
        "train.warmup_steps=1",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        "eval.suite=none",
    )
    assert res.returncode == 0, res.stderr[-2000:]
    want_eval, _ = reference(tmp_path, int(load_config(None, []).data.decontaminate_distance))
    assert f"mmalign: data.decontaminate: {want_eval} of the {EVAL} images of {target} " in res.stdout
    stored = json.loads((out / "decontamination.json").read_text())
    assert stored["eval_found"] == want_eval and stored["target"] == target


def test_the_config_default_distance_is_decontaminations():
    """data.decontaminate_distance's default (a literal: the config layer sits below data) is the
    distance curate --decontaminate uses."""
    from mmalign.config.schema import DataConfig
    from mmalign.evaluation.contamination import DEFAULT_DISTANCE

    assert DataConfig().decontaminate_distance == DEFAULT_DISTANCE
