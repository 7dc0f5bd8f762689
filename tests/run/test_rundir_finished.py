"""``--resume latest`` never replaces a run it cannot resume (issue 28, point 1).

With the default ``train.checkpoint_every: 0`` a finished run has ``final/`` and no
checkpoint; ``--resume latest`` used to start over from step 0 and rewrite ``final/``,
``eval.json``, ``metrics.jsonl`` and ``config.yaml``. Now:

- a finished run (``final/``) with no checkpoint is refused in one line, with its own config
  ("nothing to resume") and with another one (the differing keys named); ``--overwrite``
  retrains it;
- a ``config.yaml`` of another config with no checkpoint is refused the same way;
- the leftovers of the *same* run killed before its first save, an empty directory, and a
  run with checkpoints resume (or start) as before.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from mmalign.config import ConfigError, load_config, save_config
from mmalign.run import rundir
from tests.harness import cli_main


def _run_dir(tmp_path: Path, *, final: bool, config: list[str] | None) -> Path:
    """A run directory as a run leaves it: ``final/`` or not, its config.yaml written from ``config``."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    if final:
        (out / "final").mkdir()
        (out / "final" / "model.safetensors").write_bytes(b"weights")
    if config is not None:
        save_config(load_config(None, config + [f"output={out}"]), out / "config.yaml")
    return out


BASE = ["model.preset=micro", "train.lr=0.002"]


def test_a_finished_run_with_its_own_config_has_nothing_to_resume(tmp_path):
    out = _run_dir(tmp_path, final=True, config=BASE)
    with pytest.raises(ConfigError) as err:
        rundir.check_fresh_start(out, "latest", False, load_config(None, BASE + [f"output={out}"]))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config key 'output'")
    assert "finished run" in msg and "nothing to resume" in msg and "--overwrite" in msg
    assert "differs" not in msg


def test_a_finished_run_with_another_config_names_the_key(tmp_path):
    out = _run_dir(tmp_path, final=True, config=BASE)
    cfg = load_config(None, BASE + ["train.lr=5e-4", f"output={out}"])
    with pytest.raises(ConfigError, match=r"finished run .*train\.lr: 0\.002 -> 0\.0005") as err:
        rundir.check_fresh_start(out, "latest", False, cfg)
    assert "\n" not in str(err.value)


def test_a_finished_run_without_config_yaml_is_still_finished(tmp_path):
    out = _run_dir(tmp_path, final=True, config=None)
    with pytest.raises(ConfigError, match="finished run"):
        rundir.check_fresh_start(out, "latest", False, load_config(None, BASE + [f"output={out}"]))


def test_another_configs_run_without_a_checkpoint_names_the_key(tmp_path):
    out = _run_dir(tmp_path, final=False, config=BASE)
    cfg = load_config(None, BASE + ["train.global_batch_size=64", f"output={out}"])
    with pytest.raises(ConfigError, match=r"another config \(train\.global_batch_size: 128 -> 64\)"):
        rundir.check_fresh_start(out, "latest", False, cfg)


def test_an_unreadable_config_yaml_is_one_line(tmp_path):
    out = _run_dir(tmp_path, final=False, config=None)
    (out / "config.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="cannot be read") as err:
        rundir.check_fresh_start(out, "latest", False, load_config(None, BASE + [f"output={out}"]))
    assert "\n" not in str(err.value) and "--overwrite" in str(err.value)


def test_what_still_starts_or_resumes(tmp_path):
    # the same run killed before its first save (a requeued launch line with --resume latest);
    # another output path is a resumable change (a copied run directory)
    out = _run_dir(tmp_path, final=False, config=BASE + ["train.steps=50"])
    rundir.check_fresh_start(
        out, "latest", False, load_config(None, BASE + ["train.steps=80", f"output={out}"])
    )
    # a run with a checkpoint: checkpoint.resume and check_resume take it from there
    (tmp_path / "b").mkdir()
    finished = _run_dir(tmp_path / "b", final=True, config=BASE)
    (finished / "checkpoints").mkdir()
    (finished / "checkpoints" / "latest").write_text("step_00000004")
    rundir.check_fresh_start(finished, "latest", False, load_config(None, BASE + [f"output={finished}"]))
    # --overwrite, a directory without a run's files, no directory yet
    rundir.check_fresh_start(finished, "latest", True, load_config(None, BASE))
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("x")
    rundir.check_fresh_start(tmp_path / "notes", "latest", False, load_config(None, BASE))
    rundir.check_fresh_start(tmp_path / "absent", "latest", False, load_config(None, BASE))


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, shapes_dir):
    """A 2-step run with the default train.checkpoint_every: 0 (final/, no checkpoint)."""
    from mmalign.run.train import train

    sets = [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.lr=0.002",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        "eval.suite=none",
    ]
    out = tmp_path_factory.mktemp("finished") / "run"
    train(load_config(None, sets + [f"output={out}"]), show_progress=False)
    return out, sets


def _files(out: Path) -> dict:
    # the launch's lock file (mmalign.dirlock) is not run content: every launch opens it
    return {
        p.relative_to(out).as_posix(): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and p.name != ".mmalign.lock"
    }


@pytest.mark.integration
@pytest.mark.parametrize(
    "change, expect, nproc",
    [
        ([], "nothing to resume", 1),
        (["train.lr=5e-4"], "train.lr: 0.002 -> 0.0005", 1),
        (["train.lr=5e-4"], "train.lr: 0.002 -> 0.0005", 2),
    ],
)
def test_the_cli_refuses_to_replace_a_finished_run(
    finished_run, tmp_path, monkeypatch, change, expect, nproc
):
    """The issue's repro: the same command again with --resume latest (its own config, or a new lr);
    with --nproc 2 the refusal comes before any rank is spawned (one line, not one per rank)."""
    src, sets = finished_run
    out = tmp_path / "run"
    shutil.copytree(src, out)
    before = _files(out)
    args = [a for o in sets + change for a in ("--set", o)]
    import mmalign.dist.launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were spawned before the finished run was refused")

    monkeypatch.setattr(mmalign.dist.launch, "launch_local", no_ranks)
    proc = cli_main(
        "train", "--output", str(out), *args, "--resume", "latest", *(["--nproc", "2"] if nproc > 1 else [])
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert lines[-1].startswith("mmalign: error: config key 'output'") and expect in lines[-1], lines
    assert len([line for line in lines if line.startswith("mmalign: error")]) == 1, lines
    assert "finished run" in lines[-1] and "--overwrite" in lines[-1]
    assert _files(out) == before  # final/, config.yaml, metrics.jsonl, train.log: not a byte changed


@pytest.mark.integration
def test_overwrite_retrains_a_finished_run(finished_run, tmp_path):
    from mmalign.run.train import train

    src, sets = finished_run
    out = tmp_path / "run"
    shutil.copytree(src, out)
    cfg = load_config(None, sets + ["train.lr=5e-4", f"output={out}"])
    train(cfg, show_progress=False, resume="latest", overwrite=True)
    assert load_config(out / "config.yaml").train.lr == 5e-4
    assert (out / "final" / "model.safetensors").read_bytes() != (
        src / "final" / "model.safetensors"
    ).read_bytes()
