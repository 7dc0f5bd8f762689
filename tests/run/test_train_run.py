"""The full training run: resume after kill -9, guarded steps, monitors, atomic checkpoints."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from mmalign.config import load_config
from mmalign.run import checkpoint
from tests.harness import ROOT, cli_main

pytestmark = pytest.mark.integration


def _keys(out):
    records = [json.loads(line) for line in (out / "samples_rank0.jsonl").read_text().splitlines()]
    return [(r["step"], tuple(r["keys"])) for r in records]


def _cmd(out, overrides, *extra):
    cmd = [sys.executable, "-m", "mmalign.cli", "train", "--output", str(out)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + list(extra)


@pytest.mark.slow  # make test: tests/data/test_data_remote.py, the same kill and resume (over HTTP, against local files)
def test_kill_and_resume_equals_straight_run(micro_overrides, tmp_path):
    ov = [o for o in micro_overrides if not o.startswith("output=")] + [
        "train.steps=20",
        "train.checkpoint_every=10",
        "monitor.log_sample_keys=true",
        "data.workers=1",
        "monitor.probe_size=16",
        "train.log_every=5",
    ]
    straight = tmp_path / "straight"
    res = subprocess.run(_cmd(straight, ov), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]

    killed = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(killed, ov), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    deadline = time.time() + 600
    pointer = killed / "checkpoints" / "latest"
    while not pointer.is_file() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)  # after the step-10 checkpoint, mid-run
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (killed / "final").exists()
    res = subprocess.run(
        _cmd(killed, ov, "--resume", "latest"), capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stdout and "step 10" in res.stdout

    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(killed / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    assert _keys(killed) == _keys(straight)
    assert len(_keys(straight)) == 20
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [5, 10, 15, 20]


def _poisoned(build_objective, poison):
    """``build_objective`` whose objective's losses pass through ``poison(out)`` (e.g. NaN on a call)."""

    def build(*args, **kwargs):
        objective = build_objective(*args, **kwargs)
        loss_for = objective.loss_for

        def poisoned_loss_for(batch, **kwargs):
            loss = loss_for(batch, **kwargs)
            return lambda emb: poison(loss(emb))

        objective.loss_for = poisoned_loss_for
        return objective

    return build


def _nan_after(calls_ok: int):
    """A build_objective whose losses turn NaN after ``calls_ok`` good calls."""
    from mmalign.objective import build_objective as real

    count = {"n": 0}

    def poison(out):
        count["n"] += 1
        if count["n"] > calls_ok:
            out.loss = out.loss * float("nan")
        return out

    return _poisoned(real, poison)


def test_nan_step_is_skipped_and_counted(micro_overrides, monkeypatch):
    import mmalign.run.train as train_mod

    calls = {"n": 0}

    def once_nan(out):
        calls["n"] += 1
        if calls["n"] == 3:  # the third step's loss is NaN
            out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(train_mod, "build_objective", _poisoned(train_mod.build_objective, once_nan))
    cfg = load_config(None, micro_overrides + ["train.steps=6", "monitor.probe_size=0"])
    out = train_mod.train(cfg, show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1, 1, 1]
    assert math.isnan(records[2]["loss"])
    weights = load_file(str(out / "final" / "model.safetensors"))
    assert all(torch.isfinite(v).all() for v in weights.values())
    assert "step 3 skipped" in (out / "train.log").read_text()


def test_consecutive_nan_steps_stop_the_run_and_keep_the_checkpoint(micro_overrides, monkeypatch, tmp_path):
    import mmalign.run.train as train_mod

    monkeypatch.setattr(train_mod, "build_objective", _nan_after(4))
    cfg = load_config(
        None,
        micro_overrides
        + [
            "train.steps=20",
            "train.checkpoint_every=2",
            "train.max_consecutive_skips=3",
            "monitor.probe_size=0",
        ],
    )
    with pytest.raises(train_mod.RunStopped, match="3 non-finite steps in a row at step 7"):
        train_mod.train(cfg, show_progress=False)
    last = checkpoint.resolve(cfg.output, "latest")
    assert last is not None and last.name == "step_00000004"
    # the last good checkpoint is loadable and finite
    state = __import__("mmalign.run.engine", fromlist=["x"]).consolidate_checkpoint(last, "engine")
    assert all(torch.isfinite(v).all() for v in state.values() if v.is_floating_point())


