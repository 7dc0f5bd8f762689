"""The fixtures every test may ask for (seed, gen, shapes_dir, micro_overrides) and the autouse
guards. Shared helpers and the naive references are in tests/harness/."""

import os
import random
import zlib

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import pick_seed
from tests.harness import ranks as _ranks  # noqa: F401 (installs the DeepSpeed autocast guard)

_TORCH_LINEAR = F.linear


@pytest.fixture(autouse=True)
def _torch_linear_restored():
    """A DeepSpeed ZeRO-3 engine replaces ``torch.nn.functional.linear`` with its own autograd
    function for the rest of the process (deepspeed/runtime/zero/partition_parameters.py); a
    test that builds one in-process must not change the arithmetic and saved tensors of the
    tests after it."""
    yield
    if F.linear is not _TORCH_LINEAR:
        F.linear = _TORCH_LINEAR


@pytest.fixture(scope="session", autouse=True)
def _rank_pool_closed():
    """The pooled ranks of run_ranks live for the session and end with it."""
    yield
    from tests.harness import rank_pool

    rank_pool.close()


@pytest.fixture(autouse=True)
def seed(request) -> int:
    """Every test's one seed (derive the others from it, so that one replay line replays them all).
    Its fixed default comes from the test's name (with its parameters, without its file: a file
    rename keeps it), so that tests draw different data. Python's, NumPy's and torch's global
    generators start from it too, so data drawn without an explicit generator replays as well."""
    value = pick_seed(zlib.crc32(request.node.name.encode()) % 2**31)
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    return value


@pytest.fixture
def gen(seed) -> torch.Generator:
    """A torch generator seeded with the test's seed."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture(scope="session")
def shapes_dir(tmp_path_factory):
    """A small generated shapes dataset (train: 2 shards of 200, val: 1 shard of 120)."""
    from data_pipelines import shapes

    out = tmp_path_factory.mktemp("shapes")
    shapes.generate_split(out, "train", 400, seed=3, per_shard=200)
    shapes.generate_split(out, "val", 120, seed=3, per_shard=200)
    return out


@pytest.fixture(scope="session")
def ema_run(tmp_path_factory, shapes_dir):
    """A 2-step micro run with train.ema_decay (final/, final_ema/ and a step-2 checkpoint), shared by
    the tests of --weights ema."""
    from tests.harness import cli_main

    out = tmp_path_factory.mktemp("ema_run") / "run"
    sets = [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.checkpoint_every=2",
        "train.ema_decay=0.5",
        "train.ema_warmup=false",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        "eval.suite=none",
    ]
    res = cli_main("train", "--output", out, *[a for s in sets for a in ("--set", s)])
    assert res.returncode == 0, res.stderr[-2000:]
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


# xdist groups: tests that share a host resource run on one worker, one after the other
_GROUPS = {
    "multihost": "tests/dist/multihost/",  # network namespaces and their fixed subnet
}


def _xdist_workers() -> int:
    return int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))


def pytest_configure(config):
    """Under xdist, each worker's torch gets its share of the cores: two workers of two intra-op
    threads each on two cores spend their time spinning and switching, not computing. The
    processes a test starts (mmalign commands, ranks) inherit the share."""
    workers = _xdist_workers()
    if workers > 1:
        share = max(1, (os.cpu_count() or 1) // workers)
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))  # the processes tests start, too


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.nodeid
        for group, prefix in _GROUPS.items():
            if path.startswith(prefix):
                item.add_marker(pytest.mark.xdist_group(group))
