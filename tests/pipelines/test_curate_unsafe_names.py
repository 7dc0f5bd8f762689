"""Member names that would extract outside the folder (``../evil.jpg``, ``/abs.jpg``,
``a/../../b.jpg``) are counted skips wherever tars are read, and never copied into an output:
``mmalign curate``, ``mmalign shards imagefolder --input x.tar``, ``mmalign mine``'s copy, and
the readers underneath (``tario.iter_samples``, ``shards.iter_tar_groups``).

References: the names this test wrote, and the written tars read back with ``tarfile``.
"""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from tests.data.test_data_loader import write_shard
from tests.harness import cli_main
from tests.pipelines.test_curate_cli import _jpeg, _one_thread, _pixels, _save_model  # noqa: F401

UNSAFE = ("../evil", "/abs", "a/../../b")


def _tar(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    write_shard(path, samples)
    with tarfile.open(path) as tar:  # the names are in the archive as written (not cleaned by tarfile)
        names = tar.getnames()
    assert {f"{k}.jpg" for k, _ in samples} <= set(names)


def _pool(path: Path, rng) -> list[str]:
    safe = [f"s{i:03d}" for i in range(6)]
    order = safe[:2] + list(UNSAFE) + safe[2:]
    _tar(
        path,
        [(k, {"jpg": _jpeg(_pixels(rng, 0)), "txt": f"a photo {i}".encode()}) for i, k in enumerate(order)],
    )
    return safe


def test_readers_yield_unsafe_samples_unread_and_flagged(tmp_path):
    from mmalign.data.shards import BadSample, decode_sample, iter_tar_groups
    from mmalign.data.tario import iter_samples

    safe = _pool(tmp_path / "x.tar", np.random.default_rng(0))
    with open(tmp_path / "x.tar", "rb") as f:
        samples = list(iter_samples(f))
    assert [s.key for s in samples if s.unsafe] == list(UNSAFE)
    assert all(not s.members for s in samples if s.unsafe)  # never read
    assert [s.key for s in samples if not s.unsafe] == safe and all(
        s.members for s in samples if not s.unsafe
    )
    reasons = []
    for raw in iter_tar_groups(str(tmp_path / "x.tar")):
        try:
            decode_sample(raw)
        except BadSample as e:
            reasons.append((raw["__key__"], e.reason))
    assert reasons == [(k, "unsafe_name") for k in UNSAFE]


def test_curate_skips_and_counts_them_and_never_writes_them(tmp_path):
    rng = np.random.default_rng(1)
    (tmp_path / "pool").mkdir()
    safe = _pool(tmp_path / "pool" / "00000.tar", rng)
    model = _save_model(tmp_path / "model", 1)
    out = tmp_path / "out"
    run = cli_main(
        "curate",
        "--data",
        tmp_path / "pool",
        "--model",
        model,
        "--out",
        out,
        "--no-progress",
        "--batch-size",
        "4",
    )
    assert run.returncode == 0, run.stderr
    report = json.loads((out / "curate_report.json").read_text())
    assert report["pool"]["skipped"] == {"unsafe_name": 3}
    with tarfile.open(out / "00000.tar") as tar:
        names = tar.getnames()
    assert sorted({n.split(".", 1)[0] for n in names}) == safe
    assert not any(n.startswith("/") or ".." in n.split("/") for n in names)


def test_imagefolder_from_a_tar_skips_and_counts_them(tmp_path):
    rng = np.random.default_rng(2)
    _tar(
        tmp_path / "x.tar",
        [(k, {"jpg": _jpeg(_pixels(rng, 0))}) for k in ("cat/0", "cat/1", "dog/2", *UNSAFE)],
    )
    run = cli_main(
        "shards", "imagefolder", "--input", tmp_path / "x.tar", "--out", tmp_path / "out", "--no-progress"
    )
    assert run.returncode == 0, run.stderr
    assert "skipped 3 member(s) with an unsafe name" in run.stderr
    assert "wrote 3 samples" in run.stdout
    sources, classes = [], set()
    for shard in sorted((tmp_path / "out").glob("*.tar")):
        with tarfile.open(shard) as tar:
            for m in tar.getmembers():
                assert not m.name.startswith("/") and ".." not in m.name.split("/"), m.name
                if m.name.endswith(".json"):
                    meta = json.loads(tar.extractfile(m).read())
                    sources.append(meta["source_path"])
                    classes.add(meta["classname"])
    assert sorted(sources) == ["cat/0.jpg", "cat/1.jpg", "dog/2.jpg"] and classes == {"cat", "dog"}


def test_mine_copy_skips_them_and_keeps_the_sample_order(tmp_path):
    from data_pipelines.mine import _rewrite

    rng = np.random.default_rng(3)
    safe = _pool(tmp_path / "x.tar", rng)
    # pass 1 numbers samples as the reader yields them, unsafe ones included: s002 is the 6th
    negatives = {(0, 5): ("s002", ["a dog"])}
    written = _rewrite(str(tmp_path / "x.tar"), 0, tmp_path / "y.tar", negatives)
    assert written["unsafe_members_skipped"] == 6  # 3 samples x (.jpg, .txt)
    with tarfile.open(tmp_path / "y.tar") as tar:
        names = tar.getnames()
        meta = json.loads(tar.extractfile("s002.json").read())
    assert sorted({n.split(".", 1)[0] for n in names}) == safe
    assert meta == {"hard_negatives": ["a dog"]}


@pytest.mark.parametrize("name", ["x.jpg", "a/b.jpg", "./a.jpg", "a..b.jpg", "..a/b.jpg"])
def test_ordinary_names_are_safe(name):
    from mmalign.data.tario import unsafe_name

    assert not unsafe_name(name)
