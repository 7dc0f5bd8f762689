"""A run directory is never silently reused, and a damaged newest checkpoint falls back.

- a fresh start in a directory that holds another run is refused (one line) unless
  --overwrite, which removes the earlier run's files and only those;
- every checkpoint stores its resolved config; a resume whose config changes the run is
  one line naming the keys, while a longer run or another eval/log schedule is allowed;
- pruning keeps the newest checkpoints relative to the one just written;
- a truncated engine file, a 0-byte trainer file, an empty engine/ or a planted pickle in
  the newest checkpoint: the resume says so in one line and loads the next older one;
- every file and directory is fsynced before ``latest`` flips; a torn last line of
  metrics.jsonl is dropped on resume.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmalign.config import ConfigError, load_config
from mmalign.run import checkpoint
from tests.harness import cli_main

pytestmark = pytest.mark.integration


def _cfg(overrides, out: Path, *extra: str):
    base = [o for o in overrides if not o.startswith("output=")]
    return load_config(
        None,
        base
        + [
            "train.steps=6",
            "train.checkpoint_every=2",
            "train.keep_checkpoints=3",
            "monitor.probe_size=0",
            f"output={out}",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def finished(tmp_path_factory, shapes_dir):
    """One 6-step run with checkpoints at 2, 4, 6 (copied by each test that damages it)."""
    from mmalign.run.train import train

    out = tmp_path_factory.mktemp("finished") / "run"
    overrides = [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=32",
        "train.warmup_steps=2",
        "train.lr=0.002",
        "train.log_every=1",
    ]
    train(_cfg(overrides, out), show_progress=False)
    return out, overrides


def _copy(finished, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(finished[0], out)
    return out


def test_fresh_start_in_a_used_directory_is_refused_then_overwritten(finished, tmp_path):
    from mmalign.run.train import train

    out, overrides = _copy(finished, tmp_path), finished[1]
    (out / "my_notes.txt").write_text("keep me")
    cfg = _cfg(overrides, out, "train.lr=0.004")
    with pytest.raises(ConfigError) as err:
        train(cfg, show_progress=False)
    msg = str(err.value)
    assert "\n" not in msg and "is not empty" in msg and "--overwrite" in msg and "--resume latest" in msg
    assert checkpoint.resolve(out, "latest").name == "step_00000006"  # nothing was touched
    old = load_file(str(out / "final" / "model.safetensors"))

    train(cfg, show_progress=False, overwrite=True)
    new = load_file(str(out / "final" / "model.safetensors"))
    assert not torch.equal(old["logit_scale"], new["logit_scale"])  # really the new run's weights
    assert (out / "my_notes.txt").read_text() == "keep me"
    assert load_config(out / "config.yaml").train.lr == 0.004


def test_cli_refuses_a_used_directory_in_one_line(finished, tmp_path):
    out = _copy(finished, tmp_path)
    sets = [a for o in finished[1] for a in ("--set", o)]
    proc = cli_main("train", *sets, "--set", f"output={out}")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmalign: error: config key 'output'"), lines


def test_checkpoints_store_their_config_and_a_changed_run_cannot_resume(finished, tmp_path):
    from mmalign.run import rundir
    from mmalign.run.train import train

    out, overrides = _copy(finished, tmp_path), finished[1]
    stored = rundir.stored_config(out / "checkpoints" / "step_00000004")
    assert stored["train"]["lr"] == 0.002 and stored["model"]["preset"] == "micro"
    assert (out / "checkpoints" / "step_00000004" / "config.yaml").read_text().startswith("# config hash ")
    for change, key in (
        ("train.lr=0.01", "train.lr"),
        ("train.global_batch_size=16", "train.global_batch_size"),
        ("loss.name=siglip", "loss.name"),
    ):
        with pytest.raises(ConfigError) as err:
            train(_cfg(overrides, out, change), show_progress=False, resume="latest")
        assert key in str(err.value) and "\n" not in str(err.value)
    # a longer run with another eval / log schedule continues the same run
    done = train(
        _cfg(overrides, out, "train.steps=8", "train.eval_every=4", "train.log_every=2"),
        show_progress=False,
        resume="latest",
    )
    steps = [json.loads(line)["step"] for line in (done / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 8]


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "truncated_engine_file": lambda step: _truncate(next((step / "engine").glob("*model_states.pt"))),
    "empty_trainer_file": lambda step: (step / "trainer_rank0.pt").write_bytes(b""),
    "empty_engine_dir": lambda step: [f.unlink() for f in (step / "engine").iterdir() if f.is_file()],
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_newest_checkpoint_falls_back_to_the_next(finished, tmp_path, capsys, kind):
    from mmalign.run.train import train

    out, overrides = _copy(finished, tmp_path), finished[1]
    shutil.rmtree(out / "final")
    DAMAGE[kind](out / "checkpoints" / "step_00000006")
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 7, "loss": 1.')  # a line torn by a kill mid-write
    train(_cfg(overrides, out), show_progress=False, resume="latest")
    said = capsys.readouterr().out
    lines = [ln for ln in said.splitlines() if "cannot be loaded" in ln]
    assert len(lines) == 1 and "step_00000006" in lines[0] and "falling back to step_00000004" in lines[0]
    assert "resumed from" in said and "at step 4" in said
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (out / "final" / "model.safetensors").is_file()


def test_planted_pickle_in_the_newest_checkpoint_never_runs_on_resume(finished, tmp_path, capsys):
    from mmalign.run.train import train
    from tests.models.test_models_load_untrusted import plant

    out, overrides = _copy(finished, tmp_path), finished[1]
    marker = tmp_path / "MARKER"
    plant(out / "checkpoints" / "step_00000006" / "engine" / "mp_rank_00_model_states.pt", marker)
    train(_cfg(overrides, out), show_progress=False, resume="latest")
    assert not marker.exists()
    assert "falling back to step_00000004" in capsys.readouterr().out


def test_no_loadable_checkpoint_is_one_line(finished, tmp_path):
    from mmalign.run.train import train

    out, overrides = _copy(finished, tmp_path), finished[1]
    for step in (out / "checkpoints").glob("step_*"):
        (step / "trainer_rank0.pt").write_bytes(b"")
    with pytest.raises(ConfigError, match="no loadable checkpoint"):
        train(_cfg(overrides, out), show_progress=False, resume="latest")


def test_pruning_keeps_the_newest_relative_to_the_one_written(tmp_path):
    base = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8, 10):
        (base / f"step_{step:08d}").mkdir(parents=True)
    # resumed from step 4 of a timeline that once reached 10: step 6 is written again
    checkpoint._prune(base, base / "step_00000006", keep=2)
    assert sorted(p.name for p in base.iterdir()) == ["step_00000004", "step_00000006"]


def test_files_and_directories_are_synced_before_latest_flips(finished, tmp_path, monkeypatch):
    from mmalign.run.train import train

    events = []
    real_fsync, real_replace = checkpoint._fsync, checkpoint.os.replace
    monkeypatch.setattr(
        checkpoint, "_fsync", lambda p: (events.append(("fsync", Path(p).name)), real_fsync(p))
    )
    monkeypatch.setattr(
        checkpoint.os,
        "replace",
        lambda a, b: (events.append(("replace", Path(a).name, Path(b).name)), real_replace(a, b)),
    )
    out = tmp_path / "run"
    train(_cfg(finished[1], out, "train.steps=2"), show_progress=False)
    names = [e[1] for e in events]
    flip = events.index(("replace", "latest.tmp", "latest"))
    assert "trainer_rank0.pt" in names[:flip] and "step_00000002.tmp" in names[:flip]
    assert ("fsync", "latest.tmp") in events[:flip]
    assert ("replace", "step_00000002.tmp", "step_00000002") in events[:flip]
    assert events[flip + 1] == ("fsync", "checkpoints")


def test_a_key_added_after_the_checkpoint_compares_as_its_default(tmp_path):
    """A checkpoint written before a config key existed ran with that key's default: it resumes
    under the default, and a non-default value of the new key is a change (unless resumable)."""
    import yaml

    from mmalign.config import load_config, to_dict
    from mmalign.run import rundir

    cfg = load_config(None, ["model.preset=micro"])
    tree = to_dict(cfg)
    del tree["train"]["trim_text_padding"], tree["train"]["attention_kernel"]  # keys of later releases
    ckpt = tmp_path / "step_00000004"
    ckpt.mkdir()
    (ckpt / rundir.CONFIG_FILE).write_text(yaml.safe_dump(tree))
    rundir.check_resume(cfg, ckpt, 4)  # defaults: the same run
    rundir.check_resume(load_config(None, ["model.preset=micro", "train.attention_kernel=math"]), ckpt, 4)
    with pytest.raises(ConfigError, match="train.trim_text_padding: True -> False"):
        rundir.check_resume(
            load_config(None, ["model.preset=micro", "train.trim_text_padding=false"]), ckpt, 4
        )
