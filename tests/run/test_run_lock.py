"""One launch per output folder (issue 39, point 7): a second ``mmalign train`` of a running run,
or a second ``mmalign embed`` into a folder being written, is refused in one line that names the
first (its pid), exit 2; once the first is gone (however it died) the folder is free again.

Two ``--resume latest`` launches of one run used to run together: metrics.jsonl got a line of
NUL bytes, steps were lost and repeated, and both wrote final/.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmalign import dirlock
from mmalign.cli_train import _launch_rank, output_lock
from mmalign.run.rundir import check_fresh_start
from tests.harness import ROOT, cli_main

LIMIT_S = 240  # a first step on a busy 2-core machine; a hang fails instead of blocking


def _refusal(res, pid: int) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1, res.stderr[-2000:]
    assert "is in use by" in lines[0] and f"pid {pid} " in lines[0], lines[0]
    return lines[0]


def _sets(overrides: list[str]) -> list[str]:
    return [a for o in overrides for a in ("--set", o)]


@pytest.mark.integration
def test_a_second_launch_of_a_running_train_is_refused_and_a_resume_works_after_it(micro_overrides, tmp_path):
    out = tmp_path / "run"
    base = [o for o in micro_overrides if not o.startswith(("output=", "train.steps="))] + [
        "eval.suite=none",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
    ]
    log = tmp_path / "first.txt"
    with log.open("w") as sink:
        first = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mmalign.cli",
                "train",
                "--output",
                str(out),
                "--resume",
                "latest",
                *_sets(base + ["train.steps=100000"]),
            ],
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + LIMIT_S
        while "\nstep " not in log.read_text() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert first.poll() is None and "\nstep " in log.read_text(), log.read_text()[-2000:]
        started = time.monotonic()
        second = cli_main("train", "--output", out, "--resume", "latest", *_sets(base + ["train.steps=2"]))
        assert time.monotonic() - started < 10  # refused before anything is built
        line = _refusal(second, first.pid)
        assert line.startswith(f"mmalign: error: {out} is in use by mmalign train"), line
        assert first.poll() is None  # the first run goes on untouched
    finally:
        first.send_signal(signal.SIGKILL)  # a killed holder: its lock frees itself
        first.wait(timeout=60)
    assert (out / dirlock.LOCK_FILE).is_file()  # a stale lock file stays; it no longer holds anything
    again = cli_main("train", "--output", out, "--resume", "latest", *_sets(base + ["train.steps=2"]))
    assert again.returncode == 0, again.stderr[-3000:]
    assert (out / "final" / "model.safetensors").is_file()
    assert dirlock.holder(out) is None  # released at the end: no holder recorded


def test_a_second_embed_into_the_same_out_is_refused(tmp_path):
    out, model = tmp_path / "emb", tmp_path / "not_a_model"
    model.mkdir()  # a path that exists: the lock is what refuses, not the model check before it
    # the first embed: what cmd_embed holds while it writes (a real embed needs a trained model)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from mmalign import dirlock; "
            "dirlock.hold(sys.argv[1], 'mmalign embed'); print('held', flush=True); "
            "time.sleep(120)",
            str(out),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        res = cli_main("embed", "--model", model, "--data", tmp_path / "no_data", "--out", out)
        line = _refusal(res, holder.pid)
        assert line.startswith(f"mmalign: error: {out} is in use by mmalign embed"), line
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # the holder is gone: the lock no longer refuses; the next problem is the folder that is no model
    res = cli_main("embed", "--model", model, "--data", tmp_path / "no_data", "--out", out)
    assert res.returncode == 2 and "in use" not in res.stderr and "not_a_model" in res.stderr, res.stderr


def test_the_lock_file_is_not_run_content(tmp_path):
    out = tmp_path / "run"
    with dirlock.hold(out, "mmalign train"):
        check_fresh_start(out, None, False)  # only the lock: still an empty run directory
        (out / "notes.txt").write_text("mine")
        with pytest.raises(ValueError, match=r"is not empty \(notes.txt\)"):
            check_fresh_start(out, None, False)


@pytest.mark.parametrize(
    "env, takes",
    [
        ({}, True),
        ({"RANK": "0", "WORLD_SIZE": "2"}, True),
        ({"RANK": "1", "WORLD_SIZE": "2"}, False),  # torchrun's other ranks: rank 0 holds it for the run
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, True),
        ({"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}, False),
    ],
)
def test_only_rank_0_of_an_outside_launcher_takes_the_lock(tmp_path, env, takes):
    out = tmp_path / "run"
    with output_lock(out, "mmalign train", take=_launch_rank(env) == 0) as lock:
        assert (lock is not None) == takes and (out / dirlock.LOCK_FILE).is_file() == takes
        if takes:
            assert dirlock.holder(out)["pid"] == os.getpid()
            assert str(Path(out).resolve()) in os.environ[dirlock.ENV]  # the ranks it starts inherit it
        (out / "metrics.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (out / "metrics.jsonl").write_text("")
    assert str(Path(out).resolve()) not in os.environ.get(dirlock.ENV, "")
    assert (out / "metrics.jsonl").is_file()  # what the run wrote stays


def test_a_refused_launch_leaves_no_folder_behind(tmp_path):
    out = tmp_path / "new" / "run"
    with pytest.raises(ValueError, match="refused later"):
        with output_lock(out, "mmalign train"):
            assert (out / dirlock.LOCK_FILE).is_file()
            raise ValueError("refused later")  # e.g. a shard path checked after the lock
    assert not (tmp_path / "new").exists()
    (tmp_path / "mine").mkdir()
    with output_lock(tmp_path / "mine", "mmalign embed"):
        pass
    assert (tmp_path / "mine").is_dir()  # a folder that was there stays
