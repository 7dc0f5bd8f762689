import logging
import os
import random
import sys
import zlib
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


class _NestedAutocastIsAnError(logging.Handler):
    """DeepSpeed's "torch.autocast is enabled outside DeepSpeed but disabled within the DeepSpeed
    engine" warning means the towers silently ran in fp32 (issue 27): in tests it is an error.
    Raised from the logging call, so it leaves DeepSpeed's warn-once flag unset and fires every
    time. Installed at import, so the ranks spawned by run_ranks (which import this module) have it."""

    def emit(self, record: logging.LogRecord) -> None:
        if "disabled within the DeepSpeed engine" in record.getMessage():
            raise AssertionError(
                "DeepSpeed switched the caller's autocast off around the module: "
                "autocast must be entered inside the engine's module (mmalign.run.engine)"
            )


logging.getLogger("DeepSpeed").addHandler(_NestedAutocastIsAnError())


SEED_ENV = "MMALIGN_TEST_SEED"


def pick_seed(default: int) -> int:
    """The seed of a test's random data: ``default`` (fixed, so that a run replays), the integer in
    MMALIGN_TEST_SEED, or a fresh draw with MMALIGN_TEST_SEED=random. Printed either way with the
    line that replays it (pytest shows a test's output when it fails)."""
    value = os.environ.get(SEED_ENV, "").strip()
    if not value:
        seed = default
    elif value == "random":
        seed = random.SystemRandom().randrange(2**31)
    else:
        try:
            seed = int(value)
        except ValueError:
            raise pytest.UsageError(f"{SEED_ENV} must be an integer or 'random', not {value!r}") from None
    print(f"seed: {seed} (replay: {SEED_ENV}={seed})")
    return seed


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
    from tests import rank_pool

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

    return subprocess.run(
        [sys.executable, "-m", "mmalign.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=600,
    )


class CliRun(NamedTuple):
    """What :func:`cli_main` saw: the fields of :func:`run_cli`'s CompletedProcess that tests read."""

    returncode: int
    stdout: str
    stderr: str


def cli_main(*args, cwd=None) -> CliRun:
    """``mmalign ARGS`` called in this process (``mmalign.cli.main``), with what it printed to
    sys.stdout and sys.stderr. No interpreter start and no torch import (seconds per call in
    :func:`run_cli`): for what a user sees of an error path, a message, a help text or a short
    run. An exception that escapes main fails the test with its traceback (a process would print
    one and exit 1); SystemExit (--help, --version) gives its code as a process would. What the
    process itself does (signals, exit codes of a killed run, what the interpreter prints, what
    importing costs) stays with run_cli."""
    import contextlib
    import io

    from mmalign import cli

    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:  # argparse's --help and --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        os.chdir(previous)
    return CliRun(code, out.getvalue(), err.getvalue())


def clip_batch(n: int, seed: int, image_size: int = 16, context: int = 16):
    """(n, 3, S, S) random images and (n, L) token rows of random lengths (start token, a few
    random ids, end token, zero padding): the inputs of the engine exactness tests."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, image_size, image_size, generator=g)
    tokens = torch.randint(1, 49000, (n, context), generator=g)
    tokens[:, 0] = 49406
    ends = torch.randint(3, context - 1, (n,), generator=g)
    for i, e in enumerate(ends):
        tokens[i, e] = 49407
        tokens[i, e + 1 :] = 0
    return images, tokens


def naive_clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The symmetric CLIP loss written out over the full (B, B) logit matrix: the reference."""
    logits = scale * img @ txt.T  # (B, B)
    labels = torch.arange(img.shape[0], device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def chunkwise_clip_loss(outs) -> torch.Tensor:
    """The reference loss of chunks forwarded one by one (each with grad, in order): the naive CLIP
    loss of their features concatenated in chunk order, (B, D) each, at the first chunk's scale."""
    return naive_clip_loss(
        torch.cat([o.image for o in outs]), torch.cat([o.text for o in outs]), outs[0].logit_scale
    )


ENGINE_BATCH = 8  # global batch of the engine integration runs (4 rows per rank at 2 ranks)


def engine_cfg(stage: int, *extra: str):
    """A micro-tower engine config at ZeRO ``stage`` for 2-rank integration tests."""
    from mmalign.config import load_config

    return load_config(
        None,
        [
            "model.preset=micro",
            f"train.global_batch_size={ENGINE_BATCH}",
            "train.steps=4",
            "train.warmup_steps=1",
            "train.lr=0.01",
            f"deepspeed.zero_stage={stage}",
            *extra,
        ],
    )


def engine_batch(seed: int, rank: int, world: int):
    """This rank's slice of a random global batch of (16 px) images and token rows."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(ENGINE_BATCH, 3, 16, 16, generator=g)
    tokens = torch.randint(1, 49000, (ENGINE_BATCH, 16), generator=g)
    tokens[:, 0], tokens[:, 7], tokens[:, 8:] = 49406, 49407, 0
    local = ENGINE_BATCH // world
    return images[rank * local : (rank + 1) * local], tokens[rank * local : (rank + 1) * local]


def run_ranks(
    worker, world: int, *args, group: bool = True, timeout_s: float = 600, pooled: bool = False
) -> list:
    """Run ``worker(rank, world, *args)`` on ``world`` spawned processes and return what each returned,
    in rank order. Each process is set up as a launcher would start a rank (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR and a free loopback MASTER_PORT), with one torch thread (the ranks share
    the machine's cores) and, with ``group``, the gloo process group (one process gets it only when
    DeepSpeed asks; ``group=False`` leaves it to the worker, e.g. to ``train()``). A rank that fails
    or outlives ``timeout_s`` fails the test at once and the others are stopped, not waited for.

    ``pooled``: run on the session's long-lived ranks (tests/rank_pool.py) instead of fresh ones,
    which saves each rank's seconds of start-up and imports; the pool resets what a task leaves
    behind. Fresh ranks remain for ``group=False`` (the worker is a whole program: ``train()``
    makes and ends its own group and signal handlers, as it does under a launcher), for more than
    the pool's ranks, and for tests whose subject is a process's one-time state."""
    if pooled:
        if not group:
            raise ValueError("run_ranks: pooled ranks always get their group; group=False needs fresh ranks")
        from tests import rank_pool

        return rank_pool.run(worker, world, args, timeout_s)
    import tempfile
    import time

    import torch.multiprocessing as mp

    from mmalign.dist.distributed import free_port

    ctx = mp.get_context("spawn")
    port = int(free_port())
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [
            ctx.Process(target=_rank_main, args=(worker, r, world, port, args, group, out_dir))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while (
                any(p.is_alive() for p in procs)
                and time.monotonic() < deadline
                and all(p.exitcode in (None, 0) for p in procs)
            ):
                time.sleep(0.1)
        finally:
            codes = [p.exitcode for p in procs]
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        assert codes == [0] * world, (
            f"rank exit codes {codes} (None: stopped, still running when a rank "
            f"failed or at {timeout_s:.0f} s)"
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world)]


def _rank_main(worker, rank: int, world: int, port: int, args: tuple, group: bool, out_dir: str) -> None:
    """One spawned rank of :func:`run_ranks`: its result goes to a file, so that passing it on needs
    no collective (and works whether or not a process group is left)."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(1)
    from mmalign.dist import distributed as mdist

    if group:
        mdist.init_from_env(backend="gloo")
    result = worker(rank, world, *args)
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if mdist.is_initialized():
        mdist.barrier()  # no rank leaves the group while another still uses it
        mdist.shutdown()


def max_rel_error(got: dict, want: dict) -> tuple[float, str]:
    """The largest relative error over the floating-point tensors of a state dict (attention
    masks skipped), with the tensor's name."""
    return max(
        (float((got[n] - w).norm() / w.norm().clamp_min(1e-12)), n)
        for n, w in want.items()
        if w.is_floating_point() and not n.endswith("attn_mask")
    )
