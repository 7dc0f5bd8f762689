"""``mmalign embed --teacher-shards``: a copy of the shards with a teacher's embeddings per sample.

References: the model's own ``encode_image`` / ``encode_text`` on the samples decoded from the
input shards one at a time with PIL and the model's preprocess (not the writer's batching), and
the input tars read with Python's ``tarfile`` (every original member byte for byte, in order).
"""

from __future__ import annotations

import io
import json
import tarfile
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from mmalign.errors import UsageError
from mmalign.search.embed_teacher import MEMBERS, embed_teacher
from tests.harness import cli_main
from tests.harness.searchdata import save_random_model


def _jpeg(pixels: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def _write(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size, info.mtime = len(data), 1_700_000_000
                tar.addfile(info, io.BytesIO(data))


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_random_model(tmp_path_factory.mktemp("teacher_model") / "model", seed=11, embed_dim=24)


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """3 shards of 3, 1, 4 samples: one sample with two captions, one with a broken image (copied
    without embeddings), one with an extra ``.cls`` member and a ``.json``."""
    root = tmp_path_factory.mktemp("teacher_in")
    rng = np.random.default_rng(3)
    for s, count in enumerate((3, 1, 4)):
        samples = []
        for i in range(count):
            key = f"{s:02d}{i:03d}"
            members = {
                "jpg": _jpeg(rng.integers(0, 256, (18 + i, 20, 3), dtype=np.uint8)),
                "txt": f"a thing {s} {i}".encode(),
            }
            if (s, i) == (0, 1):
                members["txt"] = b"first caption\nsecond caption"
            if (s, i) == (2, 2):
                members["jpg"] = b"not a jpeg"
            if (s, i) == (2, 0):
                members["cls"] = b"7"
                members["json"] = json.dumps({"label": 7}).encode()
            samples.append((key, members))
        _write(root / f"{s:05d}.tar", samples)
    return root


def _members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]


def _reference(model_dir: str, shard: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """key -> (image (D,), text (C, D)) from the model's own encoders, one sample at a time."""
    from mmalign.models.load import load

    loaded = load(model_dir)
    out = {}
    groups: dict[str, dict[str, bytes]] = {}
    for name, data in _members(shard):
        key, ext = name.split(".", 1)
        groups.setdefault(key, {})[ext] = data
    with torch.no_grad():
        for key, members in groups.items():
            try:
                image = Image.open(io.BytesIO(members["jpg"]))
                image.load()
            except Exception:
                continue
            img = loaded.model.encode_image(loaded.preprocess(image)[None])[0]
            captions = members["txt"].decode().splitlines()
            txt = loaded.model.encode_text(loaded.tokenizer(captions))
            out[key] = (img.numpy(), txt.numpy())
    return out


def test_stored_vectors_equal_the_model_s_encodings_and_members_are_kept(model, shards, tmp_path):
    out = tmp_path / "teacher"
    info = embed_teacher(model, shards, out, batch_size=2, progress=False, rank=0, world=1)
    from mmalign.models.load import load

    scale = float(load(model).model.logit_scale.detach().exp())
    assert info["count"] == 7 and info["samples"] == 8 and info["skipped"] == 1 and info["shards"] == 3
    assert info["embed_dim"] == 24 and info["logit_scale"] == pytest.approx(scale)
    assert json.loads((out / "sizes.json").read_text()) == {"00000.tar": 3, "00001.tar": 1, "00002.tar": 4}
    assert sorted(p.name for p in out.iterdir()) == [
        "00000.tar",
        "00001.tar",
        "00002.tar",
        "sizes.json",
        "teacher.json",
    ]
    for shard in sorted(shards.glob("*.tar")):
        original, copy = _members(shard), _members(out / shard.name)
        assert [
            m for m in copy if m[0].split(".", 1)[1] not in MEMBERS
        ] == original  # byte for byte, in order
        ref = _reference(model, shard)
        stored = {}
        for name, data in copy:
            key, ext = name.split(".", 1)
            if ext in MEMBERS:
                stored.setdefault(key, {})[ext] = np.load(io.BytesIO(data))
        assert set(stored) == set(ref)  # the broken image has no teacher members
        for key, (img, txt) in ref.items():
            got = stored[key]
            assert got["teacher_image.npy"].dtype == np.float32 and got["teacher_image.npy"].shape == (24,)
            np.testing.assert_allclose(got["teacher_image.npy"], img, rtol=1e-5, atol=1e-6)
            want_txt = txt[0] if len(txt) == 1 else txt  # (D,), or (C, D) for C captions
            assert got["teacher_text.npy"].shape == want_txt.shape
            np.testing.assert_allclose(got["teacher_text.npy"], want_txt, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.linalg.norm(got["teacher_image.npy"]), 1.0, rtol=1e-5)
            assert got["teacher_scale.npy"].shape == (1,) and got["teacher_scale.npy"].dtype == np.float32
            assert float(got["teacher_scale.npy"][0]) == pytest.approx(scale, rel=1e-6)
        if shard.name == "00000.tar":
            assert stored["00001"]["teacher_text.npy"].shape == (2, 24)
    # the copy reads back through the loader's own reader, the teacher members as sample members
    from mmalign.data.shards import iter_tar_groups

    groups = list(iter_tar_groups(str(out / "00002.tar")))
    assert [g["__key__"] for g in groups] == ["02000", "02001", "02002", "02003"]
    assert set(MEMBERS) <= set(groups[0]) and "cls" in groups[0] and "teacher_image.npy" not in groups[2]


def _ranks(model, data, out, world: int) -> None:
    """``world`` ranks of one run, as threads (rank 0 waits for the others' shards)."""
    errors = []

    def rank(r):
        try:
            embed_teacher(model, data, out, progress=False, rank=r, world=world, stall_timeout_s=60)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(1, world)]
    for t in threads:
        t.start()
    rank(0)
    for t in threads:
        t.join()
    assert not errors, errors


def test_two_ranks_and_a_copy_of_a_copy_equal_one_process(model, shards, tmp_path):
    one = tmp_path / "one"
    embed_teacher(model, shards, one, progress=False, rank=0, world=1)
    two = tmp_path / "two"
    _ranks(model, shards, two, world=2)
    again = tmp_path / "again"
    embed_teacher(model, one, again, progress=False, rank=0, world=1)  # teacher members replaced
    for name in ("00000.tar", "00001.tar", "00002.tar"):
        assert (two / name).read_bytes() == (one / name).read_bytes()
        assert _members(again / name) == _members(one / name)
    assert (two / "sizes.json").read_text() == (one / "sizes.json").read_text()


def test_resume_skips_finished_shards_and_a_changed_model_is_one_line(model, shards, tmp_path, monkeypatch):
    import mmalign.search.embed_teacher as mod

    straight = tmp_path / "straight"
    embed_teacher(model, shards, straight, progress=False, rank=0, world=1)
    real = mod._copy_shard

    def killed(source, url, *args):
        if url.endswith("00002.tar"):
            raise KeyboardInterrupt  # a kill while the third shard is written
        return real(source, url, *args)

    out = tmp_path / "out"
    monkeypatch.setattr(mod, "_copy_shard", killed)
    with pytest.raises(KeyboardInterrupt):
        embed_teacher(model, shards, out, progress=False, rank=0, world=1)
    monkeypatch.setattr(mod, "_copy_shard", real)
    before = (out / "00001.tar").stat().st_mtime_ns
    other = save_random_model(tmp_path / "other", seed=12, embed_dim=24)
    with pytest.raises(UsageError, match="partial copy made with another model"):
        embed_teacher(other, shards, out, progress=False, rank=0, world=1)
    embed_teacher(model, shards, out, progress=False, rank=0, world=1)
    assert (out / "00001.tar").stat().st_mtime_ns == before  # not written again
    for name in ("00000.tar", "00001.tar", "00002.tar", "sizes.json"):
        assert (out / name).read_bytes() == (straight / name).read_bytes()
    with pytest.raises(UsageError, match="already holds teacher shards"):
        embed_teacher(model, shards, out, progress=False, rank=0, world=1)


def test_bad_input_is_one_line(model, shards, tmp_path):
    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "a.png")
    with pytest.raises(UsageError, match="image folder; give tar shards"):
        embed_teacher(model, folder, tmp_path / "x", progress=False, rank=0, world=1)
    with pytest.raises(UsageError, match="holds the input shards"):
        embed_teacher(model, shards, shards, progress=False, rank=0, world=1)
    run = cli_main("embed", "--model", model, "--data", shards, "--out", "a", "--teacher-shards", "b")
    assert run.returncode == 2 and "not both" in run.stderr and len(run.stderr.strip().splitlines()) == 1
    run = cli_main("embed", "--model", model, "--data", shards)
    assert run.returncode == 2 and "--out is required" in run.stderr


