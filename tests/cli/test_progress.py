"""Progress on a terminal of zero size (issue 28, point 8): ``script -q -c CMD /dev/null`` and
some CI or job consoles give the run a pseudo-terminal nobody sized (0 x 0). tqdm draws its bar
in 0 columns there, i.e. nothing, so such a terminal (or one of unknown width) gets the plain
lines: the bar-or-lines decision, the loops' counter, the training lines, and a real run's
output read from a 0 x 0 pty."""

from __future__ import annotations

import contextlib
import fcntl
import io
import json
import os
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

from mmalign import progress
from mmalign.progress import track
from mmalign.run.runlog import RunLog
from tests.harness import ROOT


@contextlib.contextmanager
def sized_pty(rows: int, cols: int):
    """A pseudo-terminal of ``rows`` x ``cols``; yields (master fd, the slave as a text stream)."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
    stream = os.fdopen(slave, "w", buffering=1)
    try:
        yield master, stream
    finally:
        stream.close()
        os.close(master)


def drain(master: int) -> str:
    """What has been written to the pty so far (nothing blocks: a bounded, non-waiting read)."""
    out = b""
    while select.select([master], [], [], 0)[0]:
        try:
            chunk = os.read(master, 65536)
        except OSError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


class _NoFileno(io.StringIO):
    """Says it is a terminal but has no descriptor: its width cannot be read."""

    def isatty(self) -> bool:
        return True

    def fileno(self) -> int:
        raise io.UnsupportedOperation("fileno")


def test_a_bar_only_on_a_terminal_of_known_nonzero_width():
    with sized_pty(0, 0) as (_, zero), sized_pty(24, 0) as (_, no_cols), sized_pty(24, 80) as (_, sized):
        assert progress.is_terminal(zero)  # the premise: it is a terminal, which the old check trusted
        assert progress.terminal_columns(zero) == 0 and not progress.use_bar(zero)
        assert not progress.use_bar(no_cols)
        assert progress.terminal_columns(sized) == 80 and progress.use_bar(sized)
    assert progress.terminal_columns(_NoFileno()) is None and not progress.use_bar(
        _NoFileno()
    )  # unknown width
    assert not progress.use_bar(io.StringIO())  # a pipe or a file


def test_loops_print_lines_with_a_total_and_an_eta_on_a_zero_size_terminal(monkeypatch):
    with sized_pty(0, 0) as (master, zero):
        monkeypatch.setattr(sys, "stderr", zero)  # where tqdm would draw
        out = io.StringIO()
        assert list(track(range(4), "eval x: embedding", total=4, unit="images", every_s=0.0, out=out)) == [
            0,
            1,
            2,
            3,
        ]
        lines = out.getvalue().splitlines()
        assert lines[0].startswith("mmalign: eval x: embedding: 1 of 4 images") and "ETA" in lines[0], lines
        assert lines[-1].startswith("mmalign: eval x: embedding: 4 of 4 images") and "done in" in lines[-1]
        assert drain(master) == ""  # and no bar on the terminal
    with sized_pty(24, 80) as (master, sized):  # a sized terminal keeps its bar, and no lines
        monkeypatch.setattr(sys, "stderr", sized)
        out = io.StringIO()
        assert list(track(range(3), "bar", total=3, every_s=0.0, out=out)) == [0, 1, 2]
        assert out.getvalue() == "" and "bar" in drain(master)


def _record(step: int) -> dict:
    return {
        "step": step,
        "loss": 2.5,
        "lr": 1e-3,
        "logit_scale": 14.0,
        "samples_per_s": 64.0,
        "skipped_steps": 0,
    }


@pytest.mark.parametrize("cols", [0, 80], ids=["zero-size", "sized"])
def test_training_lines_on_a_zero_size_terminal(tmp_path, monkeypatch, capsys, cols):
    with sized_pty(24 if cols else 0, cols) as (master, terminal):
        monkeypatch.setattr(sys, "stderr", terminal)
        with RunLog(tmp_path, 0, 0, 4, 2, show_progress=True) as log:
            assert log.use_bar == bool(cols) and log.lines == (not cols)
            for step in range(1, 5):
                if step % 2 == 0:
                    log.record(step, _record(step), eta=1.0)
                log.advance()
        drain(master)
    steps = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert [s.split("/")[0] for s in steps] == (["step 2", "step 4"] if not cols else [])


def _read_until_exit(proc: subprocess.Popen, master: int, limit_s: float) -> str:
    """The child's output through the pty's master, read until it exits (bounded by ``limit_s``)."""
    out, deadline = b"", time.time() + limit_s
    while time.time() < deadline:
        ready = select.select([master], [], [], 0.5)[0]
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every slave end is closed, the child has gone
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    return out.decode(errors="replace").replace("\r\n", "\n")


@pytest.mark.integration
def test_a_run_on_a_zero_size_terminal_shows_its_steps_towers_and_headline(micro_overrides):
    """The repro of ``script -q -c "mmalign train ..." /dev/null``: stdout and stderr a 0 x 0 pty.
    The step lines appear (point 8), then the locked image tower with its counts (10) and at the
    end the headline results with the path of eval.json (9)."""
    from mmalign.config import load_config
    from mmalign.evaluation import headline
    from mmalign.models import build_model
    from mmalign.run import trainable

    overrides = micro_overrides + [
        "train.steps=6",
        "train.log_every=2",
        "monitor.probe_size=0",
        "model.lock_image=true",
    ]
    cmd = [sys.executable, "-m", "mmalign.cli", "train"] + [a for o in overrides for a in ("--set", o)]
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 0, 0, 0, 0))
    try:
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=slave,
            stderr=slave,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        )
        os.close(slave)
        slave = -1
        try:
            out = _read_until_exit(proc, master, 300)
            assert proc.wait(timeout=60) == 0, out[-3000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)
    finally:
        if slave >= 0:
            os.close(slave)
        os.close(master)
    lines = out.splitlines()
    assert [line.split("/")[0] for line in lines if line.startswith("step ")] == [
        "step 2",
        "step 4",
        "step 6",
    ], out

    # point 10: the counts, computed here from the model the config builds
    cfg = load_config(None, overrides)
    model = build_model(cfg.model)
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    assert n_frozen == sum(p.numel() for p in model.visual.parameters()) > 0  # the premise: the image tower
    want = f"mmalign: parameters: {n_trainable:,} trainable, {n_frozen:,} frozen; image tower: locked"
    assert any(line.startswith(want) for line in lines), out
    run = Path(cfg.output)
    assert want.removeprefix("mmalign: ") in (run / "train.log").read_text()
    first = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])
    assert (first["params_trainable"], first["params_frozen"], first["image_tower"]) == (
        n_trainable,
        n_frozen,
        "locked",
    )
    assert trainable.param_counts(model, cfg.model)["text_tower"] == first["text_tower"] == "trainable"

    # point 9: the last lines before the CLI's own are the headline of eval.json, with its path
    records = json.loads((run / "eval.json").read_text())
    start = lines.index(f"mmalign: results ({run / 'eval.json'}):")
    shape = next(r for r in records if r["dataset"] == "shapes/shape")["metrics"]
    recall = next(r for r in records if r["dataset"] == "shapes/retrieval")["metrics"]
    assert lines[start + 1] == (
        f"mmalign:   shapes/shape: zero-shot top-1 {100 * shape['acc1']:.1f}%, "
        f"top-5 {100 * shape['acc5']:.1f}%; chance top-1 {100 * shape['chance_acc1']:.1f}%"
    )
    r = {k: f"{100 * recall[f'image_retrieval_recall@{k}']:.1f}%" for k in (1, 5, 10)}
    assert f"text->image R@1 {r[1]}, R@5 {r[5]}, R@10 {r[10]}" in out
    assert [line for line in lines[start:] if line.startswith("mmalign:   ")] == [
        f"mmalign: {line}" for line in headline.lines(records, run / "eval.json")[1:]
    ]
    assert lines[-1].startswith(f"run written to {run}")
