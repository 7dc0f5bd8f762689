"""Same weights through the CLI: gradient caching on == off (one SGD step, no dropout)."""

import pytest
from safetensors.torch import load_file

from tests.harness import ROOT, cli_main, run_cli

pytestmark = pytest.mark.integration


def _train(out, overrides, nproc=1, extra=()):
    args = ["train", "--config", str(ROOT / "configs/quickstart.yaml"), "--output", str(out)]
    if nproc > 1:
        args += ["--nproc", str(nproc)]
    for o in [*overrides, "train.steps=1", "train.optimizer=sgd", "train.warmup_steps=0", *extra]:
        args += ["--set", o]
    # one rank runs in this process; --nproc N runs where its ranks print, a process of its own
    # whose pipes carry their lines
    res = cli_main(*args) if nproc == 1 else run_cli(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    return load_file(str(out / "final" / "model.safetensors"))


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        rel = float((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-12))
        assert rel <= 1e-5, (k, rel)


def _quiet(overrides):
    return [o for o in overrides if not o.startswith(("output=", "train.steps", "train.warmup"))]


def test_cached_equals_uncached_single_process(micro_overrides, tmp_path):
    ov = _quiet(micro_overrides)
    off = _train(tmp_path / "off", ov)
    on = _train(tmp_path / "on", ov, extra=["train.grad_cache_chunk_size=10"])  # 32 -> 10, 10, 10, 2
    _assert_same(on, off)


# The CLI path (launcher, loader, engine) at the two ends of ZeRO; every stage x ranks x chunking
# is checked against the full-batch reference at the engine level (tests/run/test_engine_exact.py).
# Both are `slow` (make test-all): make test keeps the single-process CLI check below and the
# 2-rank engine-level checks of every stage against the full-batch reference.
@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_cached_equals_uncached_two_processes(micro_overrides, tmp_path, stage):
    ov = _quiet(micro_overrides) + [f"deepspeed.zero_stage={stage}"]
    off = _train(tmp_path / "off", ov, nproc=2)
    on = _train(tmp_path / "on", ov, nproc=2, extra=["train.grad_cache_chunk_size=6"])  # 16 -> 6, 6, 4
    _assert_same(on, off)


def test_deepspeed_launcher_two_ranks(micro_overrides, tmp_path):
    """The same config under the `deepspeed` launcher (which inserts --local_rank=N)."""
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ds"
    cmd = [
        str(Path(sys.executable).parent / "deepspeed"),
        "--num_gpus",
        "2",
        "--master_port",
        str(port),
        "--module",
        "mmalign.cli",
        "train",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--output",
        str(out),
    ]
    for o in _quiet(micro_overrides) + ["train.steps=2", "train.warmup_steps=1"]:
        cmd += ["--set", o]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert "world size 2" in res.stdout
    assert (out / "final" / "model.safetensors").is_file()