def test_cli_reports_a_stopped_run_in_one_line(micro_overrides, tmp_path):
    out = tmp_path / "bad"
    ov = [o for o in micro_overrides if not o.startswith("output=")] + [
        "train.lr=1e30",
        "train.steps=8",
        "train.max_consecutive_skips=2",
    ]
    # lr 1e30 makes the weights overflow after the first update: later losses are non-finite
    res = cli_main(*_cmd(out, ov)[3:])  # the arguments after `python -m mmalign.cli`, run in this process
    assert res.returncode == 1, res.stderr[-2000:]
    stopped = [line for line in res.stderr.splitlines() if line.startswith("mmalign: ")]
    assert stopped == [stopped[0]] and stopped[0].startswith(
        "mmalign: stopped: 2 non-finite steps in a row"
    ), stopped
    assert "Traceback" not in res.stderr


def test_monitors_and_outputs(micro_overrides):
    from mmalign.run.train import train

    cfg = load_config(
        None,
        micro_overrides
        + [
            "train.steps=4",
            "train.log_every=2",
            "monitor.probe_size=32",
            "train.eval_every=2",
            "monitor.min_effective_rank_frac=1.0",
        ],
    )
    out = train(cfg, show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    r = records[-1]
    for key in (
        "loss",
        "loss_floor",
        "pos_rank",
        "hardest_neg_prob",
        "top1",
        "logit_scale",
        "samples_per_s",
        "data_wait_s",
        "tflops",
        "skipped_steps",
        "probe_image_std_mean",
        "probe_text_effective_rank",
        "lr",
        "grad_norm",
    ):
        assert key in r, key
    assert r["loss_floor"] == pytest.approx(math.log(32))
    assert all(
        math.isfinite(rec["grad_norm"]) and rec["grad_norm"] > 0 for rec in records
    )  # ZeRO-0, no clipping
    assert 1 <= r["pos_rank"] <= 32 and 0 <= r["top1"] <= 1 and r["tflops"] > 0
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert (out / "eval_step00000002.json").is_file() and (out / "eval.json").is_file()
    # a threshold of the full dimension must raise the alarm: a 32-sample probe's spectrum is never
    # flat enough for an effective rank equal to the dimension (above 1 the config refuses it)
    assert "COLLAPSE ALARM" in (out / "train.log").read_text()


def test_atomic_checkpoints_keep_last_k(micro_overrides, tmp_path):
    from mmalign.run.train import train

    cfg = load_config(
        None,
        micro_overrides
        + ["train.steps=6", "train.checkpoint_every=2", "train.keep_checkpoints=2", "monitor.probe_size=0"],
    )
    out = train(cfg, show_progress=False)
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["latest", "step_00000004", "step_00000006"]
    assert (out / "checkpoints" / "latest").read_text() == "step_00000006"
    # a save killed half-way leaves a .tmp that is never read and is cleaned at the next start
    (out / "checkpoints" / "step_00000008.tmp" / "engine").mkdir(parents=True)
    assert checkpoint.resolve(out, "latest").name == "step_00000006"
    checkpoint.clean_partial(out)
    assert not (out / "checkpoints" / "step_00000008.tmp").exists()
    with pytest.raises(Exception, match="not a checkpoint directory RUN/checkpoints/step_N"):
        checkpoint.resolve(out, str(tmp_path))
    (out / "checkpoints" / "step_00000009").mkdir()
    with pytest.raises(Exception, match="not a complete mmalign checkpoint"):
        checkpoint.resolve(out, str(out / "checkpoints" / "step_00000009"))
