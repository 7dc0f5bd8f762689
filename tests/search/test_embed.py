"""``mmalign embed``: the ``.json`` fields as metadata columns (contract C1), the split of the shards
over ranks, and the resume after an interruption.

References: the columns against a table written out by hand from the ``.json`` this file wrote;
a split or resumed run against a straight one-process run of the same data (bitwise: batches
never span shards, so the ranks compute exactly what one process does).
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from PIL import Image

import mmalign.search.embed as embed_mod
from mmalign.errors import UsageError
from mmalign.search.embed import embed
from mmalign.search.embed_inputs import Units
from tests.harness import ROOT, cli_main
from tests.harness.searchdata import save_random_model
from tests.harness.shard_server import serve

FIXED = ["key", "caption", "caption_index", "json", "source_path", "file", "offset"]


def write_shard(path: Path, samples: list[tuple[str, np.ndarray, str, dict | None]]) -> None:
    """``path``: a tar of ``KEY.jpg``, ``KEY.txt`` and (unless None) ``KEY.json`` per sample."""
    with tarfile.open(path, "w") as tar:
        for key, pixels, caption, meta in samples:
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
            members = {"jpg": buf.getvalue(), "txt": caption.encode()}
            if meta is not None:
                members["json"] = json.dumps(meta).encode()
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_random_model(tmp_path_factory.mktemp("embed_model") / "model", seed=5)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """5 shards of 3, 1, 4, 2, 3 samples (two captions each in shard 2), with a few .json fields."""
    root = tmp_path_factory.mktemp("embed_shards")
    rng = np.random.default_rng(0)
    for s, count in enumerate((3, 1, 4, 2, 3)):
        samples = []
        for i in range(count):
            key = f"{s:02d}{i:03d}"
            caption = f"thing {s} {i}" + (f"\nanother thing {s} {i}" if s == 2 else "")
            meta = {"url": f"http://example.test/{key}.jpg", "width": 16 + i, "status": "success"}
            samples.append((key, rng.integers(0, 256, (16 + i, 20, 3), dtype=np.uint8), caption, meta))
        write_shard(root / f"{s:05d}.tar", samples)
    return root


def _read(out: Path) -> tuple[np.ndarray, np.ndarray, pd.DataFrame, dict]:
    info = json.loads((out / "embed.json").read_text())
    n = info["parts"]
    img = np.concatenate([np.load(out / "img_emb" / f"img_emb_{i}.npy") for i in range(n)])
    txt = np.concatenate([np.load(out / "text_emb" / f"text_emb_{i}.npy") for i in range(n)])
    meta = pd.concat([pd.read_parquet(out / "metadata" / f"metadata_{i}.parquet") for i in range(n)])
    return img, txt, meta.reset_index(drop=True), info


def _assert_same(a: Path, b: Path) -> None:
    img_a, txt_a, meta_a, info_a = _read(a)
    img_b, txt_b, meta_b, info_b = _read(b)
    assert info_a == info_b
    assert np.array_equal(img_a, img_b) and np.array_equal(txt_a, txt_b)
    pd.testing.assert_frame_equal(meta_a, meta_b)
    for i in range(info_a["parts"]):  # part by part too: the same files, numbered the same
        name = f"metadata/metadata_{i}.parquet"
        pd.testing.assert_frame_equal(pd.read_parquet(a / name), pd.read_parquet(b / name))


@pytest.fixture(scope="module")
def one_process(model, shards, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "emb"
    embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=1)
    return out


# ------------------------------------------------------------------ columns


def test_every_json_field_is_a_column_with_its_type(model, tmp_path):
    rng = np.random.default_rng(1)
    metas = [
        {
            "url": "http://a.test/0.jpg",
            "key": "not-the-key",  # a fixed name: the fixed column wins
            "caption": "json caption",
            "offset": "x",
            "status": "success",
            "error_message": None,
            "width": 12,
            "ratio": 1,  # int here, float below: float64
            "nsfw": False,
            "exif": {"b": [1, 2], "a": "x"},
            "tags": ["a", "b"],
            "mixed": 1,  # int here, str below: JSON text
            "big": 2**70,  # past int64: JSON text
        },
        {
            "url": "http://a.test/1.jpg",
            "status": "failed_to_resize",
            "error_message": "too small",
            "width": 14,
            "ratio": 0.5,
            "nsfw": True,
            "exif": {},
            "mixed": "1",
            "only_here": "y",
        },
        None,  # no .json: every extra column is null
    ]
    shard = tmp_path / "00000.tar"
    write_shard(
        shard,
        [
            (f"k{i}", rng.integers(0, 256, (12, 12, 3), dtype=np.uint8), f"cap {i}", m)
            for i, m in enumerate(metas)
        ],
    )
    out = tmp_path / "emb"
    embed(model, shard, out, batch_size=2, progress=False, rank=0, world=1)
    meta = pd.read_parquet(out / "metadata" / "metadata_0.parquet")
    extra = [
        "url",
        "status",
        "error_message",
        "width",
        "ratio",
        "nsfw",
        "exif",
        "tags",
        "mixed",
        "big",
        "only_here",
    ]
    assert list(meta.columns) == FIXED + extra
    expected = {
        "key": ["k0", "k1", "k2"],
        "caption": ["cap 0", "cap 1", "cap 2"],
        "url": ["http://a.test/0.jpg", "http://a.test/1.jpg", None],
        "status": ["success", "failed_to_resize", None],
        "error_message": [None, "too small", None],
        "width": [12, 14, None],
        "ratio": [1.0, 0.5, None],
        "nsfw": [False, True, None],
        "exif": ['{"a": "x", "b": [1, 2]}', "{}", None],
        "tags": ['["a", "b"]', None, None],
        "mixed": ["1", '"1"', None],
        "big": [str(2**70), None, None],
        "only_here": [None, "y", None],
    }
    for name, values in expected.items():
        got = [None if v is None or (isinstance(v, float) and np.isnan(v)) else v for v in meta[name]]
        assert got == values, name
    import pyarrow.parquet as pq

    schema = pq.read_schema(out / "metadata" / "metadata_0.parquet")
    types = {name: str(schema.field(name).type) for name in extra}
    assert types == {
        "url": "string",
        "status": "string",
        "error_message": "string",
        "width": "int64",
        "ratio": "double",
        "nsfw": "bool",
        "exif": "string",
        "tags": "string",
        "mixed": "string",
        "big": "string",
        "only_here": "string",
    }
    assert str(schema.field("offset").type) == "int64" and list(meta["offset"])[0] == 0
    assert json.loads(meta["json"][0]) == metas[0] and meta["json"][2] == "{}"


def test_parts_may_carry_different_columns(model, tmp_path):
    rng = np.random.default_rng(2)
    pixels = [rng.integers(0, 256, (12, 12, 3), dtype=np.uint8) for _ in range(2)]
    write_shard(tmp_path / "00000.tar", [("a", pixels[0], "x", {"url": "u0", "width": 3})])
    write_shard(tmp_path / "00001.tar", [("b", pixels[1], "y", {"sha256": "00ff"})])
    out = tmp_path / "emb"
    info = embed(model, tmp_path, out, progress=False, rank=0, world=1)
    assert info["parts"] == 2
    assert list(pd.read_parquet(out / "metadata/metadata_0.parquet").columns) == FIXED + ["url", "width"]
    assert list(pd.read_parquet(out / "metadata/metadata_1.parquet").columns) == FIXED + ["sha256"]


# ------------------------------------------------------------ ranks, resume


def _ranks(model, shards, out: Path, world: int, order) -> dict:
    """What torchrun / SLURM ranks do, in this process: rank 0 in a thread (it stamps --out,
    embeds its shards, waits for every other and finishes the directory), the others after it,
    one by one in ``order``; returns rank 0's embed.json."""
    import threading

    result: dict = {}

    def rank0():
        try:
            result["info"] = embed(
                model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=world
            )
        except BaseException as e:  # noqa: BLE001 (re-raised below, in the test's thread)
            result["error"] = e

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    for rank in order:
        assert (
            embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=rank, world=world)
            is None
        )
    thread.join(timeout=120)
    assert not thread.is_alive(), "rank 0 did not finish"
    if "error" in result:
        raise result["error"]
    return result["info"]


