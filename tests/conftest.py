import os
import random
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gen() -> torch.Generator:
    """A fresh random generator per test; its seed is printed so a failure can be replayed."""
    seed = int(os.environ.get("MMALIGN_TEST_SEED") or random.SystemRandom().randrange(2**31))
    print(f"random seed: {seed} (replay: MMALIGN_TEST_SEED={seed})")  # shown on failure
    return torch.Generator().manual_seed(seed)


def unit(gen: torch.Generator, b: int, d: int, dtype=torch.float32) -> torch.Tensor:
    """(b, d) random unit vectors, drawn in float64."""
    return F.normalize(torch.randn(b, d, generator=gen, dtype=torch.float64), dim=1).to(dtype)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """A small generated shapes dataset (train: 2 shards of 200, val: 1 shard of 120)."""
    from data_pipelines import shapes

    out = tmp_path_factory.mktemp("shapes")
    shapes.generate_split(out, "train", 400, seed=3, per_shard=200)
    shapes.generate_split(out, "val", 120, seed=3, per_shard=200)
    return out


@pytest.fixture
def micro_overrides(shapes_dir, tmp_path):
    """Overrides that make any config a seconds-long CPU run on the generated data."""
    return [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=32",
        "train.steps=20",
        "train.warmup_steps=2",
        "train.lr=0.002",
        "train.log_every=1",
        f"output={tmp_path / 'run'}",
    ]


def run_cli(*args, cwd=None):
    import subprocess

    return subprocess.run([sys.executable, "-m", "mmalign.cli", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=600)


def spawn_ranks(worker, world: int, args: tuple, out_path) -> object:
    """Run ``worker(rank, world, port, *args)`` on ``world`` spawned processes (gloo on a free
    loopback port), require every one to exit cleanly, and return what rank 0 saved at ``out_path``."""
    import torch.multiprocessing as mp

    from mmalign.distributed import free_port

    ctx = mp.get_context("spawn")
    port = int(free_port())
    procs = [ctx.Process(target=worker, args=(r, world, port, *args)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0
    return torch.load(out_path, weights_only=False)
