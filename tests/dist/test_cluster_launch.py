"""Launching across nodes without traps (the one-machine parts; tests/dist/multihost/ has the two-host runs).

- SLURM's node list (``node[01-03,07]``) gives the rendezvous address; an unparsable one is a
  one-line error, not a 30-minute hang on 127.0.0.1;
- ``--nproc`` is refused inside a multi-rank job;
- every process group (DeepSpeed's too) gets ``dist.timeout_s``; on CUDA the group is bound to
  the rank's device, LOCAL_RANK when that many devices are visible, else 0;
- only the current CUDA device's RNG is saved and restored;
- ``--resume latest`` before the first save is a fresh start; a torchrun restart never clears
  or rewinds the run's checkpoints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file

from mmalign.dist import cluster
from mmalign.dist import distributed as mdist
from mmalign.errors import UsageError
from mmalign.run import checkpoint, gradcache
from tests.harness import ROOT, cli_main

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT")


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS and not k.startswith("SLURM_")}
    return {**env, **extra}


def _launch_env(monkeypatch, **extra: str) -> None:
    """This process's environment as :func:`_env` gives a child's, for an in-process ``cli_main``;
    but LOCAL_RANK=0 stays: this process's own one-process group set it (DeepSpeed requires it,
    and alone it makes nothing look distributed)."""
    for key in [k for k in os.environ if k in LAUNCH_VARS or k.startswith("SLURM_")]:
        if (key, os.environ[key]) != ("LOCAL_RANK", "0"):
            monkeypatch.delenv(key)
    for key, value in extra.items():
        monkeypatch.setenv(key, value)


def _launched_as(monkeypatch, **extra: str) -> None:
    """:func:`_launch_env`, where neither ranks nor a process group can start: a check that let
    the environment through fails the test at once, instead of spawning ranks from the test
    process or waiting for a second rank that never comes."""
    import mmalign.dist.launch

    _launch_env(monkeypatch, **extra)

    def refused(*args, **kwargs):
        raise AssertionError("ranks or a process group started: the launch environment was not refused")

    monkeypatch.setattr(mmalign.dist.launch, "launch_local", refused)
    monkeypatch.setattr(mdist.dist, "init_process_group", refused)


# ------------------------------------------------------------------ SLURM node lists


@pytest.mark.parametrize(
    "text, hosts",
    [
        ("node01", ["node01"]),
        ("node[01-03,07]", ["node01", "node02", "node03", "node07"]),
        ("node[01-03,07],gpu7", ["node01", "node02", "node03", "node07", "gpu7"]),
        ("a[8-10]", ["a8", "a9", "a10"]),
        ("rack[1-2]-n[01-02]", ["rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02"]),
        ("login1,node[001-002].cluster", ["login1", "node001.cluster", "node002.cluster"]),
    ],
)
def test_nodelist_expansion(text, hosts):
    assert cluster.expand_nodelist(text) == hosts
    assert cluster.first_host(text) == hosts[0]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "node[01-",
        "node]01[",
        "node[a-b]",
        "node[3-1]",
        "node[]",
        "a,,b",
        "node[[1]]",
        "no de",
        "node[1-2-3]",
    ],
)
def test_unparsable_nodelist(text):
    with pytest.raises(ValueError):
        cluster.first_host(text)


def test_slurm_master_address():
    env = {
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "16",
        "SLURM_LOCALID": "1",
        "SLURM_JOB_NODELIST": "gpu[07-08,11]",
        "SLURM_JOB_ID": "123456",
    }
    info = mdist.env_dist_info(env)
    assert (info.rank, info.world_size, info.local_rank, info.source) == (1, 16, 1, "slurm")
    assert (info.master_addr, info.master_port) == ("gpu07", str(12000 + 123456 % 20000))
    assert "SLURM_JOB_NODELIST" in info.master_from
    # every task of the job derives the same address and port
    assert mdist.env_dist_info({**env, "SLURM_PROCID": "9", "SLURM_LOCALID": "1"}).master_addr == "gpu07"
    # an explicit MASTER_ADDR / MASTER_PORT wins
    info = mdist.env_dist_info({**env, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "2222"})
    assert (info.master_addr, info.master_port) == ("10.0.0.5", "2222")
    with pytest.raises(UsageError, match="SLURM_JOB_NODELIST.*cannot be parsed.*MASTER_ADDR"):
        mdist.env_dist_info({**env, "SLURM_JOB_NODELIST": "gpu[07-"})
    # one task has no rendezvous to find: its node list is not read
    assert (
        mdist.env_dist_info(
            {**env, "SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_JOB_NODELIST": "gpu[07-"}
        ).world_size
        == 1
    )


def _a_shard(tmp_path) -> list[str]:
    """data.train naming an existing file: the shards are checked before the launch is."""
    (tmp_path / "00000.tar").touch()
    return ["--set", f"data.train={tmp_path / '00000.tar'}"]


def test_cli_unparsable_nodelist_is_one_line(tmp_path, monkeypatch):
    _launched_as(
        monkeypatch, SLURM_PROCID="0", SLURM_NTASKS="2", SLURM_LOCALID="0", SLURM_JOB_NODELIST="node[01-"
    )
    res = cli_main(
        "train",
        "--output",
        str(tmp_path / "run"),
        "--set",
        "model.preset=micro",
        "--set",
        "eval.suite=none",
        *_a_shard(tmp_path),
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "SLURM_JOB_NODELIST" in lines[0], res.stderr
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ --nproc inside a job


@pytest.mark.parametrize(
    "env, refused",
    [
        ({"SLURM_NTASKS": "4"}, True),
        ({"WORLD_SIZE": "2"}, True),
        ({"OMPI_COMM_WORLD_SIZE": "8"}, True),
        ({"GROUP_WORLD_SIZE": "2"}, True),
        ({"SLURM_NTASKS": "1"}, False),
        ({"WORLD_SIZE": "1"}, False),
        ({}, False),
    ],
)
def test_nproc_inside_a_job(env, refused):
    if refused:
        with pytest.raises(UsageError, match="--nproc 2 inside a job"):
            cluster.check_nproc(2, env)
    else:
        cluster.check_nproc(2, env)
    cluster.check_nproc(1, env)  # no --nproc: nothing to refuse


def test_cli_refuses_nproc_under_srun(tmp_path, monkeypatch):
    _launched_as(monkeypatch, SLURM_NTASKS="2", SLURM_PROCID="0")
    res = cli_main(
        "train",
        "--nproc",
        "2",
        "--output",
        str(tmp_path / "run"),
        "--set",
        "model.preset=micro",
        "--set",
        "eval.suite=none",
        *_a_shard(tmp_path),
    )
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "--nproc 2 inside a job that already runs 2 ranks (SLURM_NTASKS=2)" in lines[0]


# ------------------------------------------------------------------ process groups


def test_local_device_index():
    assert mdist.local_device_index(3, 8) == 3  # one process per GPU of the node
    assert mdist.local_device_index(3, 1) == 0  # one GPU bound to each task
    assert mdist.local_device_index(0, 1) == 0


def _run_fresh(code: str, **env: str) -> None:
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=_env(**env),
        cwd=ROOT,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.parametrize("timeout_s, expected", [(7, 7), (0, 120)])
def test_every_group_gets_the_timeout(timeout_s, expected):
    """The default group and a later new_group() (DeepSpeed clones the world group for ZeRO)."""
    _run_fresh(f"""
        import torch, torch.distributed as dist
        from mmalign.dist import distributed as mdist
        mdist.init_from_env(require_group=True, timeout_s={timeout_s})
        for group in (dist.group.WORLD, dist.new_group(ranks=[0])):
            got = group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            assert got == {expected}, got
    """)


def test_cuda_group_is_bound_to_the_rank_device(monkeypatch):
    """On CUDA: set_device and device_id are the rank's device; the timeout is passed (GPU default 600 s)."""
    from torch.distributed import distributed_c10d as c10d

    calls = {}
    for name in (
        "default_pg_timeout",
        "default_pg_nccl_timeout",
    ):  # init_from_env sets them; restored afterwards
        monkeypatch.setattr(c10d, name, getattr(c10d, name, None), raising=False)
    monkeypatch.setattr(mdist, "_timeout_s", None)
    monkeypatch.setattr(mdist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.setdefault("set_device", index))
    monkeypatch.setattr(mdist.dist, "init_process_group", lambda **kw: calls.setdefault("init", kw))
    for key, value in {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "3",
        "MASTER_ADDR": "10.1.1.1",
        "MASTER_PORT": "1234",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    mdist.init_from_env()
    assert calls["set_device"] == 0  # LOCAL_RANK 3, but this task sees one GPU
    assert calls["init"]["backend"] == "nccl"
    assert calls["init"]["device_id"] == torch.device("cuda", 0)
    assert calls["init"]["timeout"] == timedelta(seconds=600)


def test_only_the_current_cuda_rng_is_saved(monkeypatch):
    """get_rng_state_all() would create a context on every visible GPU in every rank."""
    state = torch.arange(4, dtype=torch.uint8)
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append(s))
    for name in ("get_rng_state_all", "set_rng_state_all"):
        monkeypatch.setattr(
            torch.cuda, name, lambda *a, name=name: pytest.fail(f"{name} touches every device")
        )
    saved = checkpoint.rng_state()
    assert len(saved["cuda"]) == 1 and torch.equal(saved["cuda"][0], state)
    checkpoint.set_rng_state(saved)
    older = [torch.full((4,), i, dtype=torch.uint8) for i in range(4)]  # a checkpoint holding every device's
    checkpoint.set_rng_state({**saved, "cuda": older})
    assert torch.equal(restored[0], state) and torch.equal(restored[1], older[2])
    captured = gradcache.RngState.capture()
    captured.restore()
    assert torch.equal(captured.cuda, state) and torch.equal(restored[2], state)