def test_the_command_writes_the_copy(model, shards, tmp_path):
    out = tmp_path / "cli"
    run = cli_main("embed", "--model", model, "--data", shards, "--teacher-shards", out)
    assert run.returncode == 0, run.stderr
    assert "7 of 8 samples with teacher embeddings (dim 24" in run.stdout
    assert (out / "teacher.json").is_file() and not (out / "teacher_work").exists()


def test_nproc_relaunches_the_command_it_was_given(model, shards, tmp_path, monkeypatch):
    import mmalign.dist.launch as launch

    seen = []
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv: seen.append((nproc, list(argv))) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    args = [
        "embed",
        "--model",
        model,
        "--data",
        str(shards),
        "--teacher-shards",
        str(tmp_path / "t"),
        "--nproc",
        "2",
    ]
    run = cli_main(*args)
    assert run.returncode == 0, run.stderr
    assert seen == [(2, args)]
    run = cli_main(*args[:-1], "0")
    assert run.returncode == 2 and "--nproc must be >= 1" in run.stderr


def test_a_directory_entry_inside_a_sample_keeps_the_sample_whole(model, tmp_path):
    """Entries that are no sample part (a directory, a name without a dot) stay where they were and
    do not split the sample around them (the loader's reader skips them too)."""
    rng = np.random.default_rng(5)
    src = tmp_path / "in"
    src.mkdir()
    with tarfile.open(src / "00000.tar", "w") as tar:
        for name, data in (
            ("d", None),
            ("d/a.jpg", _jpeg(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8))),
            ("d/sub", None),
            ("d/a.txt", b"a caption"),
            ("README", b"no dot: not a sample part"),
        ):
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    info = embed_teacher(model, src, tmp_path / "out", progress=False, rank=0, world=1)
    assert (info["samples"], info["count"], info["skipped"]) == (1, 1, 0)
    with tarfile.open(tmp_path / "out" / "00000.tar") as tar:
        names = [m.name for m in tar]
    assert names == ["d", "d/a.jpg", "d/sub", "d/a.txt", "README", *(f"d/a.{m}" for m in MEMBERS)]
