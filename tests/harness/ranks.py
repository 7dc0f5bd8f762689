"""Several ranks from one test: spawned processes (or the session's pooled ones) set up as a
launcher would start them, and the micro-tower engine config and batches they share."""

import logging
import os

import torch


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

    ``pooled``: run on the session's long-lived ranks (tests/harness/rank_pool.py) instead of fresh ones,
    which saves each rank's seconds of start-up and imports; the pool resets what a task leaves
    behind. Fresh ranks remain for ``group=False`` (the worker is a whole program: ``train()``
    makes and ends its own group and signal handlers, as it does under a launcher), for more than
    the pool's ranks, and for tests whose subject is a process's one-time state."""
    if pooled:
        if not group:
            raise ValueError("run_ranks: pooled ranks always get their group; group=False needs fresh ranks")
        from tests.harness import rank_pool

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
