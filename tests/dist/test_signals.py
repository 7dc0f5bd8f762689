"""A run stopped by SIGTERM or Ctrl-C says where it stopped (issue 28, point 3).

One line on stderr (and in train.log): the signal, the step, the last good checkpoint and the
command that continues the run (the command line with ``--resume latest`` in place of
``--overwrite`` / ``--resume PATH``); exit status 143 for SIGTERM, 130 for SIGINT.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from mmalign.config import load_config
from mmalign.run import signals
from tests.harness import ROOT


def test_the_resume_command_drops_what_would_delete_or_rewind():
    cfg = load_config(None, ["output=runs/x"])
    argv = [
        "/venv/bin/mmalign",
        "train",
        "--config",
        "my run.yaml",
        "--overwrite",
        "--set",
        "train.lr=1e-3",
        "--resume",
        "runs/x/checkpoints/step_00000004",
    ]
    want = "mmalign train --config 'my run.yaml' --set train.lr=1e-3 --resume latest"
    assert signals.resume_command(argv, cfg) == want
    assert (
        signals.resume_command(
            ["mmalign", "train", "--overw", "--resume=runs/x/checkpoints/step_2", "--output", "runs/x"], cfg
        )
        == "mmalign train --output runs/x --resume latest"
    )
    # a run started from Python (a notebook, the quickstart): through the run's own config.yaml
    assert (
        signals.resume_command(["pytest", "-q"], cfg)
        == "mmalign train --config runs/x/config.yaml --resume latest"
    )


def test_the_line_without_a_checkpoint_or_a_step(tmp_path):
    cfg = load_config(None, [f"output={tmp_path}", "train.steps=50"])
    line = signals.stop_line("SIGTERM", cfg, 7, ["mmalign", "train"])
    assert line == (
        "mmalign: stopped by SIGTERM at step 7 of 50; no checkpoint saved yet (train.checkpoint_every "
        "is 0), so it starts again from step 0; restart with: mmalign train --resume latest"
    )
    assert signals.stop_line("SIGINT", cfg, None, ["mmalign", "train"], world=4).startswith(
        "mmalign: stopped by SIGINT before its first step; "
    )
    assert signals.stop_line("SIGINT", cfg, None, ["x"], world=4).endswith(
        "(under the launcher of its 4 ranks)"
    )
    assert signals.stop_line("SIGTERM", None, None, []) == "mmalign: stopped by SIGTERM"


def _sets(shapes_dir, *extra):
    return [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.warmup_steps=1",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        "eval.suite=none",
        *extra,
    ]


@pytest.mark.integration
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_signal_in_the_loop_says_the_step_and_the_checkpoint(
    shapes_dir, tmp_path, monkeypatch, capsys, how
):
    """In this process: the signal arrives in step 3, after the step-2 checkpoint."""
    import mmalign.run.train as train_mod

    out = tmp_path / "run"
    cfg = load_config(None, _sets(shapes_dir, "train.steps=6", "train.checkpoint_every=2", f"output={out}"))
    real_step = train_mod._train_step

    def step_then_signal(p, step, *args):
        if step == 3:
            if how == "SIGTERM":
                os.kill(os.getpid(), signal.SIGTERM)  # the handler raises at the next bytecode
                time.sleep(5)  # never reached in full
            raise KeyboardInterrupt  # what Ctrl-C raises (a real SIGINT would also reach pytest)
        return real_step(p, step, *args)

    monkeypatch.setattr(train_mod, "_train_step", step_then_signal)
    monkeypatch.setattr(sys, "argv", ["mmalign", "train", "--overwrite", "--output", str(out)])
    expected = (SystemExit, KeyboardInterrupt)[how == "SIGINT"]
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(expected) as err:
        train_mod.train(cfg, show_progress=False)
    if how == "SIGTERM":
        assert err.value.code == 143
    assert err.value.reported  # the CLI prints nothing more
    lines = capsys.readouterr().err.strip().splitlines()
    want = (
        f"mmalign: stopped by {how} at step 3 of 6; last checkpoint {out / 'checkpoints' / 'step_00000002'}; "
        f"resume with: mmalign train --output {out} --resume latest"
    )
    assert lines[-1] == want
    assert want.removeprefix("mmalign: ") in (out / "train.log").read_text()
    assert signal.getsignal(signal.SIGTERM) is handler  # the run's handler is put back


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("how", ["SIGTERM", "SIGINT"])
def test_a_signal_whose_exception_a_finalizer_dropped_stops_the_run_at_the_next_step(
    shapes_dir, tmp_path, monkeypatch, capsys, how
):
    """CI saw a run train on after SIGTERM: Python runs a handler wherever the main thread is,
    a ``__del__`` included (torch's shared-memory bookkeeping runs one for every batch a data
    worker sends), and drops the exception raised there. The run records the signal and stops
    at the next step, with the usual line."""
    import mmalign.run.train as train_mod

    out = tmp_path / "run"
    cfg = load_config(None, _sets(shapes_dir, "train.steps=8", f"output={out}"))
    real_step = train_mod._train_step
    sig = getattr(signal, how)

    class SignalledInFinalizer:
        def __del__(self):
            os.kill(os.getpid(), sig)
            sum(range(10))  # the handler runs here, inside __del__, and its exception is dropped

    finished = []

    def step_with_a_finalizer(p, step, *args):
        if step == 3:
            SignalledInFinalizer()  # made and collected at once
        result = real_step(p, step, *args)
        finished.append(step)  # step 3 goes on to its end: the signal's exception did not stop it
        return result

    monkeypatch.setattr(train_mod, "_train_step", step_with_a_finalizer)
    monkeypatch.setattr(sys, "argv", ["mmalign", "train", "--output", str(out)])
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # as on a terminal
    try:
        with pytest.raises((SystemExit, KeyboardInterrupt)[how == "SIGINT"]) as err:
            train_mod.train(cfg, show_progress=False)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
    finally:
        signal.signal(signal.SIGINT, before)
    assert finished == [1, 2, 3]
    assert how == "SIGINT" or err.value.code == 143
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith(f"mmalign: stopped by {how} at step 4 of 8; no checkpoint saved yet"), line
    assert not (out / "final").exists()
    signals.check()  # the next run in this process starts afresh: nothing recorded


def test_a_run_leaves_an_ignored_sigint_ignored():
    """A background job (nohup, a CI runner) ignores SIGINT; the run must not take it back."""
    from mmalign.run.train import _stop_on_signals

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with _stop_on_signals():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            assert signal.getsignal(signal.SIGTERM) is signals.raise_terminated
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        with _stop_on_signals():
            assert signal.getsignal(signal.SIGINT) is signals.raise_terminated
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.integration
def test_sigterm_exits_143_with_the_line_and_its_command_resumes(shapes_dir, tmp_path):
    out = tmp_path / "run"
    sets = [a for s in _sets(shapes_dir, "train.steps=400", "train.checkpoint_every=2") for a in ("--set", s)]
    cmd = [sys.executable, "-m", "mmalign.cli", "train", "--output", str(out), "--overwrite", *sets]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    pointer, deadline = out / "checkpoints" / "latest", time.monotonic() + 240
    while not pointer.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, err[-3000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("mmalign: stopped by SIGTERM at step ") and " of 400; last checkpoint " in line, (
        err[-3000:]
    )
    assert "Traceback" not in err and "--overwrite" not in line
    last = (out / "checkpoints" / "latest").read_text()
    assert f"last checkpoint {out / 'checkpoints' / last}; resume with: mmalign train " in line
    command = shlex.split(line.split("resume with: ", 1)[1])
    assert command[0] == "mmalign" and command[-2:] == ["--resume", "latest"]
    # the printed command continues the run (made short: train.steps is a resumable change)
    step = int(last.split("_")[1])
    res = subprocess.run(
        [sys.executable, "-m", "mmalign.cli", *command[1:], "--set", f"train.steps={step + 1}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / last} at step {step}" in res.stdout


@pytest.mark.parametrize("reported", [True, False])
def test_the_cli_adds_no_second_line_after_a_runs_own(monkeypatch, capsys, reported):
    from mmalign import cli

    def interrupted(args):
        error = KeyboardInterrupt()
        if reported:
            error.reported = True  # what mmalign.run.signals.report marks
        raise error

    monkeypatch.setattr(cli, "cmd_train", interrupted)
    assert cli.main(["train"]) == 130
    assert capsys.readouterr().err == ("" if reported else "mmalign: interrupted\n")


def test_a_signal_during_a_save_waits_for_the_save_then_stops_the_run():
    """A signal raised inside torch's writer came out as a failed write ("unexpected pos"): the run
    stopped as on a full disk, exit 1, its save removed. Held by signals.deferred, the block
    completes, the handlers are back, and the signal then acts through the handler it found."""
    previous = signal.signal(signal.SIGTERM, signals.raise_terminated)
    try:
        finished = []
        with pytest.raises(signals.Terminated) as stopped:
            with signals.deferred():
                os.kill(os.getpid(), signal.SIGTERM)
                signal.raise_signal(signal.SIGINT)  # a second signal: the first one decides
                finished.append(True)  # the save's work goes on after the signal
        assert finished == [True] and stopped.value.code == 143
        assert signal.getsignal(signal.SIGTERM) is signals.raise_terminated
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        with pytest.raises(
            KeyboardInterrupt
        ):  # Ctrl-C alone: Python's own KeyboardInterrupt, after the block
            with signals.deferred():
                signal.raise_signal(signal.SIGINT)
        with signals.deferred():  # no signal: nothing happens
            pass
    finally:
        signal.signal(signal.SIGTERM, previous)
