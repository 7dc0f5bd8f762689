"""``all_gather_with_grad``'s two collective paths (mmalign/dist/distributed.py): the flat all-gather +
reduce-scatter of NCCL and the list all-gather + all-reduce of gloo. Both run here on gloo (torch
2.14's gloo has the single-tensor collectives), 2 ranks with different rows, against the naive
full-batch float64 gradient."""

from __future__ import annotations

import torch

from mmalign.dist.distributed import gather_path
from tests.harness import run_ranks

B, D = 3, 5


def _full_batch(world: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(world * B, D, generator=g, dtype=torch.float64)  # every rank's rows differ


def _rank_loss(local: torch.Tensor, gathered: torch.Tensor, rank: int) -> torch.Tensor:
    """A loss that reads this rank's rows and every rank's, with a weight per rank, so that each
    rank's gradient on a row differs and only their sum is the full-batch gradient."""
    w = 1.0 + rank
    return w * torch.logsumexp(local @ gathered.T, dim=1).mean() + 0.1 * w * (gathered**3 * (rank + 2)).sum()


def _worker(rank: int, world: int) -> dict:
    from mmalign.dist import distributed as mdist

    counts = {"gather_single": 0, "reduce_scatter": 0, "all_reduce": 0, "all_gather": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    mdist._gather_single = counted("gather_single", mdist._gather_single)
    mdist._reduce_scatter_single = counted("reduce_scatter", mdist._reduce_scatter_single)
    mdist.dist.all_reduce = counted("all_reduce", mdist.dist.all_reduce)
    mdist.dist.all_gather = counted("all_gather", mdist.dist.all_gather)
    assert mdist.gather_path(mdist.dist.get_backend()) == "all_reduce"  # gloo's default
    full = _full_batch(world)
    out = {}
    for path in ("all_reduce", "single"):
        mdist.gather_path = lambda backend, path=path: path  # the path of this round, on gloo
        local = full[rank * B : (rank + 1) * B].clone().requires_grad_()
        before = dict(counts)
        gathered = mdist.all_gather_with_grad(local)
        _rank_loss(local, gathered, rank).backward()
        nograd = mdist.all_gather_nograd(local)
        out[path] = {
            "gathered": gathered.detach(),
            "nograd": nograd,
            "grad": local.grad,
            "calls": {k: counts[k] - before[k] for k in counts},
        }
    return out


def test_path_choice_follows_the_backend():
    assert gather_path("nccl") == "single"
    assert gather_path("cpu:gloo,cuda:nccl") == "single"
    assert gather_path("gloo") == "all_reduce"


def test_both_paths_give_the_full_batch_gradient():
    world = 2
    results = run_ranks(_worker, world, timeout_s=120, pooled=True)
    full = _full_batch(world).requires_grad_()
    total = sum(_rank_loss(full[r * B : (r + 1) * B], full, r) for r in range(world))  # sum_r L_r
    total.backward()
    for rank, res in enumerate(results):
        for path, got in res.items():
            assert torch.equal(got["gathered"], full.detach()), (rank, path)
            assert torch.equal(got["nograd"], full.detach()), (rank, path)
            torch.testing.assert_close(
                got["grad"],
                full.grad[rank * B : (rank + 1) * B],
                rtol=1e-12,
                atol=1e-12,
                msg=f"rank {rank}, path {path}",
            )
        # each path used its own collectives: one gather each (grad + nograd), one backward reduction
        assert res["single"]["calls"] == {
            "gather_single": 2,
            "reduce_scatter": 1,
            "all_reduce": 0,
            "all_gather": 0,
        }, res["single"]["calls"]
        assert res["all_reduce"]["calls"] == {
            "gather_single": 0,
            "reduce_scatter": 0,
            "all_reduce": 1,
            "all_gather": 2,
        }, res["all_reduce"]["calls"]