def test_ranks_split_the_shards_and_give_the_output_of_one(model, shards, one_process, tmp_path):
    out = tmp_path / "emb"
    info = _ranks(model, shards, out, 2, [1])
    assert info["units"] == 5 and info["images"] == 13 and info["rows"] == 17
    assert not (out / "embed_work").exists()
    _assert_same(out, one_process)


def test_more_ranks_than_shards_leave_some_idle(model, shards, one_process, tmp_path):
    out = tmp_path / "emb"
    _ranks(model, shards, out, 8, [7, 6, 5, 4, 3, 2, 1])
    _assert_same(out, one_process)


def test_a_rank_embeds_only_its_shards(model, shards, one_process, tmp_path, monkeypatch):
    """Rank 1 of 2 alone (rank 0 stamped --out and stopped): shards 1 and 3, and no finish; a
    one-process rerun then embeds only the rest."""
    out = tmp_path / "emb"
    real = embed_mod._embed_units

    def rank0_stops(source, units, todo, *args):
        if args[-2] == 0:  # rank
            raise KeyboardInterrupt
        return real(source, units, todo, *args)

    monkeypatch.setattr(embed_mod, "_embed_units", rank0_stops)
    with pytest.raises(KeyboardInterrupt):
        embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=2)
    assert embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=1, world=2) is None
    assert sorted(p.parent.name for p in (out / "embed_work").glob("*/done.json")) == ["000001", "000003"]
    assert not (out / "embed.json").exists()
    monkeypatch.setattr(embed_mod, "_embed_units", real)
    read: list[int] = []
    original = Units.samples
    monkeypatch.setattr(Units, "samples", lambda self, u: read.append(u) or original(self, u))
    embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=1)
    assert read == [0, 2, 4]
    _assert_same(out, one_process)


