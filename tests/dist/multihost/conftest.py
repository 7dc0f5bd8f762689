"""Fixtures of the two-host tests: the namespaces (skipped where they cannot be made), the
shared training arguments, and the one-host ``--nproc 2`` reference run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.dist.multihost.hosts import Hosts, Skip
from tests.harness import ROOT

# Seconds a whole run (start-up included) may take on a busy 2-core machine before a test fails.
RUN_LIMIT_S = 420


@pytest.fixture(scope="session")
def netns_ok(tmp_path_factory):
    """Skip (with the reason) where network namespaces cannot be made: not root, no iproute2."""
    probe = Hosts(tmp_path_factory.mktemp("netns-probe"))
    try:
        probe.open()
    except Skip as e:
        pytest.skip(str(e))
    finally:
        probe.close()


@pytest.fixture
def hosts(netns_ok, tmp_path):
    """Two namespaces hostA / hostB joined by a veth pair; everything is removed afterwards,
    whatever the test did (its processes are killed by PID, the namespaces deleted)."""
    h = Hosts(tmp_path)
    try:
        h.open()
    except Skip as e:
        h.close()
        pytest.skip(str(e))
    except BaseException:
        h.close()
        raise
    try:
        yield h
    finally:
        h.close()


@pytest.fixture(scope="session")
def train_argv(shapes_dir):
    """``train_argv(out, *overrides)``: the launch line of every case (micro preset, ZeRO-2,
    gradient caching, 12 steps, a checkpoint every 4, per-rank sample keys, no evaluation),
    with ``--resume latest`` as the README's launch lines carry it."""

    def argv(out, *overrides: str) -> list[str]:
        sets = [
            "model.preset=micro",
            f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
            f"data.val={shapes_dir}/val/00000.tar",
            "data.workers=0",
            "data.shuffle_buffer=50",
            "train.global_batch_size=16",
            "train.steps=12",
            "train.warmup_steps=2",
            "train.lr=0.002",
            "train.log_every=1",
            "train.checkpoint_every=4",
            "deepspeed.zero_stage=2",
            "train.grad_cache_chunk_size=4",
            "monitor.log_sample_keys=true",
            "monitor.probe_size=0",
            "monitor.tensorboard=false",
            "eval.suite=none",
            *overrides,
        ]
        out = ["train", "--output", str(out), "--resume", "latest"]
        for s in sets:
            out += ["--set", s]
        return out

    return argv


@pytest.fixture(scope="session")
def reference(netns_ok, tmp_path_factory, train_argv):
    """The same run as ``mmalign train --nproc 2`` on one host (its run directory)."""
    out = tmp_path_factory.mktemp("reference") / "run"
    res = subprocess.run(
        [sys.executable, "-m", "mmalign.cli", *train_argv(out), "--nproc", "2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=RUN_LIMIT_S,
    )
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return out
