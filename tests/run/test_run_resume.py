"""A resume whose newest checkpoint lost its data position, or whose ``latest`` names nothing, falls
back to an intact checkpoint in one line; a ``--nproc 2`` resume with a changed key is one line
before any rank starts (issue 39, point 7).

Before: a loader_rank0.json holding ``[1, 2]`` was an AttributeError traceback, a missing one (or
``{"foo": 1}``) "loader state version None is not 3", an empty ``latest`` an error although every
checkpoint was intact, and the --nproc 2 resume a ChildFailedError report from torchrun.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mmalign.run import checkpoint, rundir
from tests.harness import cli_main


def _sets(shapes_dir) -> list[str]:
    return [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.checkpoint_every=2",
        "train.log_every=1",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        "eval.suite=none",
    ]


def _args(sets) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, shapes_dir):
    """A 4-step run with checkpoints at steps 2 and 4 and no final/ (as if killed after the save)."""
    out = tmp_path_factory.mktemp("resume") / "run"
    res = cli_main("train", "--output", out, *_args(_sets(shapes_dir)))
    assert res.returncode == 0, res.stderr[-2000:]
    shutil.rmtree(out / "final")
    (out / "eval.json").unlink(missing_ok=True)
    return out, _sets(shapes_dir)


def _copy(saved, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(saved[0], out)
    return out


NEWEST = "checkpoints/step_00000004"
DAMAGE = {  # what a kill, a full disk or a hand edit leaves; the older step_00000002 is intact
    "garbage_loader_json": (
        lambda out: (out / NEWEST / "loader_rank0.json").write_text("garbage{"),
        "loader_rank0.json is not valid JSON",
    ),
    "loader_json_a_list": (
        lambda out: (out / NEWEST / "loader_rank0.json").write_text("[1, 2]"),
        "loader_rank0.json is not a data loader state",
    ),
    "loader_json_another_object": (
        lambda out: (out / NEWEST / "loader_rank0.json").write_text('{"foo": 1}'),
        "loader_rank0.json is not a data loader state",
    ),
    "missing_loader_json": (
        lambda out: (out / NEWEST / "loader_rank0.json").unlink(),
        "no loader_rank0.json",
    ),
}


@pytest.mark.integration
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_newest_checkpoint_without_its_data_position_falls_back(saved, tmp_path, kind):
    out = _copy(saved, tmp_path)
    damage, reason = DAMAGE[kind]
    damage(out)
    res = cli_main("train", "--output", out, "--resume", "latest", *_args(saved[1]))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = [ln for ln in res.stdout.splitlines() if "cannot be loaded" in ln]
    assert lines == [
        f"mmalign: checkpoint step_00000004 cannot be loaded ({reason}); falling back to step_00000002"
    ], res.stdout[-2000:]
    assert "at step 2" in res.stdout and (out / "final" / "model.safetensors").is_file()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]  # steps 3 and 4 again, once each


@pytest.mark.integration
@pytest.mark.parametrize("pointer", [b"", b"\n", b"\xff\xfe"])
def test_an_empty_latest_tries_the_newest_checkpoint(saved, tmp_path, pointer):
    out = _copy(saved, tmp_path)
    (out / "checkpoints" / "latest").write_bytes(pointer)
    res = cli_main("train", "--output", out, "--resume", "latest", *_args(saved[1] + ["train.steps=5"]))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr[-3000:]
    said = [ln for ln in res.stdout.splitlines() if "names no checkpoint" in ln]
    assert len(said) == 1 and said[0].endswith("trying the newest, step_00000004"), res.stdout[-2000:]
    assert "at step 4" in res.stdout
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_candidates_of_an_empty_latest_are_every_checkpoint_newest_first(tmp_path):
    base = tmp_path / "checkpoints"
    for step in (2, 10, 4):
        (base / f"step_{step:08d}").mkdir(parents=True)
    (base / "step_00000012.tmp").mkdir()  # a save in progress: never a candidate
    (base / "latest").write_text("")
    assert [p.name for p in checkpoint.candidates(tmp_path, "latest")] == [
        "step_00000010",
        "step_00000004",
        "step_00000002",
    ]
    assert rundir.empty_pointer(tmp_path, "latest") and not rundir.empty_pointer(tmp_path, None)
    (base / "latest").write_text("step_00000004")
    assert [p.name for p in checkpoint.candidates(tmp_path, "latest")] == ["step_00000004", "step_00000002"]
    assert not rundir.empty_pointer(tmp_path, "latest")


def _fake_checkpoint(path: Path, world: int = 1) -> Path:
    (path / "engine").mkdir(parents=True)
    torch.save({"w": torch.zeros(2)}, path / "engine" / "mp_rank_00_model_states.pt")
    for r in range(world):
        torch.save({"step": 2}, path / f"trainer_rank{r}.pt")
        (path / f"loader_rank{r}.json").write_text(json.dumps({"version": 3}))
    return path


def test_damaged_names_a_missing_data_position_of_the_rank_that_reads_it(tmp_path):
    path = _fake_checkpoint(tmp_path / "step_00000002", world=2)
    assert checkpoint.damaged(path, 0) is None and checkpoint.damaged(path, 1) is None
    (path / "loader_rank1.json").unlink()
    assert checkpoint.damaged(path, 1) == "no loader_rank1.json"
    assert checkpoint.damaged(path, 0) is None  # rank 1's file: rank 1 says so, and every rank agrees
    # a rank beyond the saved world (a resume on more ranks) reads rank 0's files, resharded
    assert checkpoint.damaged(path, 3) is None


@pytest.mark.integration
def test_a_changed_key_on_an_nproc_2_resume_is_one_line_before_any_rank(saved, tmp_path, monkeypatch):
    out = _copy(saved, tmp_path)
    import mmalign.dist.launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were spawned before the changed key was refused")

    monkeypatch.setattr(mmalign.dist.launch, "launch_local", no_ranks)
    res = cli_main(
        "train", "--nproc", "2", "--output", out, "--resume", "latest", *_args(saved[1] + ["train.lr=0.01"])
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(
        "mmalign: error: --resume: the config differs from the one step_00000004 was "
        "trained with in keys that change the run: train.lr: 0.001 -> 0.01"
    ), lines
