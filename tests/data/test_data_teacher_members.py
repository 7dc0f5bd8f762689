"""mmalign.data.teacher_members and the loader's stored-teacher fields: each sample's
teacher_image.npy / teacher_text.npy / teacher_scale.npy reach the Batch as written, in the
rows of their samples; a data set without them is one line at start-up (also from `mmalign
train`, exit 2); a later sample missing or spoiling one is a counted skip."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from mmalign.config import ConfigError, DataConfig
from mmalign.data.loader import build_train_loader
from mmalign.data.shards import REASONS
from mmalign.data.teacher_members import check_teacher_members
from tests.harness import cli_main

D = 6


def _npy(array) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    return buf.getvalue()


def _png(rng) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (12, 12, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _shard(path, n: int, spoil: dict[int, tuple[str, bytes | None]] | None = None, seed: int = 0) -> dict:
    """n samples with teacher members (vectors keyed by sample); ``spoil``: index -> (member,
    replacement bytes or None to leave it out)."""
    rng = np.random.default_rng(seed)
    written = {}
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            key = f"k{i:03d}"
            image, text = rng.standard_normal(D), rng.standard_normal(D)
            image, text = image / np.linalg.norm(image), text / np.linalg.norm(text)
            members = {
                "png": _png(rng),
                "txt": f"caption {i}".encode(),
                "teacher_image.npy": _npy(image.astype(np.float32)),
                "teacher_text.npy": _npy(text.astype(np.float32)),
                "teacher_scale.npy": _npy(np.array([42.5], dtype=np.float32)),
            }
            if spoil and i in spoil:
                name, data = spoil[i]
                if data is None:
                    members.pop(name)
                else:
                    members[name] = data
            written[key] = (image, text)
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return written


def _loader(path, batch: int = 4, teacher: bool = True):
    return build_train_loader(
        DataConfig(train=[str(path)], workers=0, shuffle_buffer=2),
        _identity_transform,
        _tokenize,
        batch,
        seed=0,
        teacher=teacher,
    )


def _identity_transform(image):
    return torch.zeros(3, 4, 4, dtype=torch.uint8)  # the pixels do not matter here


def _tokenize(captions):
    return torch.zeros(len(captions), 3, dtype=torch.long)


def test_the_members_reach_the_batch_in_their_samples_rows(tmp_path):
    written = _shard(tmp_path / "a.tar", 8)
    batch = next(iter(_loader(tmp_path / "a.tar", 8)))
    assert batch.teacher_image.shape == (8, D) and batch.teacher_text.shape == (8, D)
    assert batch.teacher_scale.shape == (8, 1) and (batch.teacher_scale == 42.5).all()
    for row, key in enumerate(batch.keys):
        image, text = written[key]
        np.testing.assert_array_equal(batch.teacher_image[row].numpy(), image.astype(np.float32))
        np.testing.assert_array_equal(batch.teacher_text[row].numpy(), text.astype(np.float32))
    # the Batch's cuts keep the rows together (gradient-cache chunks)
    assert (batch.slice(2, 5).teacher_image == batch.teacher_image[2:5]).all()
    # without a stored teacher the members are not read
    assert next(iter(_loader(tmp_path / "a.tar", 8, teacher=False))).teacher_image is None


@pytest.mark.parametrize(
    "spoil, reason",
    [
        ((3, ("teacher_text.npy", None)), "missing_teacher"),
        ((3, ("teacher_scale.npy", _npy(np.zeros((1, 2), np.float32)))), "bad_teacher"),
        ((3, ("teacher_image.npy", _npy(np.zeros(D + 1, np.float32)))), "bad_teacher"),  # another width
        ((3, ("teacher_image.npy", b"not an npy file")), "bad_teacher"),
        ((3, ("teacher_image.npy", _npy(np.array([np.nan] * D, np.float32)))), "bad_teacher"),
    ],
)
def test_a_later_sample_without_good_members_is_a_counted_skip(tmp_path, spoil, reason):
    assert reason in REASONS
    _shard(tmp_path / "a.tar", 9, spoil=dict([spoil]))
    batch = next(iter(_loader(tmp_path / "a.tar", 8)))
    assert "k003" not in batch.keys and batch.skipped.get(reason) == 1


def test_shards_without_the_members_are_one_line_at_start_up(tmp_path):
    _shard(tmp_path / "a.tar", 4, spoil={0: ("teacher_image.npy", None)})
    with pytest.raises(ConfigError) as err:
        _loader(tmp_path / "a.tar")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config key 'loss.distill.teacher'")
    assert "teacher_image.npy" in msg and "mmalign embed" in msg
    _shard(tmp_path / "b.tar", 4)
    assert check_teacher_members([str(tmp_path / "b.tar")], "loss.distill.teacher") == D


def test_mmalign_train_on_shards_without_them_exits_2_with_one_line(tmp_path, shapes_dir):
    run = cli_main(
        "train",
        "--set",
        "model.preset=micro",
        "--set",
        f"data.train={shapes_dir}/train/00000.tar",
        "--set",
        "data.workers=0",
        "--set",
        "train.steps=1",
        "--set",
        "train.warmup_steps=0",
        "--set",
        "train.global_batch_size=8",
        "--set",
        "eval.suite=none",
        "--set",
        "loss.distill.teacher=stored",
        "--set",
        f"output={tmp_path / 'run'}",
    )
    assert run.returncode == 2, run
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "loss.distill.teacher" in lines[0] and "teacher_image.npy" in lines[0], (
        run.stderr
    )


def _multi_caption_shard(path, n: int, spoil: int | None = None) -> dict:
    """n samples with 3 captions each and one teacher text row per caption (sample ``spoil``: 2 rows)."""
    rng = np.random.default_rng(1)
    texts = {}
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            key = f"m{i:03d}"
            captions = [f"sample {i} caption {c}" for c in range(3)]
            text = rng.standard_normal((2 if i == spoil else 3, D)).astype(np.float32)
            texts[key] = dict(zip(captions, text))
            members = {
                "png": _png(rng),
                "txt": "\n".join(captions).encode(),
                "teacher_image.npy": _npy(rng.standard_normal(D).astype(np.float32)),
                "teacher_text.npy": _npy(text),
                "teacher_scale.npy": _npy(np.array([7.0], dtype=np.float32)),
            }
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return texts


def test_a_sample_with_several_captions_gets_the_text_row_of_the_drawn_caption(tmp_path):
    texts = _multi_caption_shard(tmp_path / "m.tar", 12)
    loader = iter(_loader(tmp_path / "m.tar", 12))
    drawn = set()
    for _ in range(3):  # three epochs: the drawn captions change, the rows follow them
        batch = next(loader)
        for row, (key, caption) in enumerate(zip(batch.keys, batch.captions)):
            np.testing.assert_array_equal(batch.teacher_text[row].numpy(), texts[key][caption])
            drawn.add(caption.rsplit(" ", 1)[-1])
    assert drawn == {"0", "1", "2"}  # not always the first caption's row


def test_a_row_count_that_is_not_the_caption_count_is_a_counted_skip(tmp_path):
    _multi_caption_shard(tmp_path / "m.tar", 9, spoil=3)
    batch = next(iter(_loader(tmp_path / "m.tar", 8)))
    assert "m003" not in batch.keys and batch.skipped.get("bad_teacher") == 1