# ------------------------------------------------------------------ --resume latest and restarts


def _train(out, overrides, *flags):
    """``mmalign train`` in this process (the environment is the caller's: :func:`_launch_env`)."""
    return cli_main("train", "--output", str(out), *flags, *[a for o in overrides for a in ("--set", o)])


@pytest.fixture(scope="module")
def short_run(tmp_path_factory, shapes_dir):
    """An 8-step run with checkpoints at 4 and 8, and its overrides."""
    overrides = [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=8",
        "train.warmup_steps=1",
        "train.log_every=1",
        "train.checkpoint_every=4",
        "train.keep_checkpoints=3",
        "monitor.log_sample_keys=true",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        "eval.suite=none",
    ]
    out = tmp_path_factory.mktemp("short") / "run"
    with pytest.MonkeyPatch.context() as monkeypatch:
        _launch_env(monkeypatch)
        res = _train(out, overrides)
    assert res.returncode == 0, res.stderr[-3000:]
    return out, overrides


def _keys(out):
    return [
        (r["step"], r["keys"])
        for r in map(json.loads, (out / "samples_rank0.jsonl").read_text().splitlines())
    ]


@pytest.mark.integration
def test_resume_latest_before_the_first_save_is_a_fresh_start(short_run, tmp_path, monkeypatch):
    """The README's launch lines carry --resume latest: before any checkpoint (a new directory,
    or the leftovers of an attempt killed before its first save) it is exactly a fresh start."""
    ref, overrides = short_run
    out = tmp_path / "run"
    out.mkdir()
    # an attempt of this same line (its config.yaml) killed before its first save; another
    # config's leftovers are refused (tests/test_rundir*.py, issue 28 point 1)
    (out / "config.yaml").write_text((ref / "config.yaml").read_text())
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": 9.9}\n{"step": 2, "lo')
    (out / "samples_rank0.jsonl").write_text('{"step": 1, "keys": ["stale"]}\n')
    _launch_env(monkeypatch)
    res = _train(out, overrides, "--resume", "latest")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no checkpoint in" in res.stdout
    a, b = load_file(str(ref / "final/model.safetensors")), load_file(str(out / "final/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _keys(out) == _keys(ref)
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, 9)
    )