def test_one_process_matches_rows_and_parts(one_process, shards):
    """Row order is the shards' order; a part never spans two shards (parts of at most 3 rows)."""
    img, txt, meta, info = _read(one_process)
    keys = [f"{s:02d}{i:03d}" for s, count in enumerate((3, 1, 4, 2, 3)) for i in range(count)]
    expected = [k for k in keys for _ in range(2 if k.startswith("02") else 1)]
    assert list(meta["key"]) == expected and img.shape == txt.shape == (17, 32)
    sizes = [len(np.load(one_process / "img_emb" / f"img_emb_{i}.npy")) for i in range(info["parts"])]
    assert sizes == [3, 1, 3, 3, 2, 2, 3]  # shard 2 has 8 rows: 3 + 3 + 2
    assert list(meta["url"]) == [f"http://example.test/{k}.jpg" for k in expected]
    assert list(meta["file"].map(lambda f: Path(f).name)) == [f"0000{k[1]}.tar" for k in expected]


def test_interrupted_run_resumes_without_embedding_finished_shards_again(
    model, shards, one_process, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "emb"
    original = Units.samples
    read: list[int] = []

    def interrupted(self, u):  # shards 0 and 1 finish; shard 2 stops after three samples
        read.append(u)
        for i, sample in enumerate(original(self, u)):
            if u == 2 and i == 3:
                raise KeyboardInterrupt
            yield sample

    monkeypatch.setattr(Units, "samples", interrupted)
    with pytest.raises(KeyboardInterrupt):
        embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=1)
    assert read == [0, 1, 2] and not (out / "embed.json").exists()
    assert (out / "embed_work/000002/img_emb_0.npy").exists()  # a part of the unfinished shard

    def counted(self, u):
        read.append(u)
        return original(self, u)

    read.clear()
    monkeypatch.setattr(Units, "samples", counted)
    capsys.readouterr()
    with pytest.raises(UsageError, match="partial embed with another part-size"):
        embed(model, shards, out, batch_size=2, part_size=4, progress=False, rank=0, world=1)
    embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=1)
    assert read == [2, 3, 4]  # the finished shards were not read again
    assert capsys.readouterr().out.count("2 of 5 shard(s) already embedded") == 1
    _assert_same(out, one_process)
    with pytest.raises(UsageError, match="already holds embeddings"):  # a finished directory
        embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=1)


def test_a_kill_while_finishing_completes_on_the_rerun(model, shards, one_process, tmp_path, monkeypatch):
    out = tmp_path / "emb"
    real_replace, moves = os.replace, []

    def dies_after_four(src, dst):
        if "embed_work" in str(src) and Path(dst).parent.name in ("img_emb", "text_emb", "metadata"):
            moves.append(dst)
            if len(moves) > 4:
                raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(embed_mod.os, "replace", dies_after_four)
    with pytest.raises(KeyboardInterrupt):
        embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=1)
    monkeypatch.setattr(embed_mod.os, "replace", real_replace)
    read: list[int] = []
    original = Units.samples
    monkeypatch.setattr(Units, "samples", lambda self, u: read.append(u) or original(self, u))
    embed(model, shards, out, batch_size=2, part_size=3, progress=False, rank=0, world=1)
    assert read == []
    _assert_same(out, one_process)


# --------------------------------------------------------------------- CLI


