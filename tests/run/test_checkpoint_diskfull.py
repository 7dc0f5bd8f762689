"""A checkpoint save on a full disk (issue 28, point 2).

- the run stops with one line naming the checkpoint, the reason and the free space (exit 1
  from the CLI), never torch's "unexpected pos" traceback;
- the partial save is removed (the space comes back) and ``latest`` still names the previous
  checkpoint, so ``--resume latest`` continues once space is freed;
- the free space is checked before each save against the last checkpoint's size: one warning;
- under two ranks, a failure on one rank (inside DeepSpeed's writer, before its closing
  barrier) fails the save on both, with no rank left waiting in a barrier.

ENOSPC is injected into the writer; one test fills a real, small tmpfs (root only; skipped
with its reason where mounting is not permitted).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mmalign.config import load_config
from mmalign.run import checkpoint, diskspace
from tests.harness import ROOT, run_ranks


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


def _enospc_at(monkeypatch, marker: str) -> list:
    """Every torch write whose file path contains ``marker`` fails as a full disk does, after
    writing a few bytes (the partial file a real ENOSPC leaves); returns the list of what
    those writes were handed (a path, or a Python file)."""
    real, handed = torch.save, []

    def save(obj, f, *args, **kwargs):
        name = getattr(f, "name", f)
        if marker in str(name):
            handed.append(f)
            f.write(b"PK\x03\x04partial") if hasattr(f, "write") else Path(f).write_bytes(
                b"PK\x03\x04partial"
            )
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    return handed


@pytest.mark.integration
# DeepSpeed's writer (the engine's files), then ours (the trainer state)
@pytest.mark.parametrize("marker", ["step_00000004.tmp/engine/", "step_00000004.tmp/trainer_rank0.pt"])
def test_a_full_disk_stops_in_one_line_and_the_run_resumes(shapes_dir, tmp_path, monkeypatch, capsys, marker):
    from mmalign.run.train import RunStopped, train

    out = tmp_path / "run"
    cfg = load_config(None, _sets(shapes_dir) + [f"output={out}"])
    with monkeypatch.context() as m:
        handed = _enospc_at(m, marker)
        with pytest.raises(RunStopped) as err:
            train(cfg, show_progress=False)
    # one write failed, through a Python file (DeepSpeed's too: so the errno reaches us), and
    # nothing more was written into the doomed save
    assert len(handed) == 1 and hasattr(handed[0], "write"), handed
    msg = str(err.value)
    assert "\n" not in msg
    assert f"cannot write checkpoint {out / 'checkpoints' / 'step_00000004'}: no space left on device" in msg
    assert " free on that filesystem" in msg and "the last checkpoint took" in msg
    assert "latest still names step_00000002" in msg and "--resume latest" in msg
    base = out / "checkpoints"
    assert sorted(p.name for p in base.iterdir()) == ["latest", "step_00000002"]  # no .tmp left
    assert (base / "latest").read_text() == "step_00000002"
    capsys.readouterr()

    train(cfg, show_progress=False, resume="latest")  # space is back
    said = capsys.readouterr().out
    assert "resumed from" in said and "at step 2" in said
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4] and (out / "final" / "model.safetensors").is_file()
    assert (base / "latest").read_text() == "step_00000004"


def test_write_reasons():
    assert (
        diskspace.write_reason(OSError(errno.ENOSPC, "No space left on device")) == "no space left on device"
    )
    assert diskspace.write_reason(OSError(errno.EDQUOT, "Disk quota exceeded")) == "disk quota exceeded"
    assert diskspace.write_reason(OSError(errno.EIO, "Input/output error")) == "input/output error"
    try:  # torch's writer of a path: the errno is gone, the message is its own
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    except RuntimeError as e:
        assert diskspace.write_reason(e).startswith("the write failed ([enforce fail")
    try:  # through a Python file: OSError, with torch's RuntimeError as its context
        try:
            raise RuntimeError("unexpected pos 704 vs 598")
        except RuntimeError:
            raise OSError(errno.ENOSPC, "No space left on device")  # noqa: B904 (the context is the point)
    except OSError as e:
        assert diskspace.write_reason(e) == "no space left on device"
    assert diskspace.write_reason(ValueError("a bug")) is None


def test_the_free_space_check_warns_once(tmp_path, monkeypatch, caplog):
    base = tmp_path / "checkpoints"
    last = base / "step_00000002"
    last.mkdir(parents=True)
    (last / "state.pt").write_bytes(b"x" * 3000)
    watch = diskspace.SpaceWatch()
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 10_000)
    assert watch.check(base, last, 4) is None  # 10 kB free, 3 kB needed
    monkeypatch.setattr(diskspace, "free_bytes", lambda path: 2048)
    with caplog.at_level("WARNING", logger="mmalign.run.train"):
        line = watch.check(base, last, 4)
        assert watch.check(base, last, 6) is None  # once per run directory
    assert line is not None and "\n" not in line
    assert "2.0 KiB free" in line and "took 2.9 KiB" in line and "step 4" in line and str(base) in line
    assert [r.getMessage() for r in caplog.records] == [line]
    assert watch.check(base, None, 2) is None  # nothing saved yet: nothing to compare with


def test_deferred_engine_writes_record_the_failure_and_restore_the_writer(tmp_path, monkeypatch):
    class TorchCheckpointEngine:  # DeepSpeed's writer, as the engine holds it
        zipfile_serialization = True

        def save(self, state_dict, path):
            raise AssertionError("replaced while deferred")

    class Engine:
        ds = type("DS", (), {"checkpoint_engine": TorchCheckpointEngine()})()

    engine, failures = Engine(), []
    writer = engine.ds.checkpoint_engine
    with diskspace.deferred_engine_writes(engine, failures):
        writer.save({"w": torch.ones(2)}, str(tmp_path / "ok.pt"))
        _enospc_at(monkeypatch, "full.pt")
        writer.save({"w": torch.ones(2)}, str(tmp_path / "full.pt"))  # recorded, not raised
        writer.save({"w": torch.ones(2)}, str(tmp_path / "after.pt"))  # the save is dropped: nothing more
    assert torch.load(tmp_path / "ok.pt", weights_only=True)["w"].tolist() == [1.0, 1.0]
    assert len(failures) == 1 and failures[0].errno == errno.ENOSPC
    assert not (tmp_path / "full.pt").exists() and not (tmp_path / "after.pt").exists()
    assert "save" not in vars(writer)  # the class's method again


class _RankEngine:
    """An engine whose save, like DeepSpeed's, writes through its checkpoint engine and ends in
    a barrier; rank 1's write fails as a full disk."""

    class TorchCheckpointEngine:
        zipfile_serialization = True

        def save(self, state_dict, path):
            torch.save(state_dict, path)

    def __init__(self):
        self.ds = type("DS", (), {"checkpoint_engine": self.TorchCheckpointEngine()})()

    def save_checkpoint(self, directory, tag):
        from mmalign.dist import distributed as mdist

        (Path(directory) / tag).mkdir(exist_ok=True)
        rank = mdist.get_rank()
        self.ds.checkpoint_engine.save(
            {"w": torch.ones(3)}, str(Path(directory) / tag / f"rank{rank}_states.pt")
        )
        mdist.barrier()


