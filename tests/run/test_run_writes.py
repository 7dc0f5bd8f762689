"""The run's writes other than checkpoints (issue 39, point 7): a full disk while writing
``final/``, metrics.jsonl or train.log, and a read-only run directory, are one line each, never a
traceback. A stopped run exits 1 (``mmalign: stopped: ...``, its last checkpoint named); a
read-only folder is the user's to fix, exit 2, before anything is built.

Checkpoint saves on a full disk are tests/run/test_checkpoint_diskfull.py's. A real small tmpfs
is used where this process may mount one (root); the injected-ENOSPC tests run everywhere.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from mmalign.config import ConfigError
from mmalign.run import diskspace, rundir
from tests.harness import cli_main


def _sets(shapes_dir, *extra: str) -> list[str]:
    return [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=3",
        "train.warmup_steps=1",
        "train.log_every=1",
        "monitor.probe_size=0",
        "eval.suite=none",
        *extra,
    ]


def _train(out, sets, *flags):
    return cli_main("train", "--output", out, *flags, *[a for s in sets for a in ("--set", s)])


def _one_line(res, code: int, prefix: str) -> str:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code and "Traceback" not in res.stderr and "Logging error" not in res.stderr, (
        res.stderr[-3000:]
    )
    assert lines and lines[-1].startswith(prefix), lines[-5:]
    assert not [ln for ln in lines[:-1] if ln.startswith("mmalign: ") and "warning" not in ln], lines
    return lines[-1]


@pytest.fixture
def tmpfs(tmp_path):
    """Mounts a tmpfs of the given size (MiB) under tmp_path; root only, skipped elsewhere."""
    mounted = []

    def mount(size_mib: int) -> Path:
        mnt = tmp_path / f"tmpfs{len(mounted)}"
        mnt.mkdir()
        if os.geteuid() != 0:
            pytest.skip("a tmpfs needs root (mount); the injected tests cover the same paths")
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mnt)],
            capture_output=True,
            text=True,
        )
        if res.returncode != 0:
            pytest.skip(f"mount -t tmpfs is not permitted here ({res.stderr.strip()[:120]})")
        mounted.append(mnt)
        return mnt

    yield mount
    for mnt in reversed(mounted):
        for _ in range(2):  # a bind mount over a tmpfs: both
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


class _FullFile:
    """A file on a disk that just filled up: every write is ENOSPC (no file name, as a real one)."""

    def __init__(self, real):
        self.real, self.name = real, getattr(real, "name", "?")

    def write(self, text):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def flush(self):
        pass

    def close(self):
        self.real.close()


@pytest.mark.integration
def test_a_full_disk_while_writing_final_is_one_line_exit_1(shapes_dir, tmpfs):
    # 3 MiB: the config, logs and TensorBoard fit, final/'s 6 MiB of weights do not
    mnt = tmpfs(3)
    out, sets = mnt / "run", _sets(shapes_dir, "monitor.tensorboard=true")
    res = _train(out, sets)
    line = _one_line(res, 1, f"mmalign: stopped: cannot write the final weights or evaluation in {out}: ")
    assert ": no space left on device; " in line and " free on that filesystem" in line, line
    assert line.endswith(
        "no checkpoint of this run is saved: free some space, then start it again (the partial "
        "final/ was removed)"
    ), line
    assert not (out / "final").exists()  # a cut final/ would pass for a finished run (and refuse the rerun)
    subprocess.run(["mount", "-o", "remount,size=32m", str(mnt)], check=True)  # space is freed
    again = _train(out, sets, "--resume", "latest")
    assert again.returncode == 0 and (out / "final" / "model.safetensors").is_file(), again.stderr[-2000:]


@pytest.mark.integration
def test_a_full_disk_while_writing_metrics_is_one_line_naming_the_checkpoint(
    shapes_dir, tmp_path, monkeypatch
):
    from mmalign.run.runlog import RunLog

    real_open = RunLog._open

    def full_after_step_2(self):
        real_open(self)
        if self.main:
            real, lines = self.metrics_file, []

            class Filling(_FullFile):
                def write(self, text):
                    if len(lines) >= 2:
                        super().write(text)
                    lines.append(text)
                    return real.write(text)

                def close(self):  # its buffer flushed again on close: the full disk again
                    super().close()
                    if len(lines) >= 2:
                        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

            self.metrics_file = Filling(real)

    monkeypatch.setattr(RunLog, "_open", full_after_step_2)
    out = tmp_path / "run"
    res = _train(out, _sets(shapes_dir, "train.checkpoint_every=2", "monitor.tensorboard=false"))
    line = _one_line(
        res,
        1,
        f"mmalign: stopped: cannot write the run's logs in {out} (metrics.jsonl, TensorBoard): "
        f"no space left on device; ",
    )
    assert " free on that filesystem" in line, line
    assert line.endswith(
        "the last checkpoint, step_00000002, is intact: free some space, then continue with --resume latest"
    ), line
    monkeypatch.undo()  # space is back: the resume continues from step 2
    again = _train(
        out, _sets(shapes_dir, "train.checkpoint_every=2", "monitor.tensorboard=false"), "--resume", "latest"
    )
    assert again.returncode == 0 and "at step 2" in again.stdout, again.stderr[-2000:]


@pytest.mark.integration
def test_a_train_log_that_cannot_be_written_is_one_warning_and_the_run_goes_on(
    shapes_dir, tmp_path, monkeypatch
):
    import mmalign.run.train as train_mod

    real_setup = train_mod.setup_logging

    def setup_on_a_full_disk(out):
        real_setup(out)
        handler = next(
            h
            for h in train_mod.logging.getLogger("mmalign").handlers
            if isinstance(h, train_mod.logging.FileHandler)
        )
        handler.stream = _FullFile(handler.stream)

    monkeypatch.setattr(train_mod, "setup_logging", setup_on_a_full_disk)
    res = _train(tmp_path / "run", _sets(shapes_dir, "monitor.tensorboard=false"))
    assert res.returncode == 0 and "Logging error" not in res.stderr and "Traceback" not in res.stderr, (
        res.stderr[-3000:]
    )
    warned = [ln for ln in res.stderr.splitlines() if "is no longer written" in ln]
    assert warned == [
        f"mmalign: warning: {tmp_path / 'run' / 'train.log'} is no longer written (cannot write "
        f"{tmp_path / 'run' / 'train.log'}: no space left on device)"
    ], res.stderr[-2000:]


@pytest.mark.integration
def test_a_resume_from_a_read_only_mount_is_one_line_exit_2(shapes_dir, tmpfs):
    mnt = tmpfs(64)
    out = mnt / "run"
    sets = _sets(shapes_dir, "train.checkpoint_every=2", "monitor.tensorboard=false")
    assert _train(out, sets).returncode == 0
    shutil.rmtree(out / "final")  # as if killed after its last save
    view = tmpfs(1)  # the same files, mounted read-only (a bind mount: this process may still hold train.log)
    for flags in (["--bind"], ["-o", "remount,ro,bind"]):
        subprocess.run(["mount", *flags, *([str(mnt)] if flags == ["--bind"] else []), str(view)], check=True)
    ro = view / "run"
    assert (ro / "checkpoints" / "latest").is_file() and not os.access(ro, os.W_OK)
    res = _train(ro, sets + ["train.steps=4"], "--resume", "latest")
    line = _one_line(res, 2, "mmalign: error: config key 'output': ")
    assert f"{ro} is on a read-only filesystem" in line and "copy the run to a writable folder" in line, line


def test_check_writable_names_the_folder_that_refuses(tmp_path, monkeypatch):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    rundir.check_writable(out)  # writable: nothing to say
    refused = {out / "checkpoints"}  # a read-only mount of its own
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p) not in refused and real_access(p, mode))
    with pytest.raises(
        ConfigError, match=f"{out / 'checkpoints'} is (on a read-only filesystem|not writable)"
    ):
        rundir.check_writable(out)
    refused = {tmp_path}  # not made yet: the folder it would be made in
    with pytest.raises(ConfigError, match=f"{tmp_path} is "):
        rundir.check_writable(tmp_path / "new" / "run")


def test_refused_writes_are_told_from_other_errors(tmp_path):
    rw = diskspace.run_write_error
    assert "no space left on device" in str(rw(OSError(errno.ENOSPC, "x"), tmp_path))
    assert "disk quota exceeded" in str(rw(OSError(errno.EDQUOT, "x"), tmp_path))
    assert "read-only file system" in str(rw(OSError(errno.EROFS, "x", str(tmp_path / "f")), tmp_path))
    # safetensors' Rust writer names the errno only in its text
    rust = RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert str(rw(rust, tmp_path, "final/")).startswith("cannot write final/: no space left on device")
    assert rw(OSError(errno.ENOENT, "x"), tmp_path) is None and rw(ValueError("bug"), tmp_path) is None