def _copy_run(src, dst):
    import shutil

    shutil.copytree(src, dst)
    step8 = dst / "checkpoints" / "step_00000008"
    return step8, (step8 / "trainer_rank0.pt").stat().st_mtime_ns


@pytest.mark.integration
@pytest.mark.parametrize(
    "flags", [["--resume", "STEP4"], ["--overwrite"], ["--overwrite", "--resume", "latest"]]
)
def test_torchrun_restart_keeps_the_checkpoints(short_run, tmp_path, flags, monkeypatch):
    """A restarted attempt runs the launch line again: --overwrite would delete this job's
    checkpoints, an older --resume PATH would rewind the run (and prune what is newer)."""
    ref, overrides = short_run
    out = tmp_path / "run"
    step8, written = _copy_run(ref, out)
    flags = [str(out / "checkpoints" / "step_00000004") if f == "STEP4" else f for f in flags]
    _launch_env(monkeypatch, TORCHELASTIC_RESTART_COUNT="1")
    res = _train(out, overrides, *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "torchrun restart 1: continuing the run from its latest checkpoint" in res.stdout
    assert "resumed from" in res.stdout and "at step 8" in res.stdout, res.stdout[-2000:]
    assert (step8 / "trainer_rank0.pt").stat().st_mtime_ns == written  # not re-saved, not removed
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000008"
    assert (out / "checkpoints" / "step_00000004").is_dir()


@pytest.mark.integration
def test_torchrun_restart_without_resume_says_what_to_add(short_run, tmp_path, monkeypatch):
    ref, overrides = short_run
    out = tmp_path / "run"
    _copy_run(ref, out)
    _launched_as(monkeypatch, TORCHELASTIC_RESTART_COUNT="2")
    res = _train(out, overrides)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "restart 2" in lines[0] and "--resume latest" in lines[0], res.stderr
    assert (out / "checkpoints" / "step_00000008").is_dir()


def test_every_readme_launch_line_resumes():
    """A launch line that a restart (or a relaunch after a failure) runs again must continue the
    run: every shell block of the README and of the guides in docs/ (README.md, docs/*.md)."""
    import re

    from tests.harness.doc_snippets import blocks, commands, pages

    shell = [b for page in pages() for b in blocks(page) if b.lang in {"bash", "sh", "shell", "console"}]
    lines = [c for b in shell for c in commands(b.code)]
    launches = [
        c
        for c in lines
        if re.match(
            r"(mmalign train|torchrun|srun|deepspeed|python -m mmalign\.cli train"
            r"|python -m mmalign\.(dist\.)?supervise)\b",
            c,
        )
    ]
    # the tour, --nproc, the supervised torchrun, srun, the DeepSpeed launcher
    assert len(launches) >= 5, launches
    assert any(c.startswith("python -m mmalign.dist.supervise torchrun") for c in launches), launches
    missing = [c for c in launches if "--resume latest" not in c]
    assert not missing, missing
    # a torchrun agent left alone after a split network never exits (issue 28): each runs supervised
    unsupervised = [
        c
        for c in launches
        if re.search(r"\btorchrun\b", c) and "python -m mmalign.dist.supervise torchrun" not in c
    ]
    assert not unsupervised, unsupervised


def test_lost_peer_is_one_line(monkeypatch):
    monkeypatch.setattr(mdist, "_timeout_s", 15.0)
    gloo = RuntimeError(
        "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 15000ms "
        "for send operation to complete\nmore detail"
    )
    line = mdist.lost_peer(gloo)
    assert line is not None and "\n" not in line
    assert (
        "lost contact with another rank" in line
        and "dist.timeout_s=15 s" in line
        and "--resume latest" in line
    )
    reset = RuntimeError(
        "[../gloo/transport/tcp/pair.cc:545] Read error [10.0.0.2]:3242: Connection reset by peer"
    )
    assert mdist.lost_peer(reset) is not None
    # not communication errors: reported as they are
    assert mdist.lost_peer(RuntimeError("DataLoader worker (pid 12) timed out after 5 seconds")) is None
    assert mdist.lost_peer(ValueError("connection reset by peer")) is None
    assert mdist.lost_peer(RuntimeError("gloo: invalid tensor size")) is None