def _full_on_rank1(rank, world, out):
    from mmalign.run import checkpoint, diskspace

    if rank == 1:

        def full(obj, path, **kwargs):
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        diskspace.save_torch = full
    engine, said = _RankEngine(), []
    for step in (2, 4):
        try:
            checkpoint.save(engine, out, step, {"rng": {}}, {}, keep=3)
            said.append(None)
        except diskspace.CheckpointWriteError as e:
            said.append(str(e))
        if rank == 1 and step == 2:
            diskspace.save_torch = lambda obj, path, **kw: torch.save(obj, path, **kw)  # space is back
    return said


@pytest.mark.integration
def test_a_full_disk_on_one_rank_fails_the_save_on_every_rank(tmp_path):
    out = tmp_path / "run"
    said = run_ranks(_full_on_rank1, 2, str(out), timeout_s=120, pooled=True)
    for rank in (0, 1):  # both ranks raised at step 2 (neither hung in a barrier), then both saved step 4
        first, second = said[rank]
        assert first is not None and "no space left on device on rank 1" in first and "\n" not in first
        assert "no checkpoint of this run is saved yet" in first
        assert second is None
    base = out / "checkpoints"
    assert sorted(p.name for p in base.iterdir()) == ["latest", "step_00000004"]
    assert sorted(p.name for p in (base / "step_00000004" / "engine").iterdir()) == [
        "rank0_states.pt",
        "rank1_states.pt",
    ]


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 30 MiB tmpfs: room for one micro checkpoint (about 19 MiB) and the run's other files,
    not for a second."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0:
        pytest.skip("a tmpfs needs root (mount); the injected-ENOSPC tests cover the same path")
    res = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=30m", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if res.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here ({res.stderr.strip()[:120]})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _cli(out, sets, *flags):
    cmd = [sys.executable, "-m", "mmalign.cli", "train", "--output", str(out), *flags]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)


@pytest.mark.integration
def test_a_real_full_tmpfs_is_exit_1_and_resumes_after_space_is_freed(shapes_dir, small_tmpfs, capsys):
    out = small_tmpfs / "run"
    sets = _sets(shapes_dir)
    res = _cli(out, sets)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-3000:]
    assert lines[-1].startswith(
        f"mmalign: stopped: cannot write checkpoint {out / 'checkpoints' / 'step_00000004'}: "
        f"no space left on device; "
    ), lines[-1]
    assert "MiB free on that filesystem" in lines[-1] and "latest still names step_00000002" in lines[-1]
    warned = [ln for ln in res.stdout.splitlines() if "will probably not fit" in ln]
    assert len(warned) == 1 and "the save of step 4" in warned[0], res.stdout[-2000:]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_00000002"]

    subprocess.run(["mount", "-o", "remount,size=80m", str(small_tmpfs)], check=True)  # space is freed
    from mmalign.run.train import train  # in this process: the CLI's exit status is checked above

    train(load_config(None, sets + [f"output={out}"]), show_progress=False, resume="latest")
    said = capsys.readouterr().out
    assert "resumed from" in said and "at step 2" in said
    assert checkpoint.resolve(out, "latest").name == "step_00000004"