def test_bad_nproc_is_one_line(model, shards, tmp_path):
    run = cli_main("embed", "--model", model, "--data", shards, "--out", tmp_path / "e", "--nproc", "0")
    assert (
        run.returncode == 2 and run.stderr.strip().count("\n") == 0 and "--nproc must be >= 1" in run.stderr
    )
    assert not (tmp_path / "e").exists()


def test_finished_out_is_refused_before_launching(model, shards, one_process):
    run = cli_main("embed", "--model", model, "--data", shards, "--out", one_process, "--nproc", "2")
    assert run.returncode == 2 and "already holds embeddings" in run.stderr
    assert run.stderr.strip().count("\n") == 0


def test_nproc_relaunches_the_command_it_was_given(model, shards, tmp_path, monkeypatch):
    import mmalign.dist.launch as launch

    seen = []
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv: seen.append((nproc, list(argv))) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = ["embed", "--model", model, "--data", str(shards), "--out", str(tmp_path / "e"), "--nproc", "2"]
    run = cli_main(*args)
    assert run.returncode == 0, run.stderr
    assert seen == [(2, args)]


@pytest.mark.slow
@pytest.mark.integration
def test_two_processes_give_the_output_of_one(model, shards, tmp_path):
    """``--nproc 2`` for real (torchrun, two ranks), against this process's one-process run; both
    on one thread so that the float sums are the same. Slow (~20 s): the in-process ranks above and
    the relaunch test cover the same property cheaply."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        embed(model, shards, tmp_path / "one", batch_size=2, part_size=3, progress=False, rank=0, world=1)
    finally:
        torch.set_num_threads(threads)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    env.pop("RANK", None)
    cmd = [sys.executable, "-m", "mmalign.cli", "embed", "--model", model, "--data", str(shards)]
    cmd += ["--out", str(tmp_path / "two"), "--batch-size", "2", "--part-size", "3", "--nproc", "2"]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "13 images, 17 rows" in run.stdout
    _assert_same(tmp_path / "two", tmp_path / "one")


def _one_thread_embed(*args, **kwargs):
    """An in-process embed on one torch thread: bitwise what a subprocess with OMP_NUM_THREADS=1 computes."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return embed(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.slow
@pytest.mark.integration
def test_kill_9_between_shards_then_rerun_resumes(model, shards, tmp_path):
    """``mmalign embed`` killed with SIGKILL after shard 0 (the shard server holds shard 1 and later
    until the kill), run again: shard 0 is not embedded again (its files are the ones written
    before the kill) and the result is a straight run's. Slow (~15 s): the in-process interruption
    test above covers the same property cheaply."""
    with serve(shards) as served:
        spec = f"{served.url}/{{00000..00004}}.tar"
        _one_thread_embed(
            model, spec, tmp_path / "straight", batch_size=2, part_size=3, progress=False, rank=0, world=1
        )
        out = tmp_path / "emb"
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        for key in ("RANK", "WORLD_SIZE"):
            env.pop(key, None)
        cmd = [
            sys.executable,
            "-m",
            "mmalign.cli",
            "embed",
            "--model",
            model,
            "--data",
            spec,
            "--out",
            str(out),
        ]
        cmd += ["--batch-size", "2", "--part-size", "3"]
        with served.lock:
            served.requests.clear()
            served.held = {f"{u:05d}.tar" for u in range(1, 5)}
        served.gate.clear()  # shard 1 and later wait (after their start-up probe)
        try:
            with open(tmp_path / "log", "w") as log:
                proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            first = out / "embed_work" / "000000" / "done.json"
            deadline = time.monotonic() + 120
            while not first.exists() and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert first.exists(), (proc.poll(), (tmp_path / "log").read_text())
            os.kill(proc.pid, signal.SIGKILL)
            assert proc.wait(timeout=60) == -signal.SIGKILL
        finally:
            served.gate.set()
            served.held = set()
        assert (
            not (out / "embed_work" / "000001" / "done.json").exists() and not (out / "embed.json").exists()
        )
        before = {p.name: p.stat().st_mtime_ns for p in (out / "embed_work" / "000000").glob("*_0.*")}
        assert len(before) == 3
        resumed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stdout and "1 of 5 shard(s) already embedded" in resumed.stdout
    after = {
        name: (out / name.rsplit("_", 1)[0] / name).stat().st_mtime_ns for name in before
    }  # shard 0's part is part 0
    assert after == before  # moved into place, not written again
    _assert_same(out, tmp_path / "straight")
