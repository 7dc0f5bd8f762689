"""No per-step host sync that is not read (issue 20, point 4).

* A training step that writes no record makes no collective beyond the gradients' own
  (DeepSpeed's reduction and update, ZeRO-3's parameter fetches, the loss's feature gathers)
  and the finite-check guard's one all_reduce; a log step adds exactly the stats' one packed
  all_reduce.
* The logit-scale clamp makes no collective at any ZeRO stage, and leaves the scale clamped
  identically on every rank, in the fp32 master copy and in the consolidated checkpoint.
* The tiled losses' backward reads nothing back from the device (no ``.item()`` / ``bool()``),
  and its gradients still match a naive full-matrix float64 reference (also for a negative
  incoming gradient, which the sync-free weight folding must handle).

Collectives are counted by wrapping ``torch.distributed``'s functions (what both
mmalign.dist.distributed and DeepSpeed's communication backend call) and attributing each call to
the mmalign code that issued it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys

import pytest
import torch

from tests.dist.multihost.tracebacks import PACKAGE_DIR, package_path
from tests.harness import engine_batch, engine_cfg, run_ranks

COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "all_gather",
    "all_gather_into_tensor",
    "_all_gather_base",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "broadcast",
    "reduce",
    "all_gather_object",
    "broadcast_object_list",
    "all_to_all_single",
    "barrier",
)


def _issuer() -> str:
    """Who issued the collective being called: the innermost mmalign frame outside
    mmalign/dist/distributed.py (whose helpers only forward a caller's request), except the
    differentiable gather, whose backward is part of the loss's gradient. A frame is
    mmalign's when its file lies in the package's directory (a venv inside a checkout
    named mmalign puts torch under .../mmalign/.venv/ too)."""
    frame = sys._getframe(2)
    while frame is not None:
        inside = package_path(frame.f_code.co_filename)
        qual = frame.f_code.co_qualname
        if inside is None:
            pass
        elif inside.parts == ("dist", "distributed.py"):
            if "AllGather" in qual:
                return "gather"
        elif inside.parts[0] == "models":
            return "forward"
        else:
            return f"{inside.name}:{qual}"
        frame = frame.f_back
    return "outside mmalign"


class Collectives:
    """Counts torch.distributed collectives by (function, issuer) while active."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    @contextlib.contextmanager
    def counting(self):
        import torch.distributed as dist

        self.calls = []
        real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}

        def wrap(name, fn):
            def counted(*args, **kwargs):
                self.calls.append((name, _issuer()))
                return fn(*args, **kwargs)

            return counted

        for name, fn in real.items():
            setattr(dist, name, wrap(name, fn))
        try:
            yield self
        finally:
            for name, fn in real.items():
                setattr(dist, name, fn)

    def beyond_gradients(self) -> list[tuple[str, str]]:
        """The calls that are none of: DeepSpeed's backward and update (the gradient reduction,
        ZeRO's partition gathers), the towers' forward (ZeRO-3 fetches the parameters there) and
        the loss's feature gathers."""
        allowed = {
            "gather",
            "forward",
            "engine.py:Engine.forward",
            "engine.py:Engine._backward",
            "engine.py:Engine.step.<locals>.update",
        }
        return sorted(c for c in self.calls if c[1] not in allowed)


GUARD = ("all_reduce", "engine.py:Engine._all_finite")
STATS = ("all_reduce", "objective.py:Objective._finish_stats")


def _step_worker(rank, world, seed):
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine
    from mmalign.run.train import _Parts, _Tally, _train_step, logs_at

    class Runlog:  # what _train_step asks of the run log
        def sample_keys(self, step, keys):
            pass

    counter, results = Collectives(), {}
    for name, stage, extra in (
        ("zero0", 0, ()),
        ("zero1_cached", 1, ("train.grad_cache_chunk_size=2",)),
        ("zero3", 3, ()),
    ):
        cfg = engine_cfg(stage, "train.log_every=2", *extra)
        torch.manual_seed(seed)
        engine = Engine(build_model(cfg.model), cfg)
        objective = build_objective(cfg, world)
        parts = _Parts(
            cfg,
            None,
            torch.device("cpu"),
            world,
            1.0,
            1.0,
            0,
            None,
            None,
            engine,
            None,
            None,
            objective,
            contextlib.nullcontext,
            None,
        )
        batches = iter([Batch(*engine_batch(seed + k, rank, world)) for k in range(2)])
        seen = []
        for step in (1, 2):
            with counter.counting():
                _, result = _train_step(parts, step, batches, _Tally(), Runlog())
            seen.append(
                (logs_at(cfg.train, step), counter.beyond_gradients(), sorted(result.stats), result.skipped)
            )
        results[name] = seen
    return results


def _issuer_through(filename: str, qualname: str) -> str:
    """_issuer as seen from a collective called by a function compiled as ``filename``."""
    ns: dict = {}
    exec(compile(f"def {qualname}(counted):\n    return counted()\n", filename, "exec"), ns)
    return ns[qualname](lambda: _issuer())  # the lambda stands for Collectives' counting wrapper


def test_the_issuer_is_told_by_the_package_location_not_a_folder_name(tmp_path):
    torch_file = (
        tmp_path / "mmalign" / ".venv" / "lib" / "site-packages" / "torch" / "distributed" / "c10d_logger.py"
    )
    assert _issuer_through(str(torch_file), "wrapper") == "outside mmalign"
    assert _issuer_through(str(tmp_path / "models" / "vit.py"), "forward") == "outside mmalign"
    assert _issuer_through(str(PACKAGE_DIR / "run" / "engine.py"), "_all_finite") == "engine.py:_all_finite"
    assert _issuer_through(str(PACKAGE_DIR / "models" / "vit.py"), "block") == "forward"
    assert (
        _issuer_through(str(PACKAGE_DIR / "dist" / "distributed.py"), "all_reduce_sum") == "outside mmalign"
    )


@pytest.mark.integration
def test_a_non_log_step_makes_no_collective_beyond_the_gradients_and_the_guard(seed):
    for rank_results in run_ranks(_step_worker, 2, seed, pooled=True):
        for name, ((log1, calls1, stats1, skip1), (log2, calls2, stats2, skip2)) in rank_results.items():
            assert (log1, log2) == (False, True) and not skip1 and not skip2, name
            assert calls1 == [GUARD], (name, calls1)  # no stats, no clamp collective
            assert stats1 == [], name  # nothing computed that nobody reads
            assert calls2 == sorted([GUARD, STATS]), (
                name,
                calls2,
            )  # the log step: one packed stats reduction
            assert {"loss", "pos_rank", "top1", "logit_scale"} <= set(stats2), name


@contextlib.contextmanager
def host_reads(calls: list):
    """Records every read of a tensor's value into Python (what a host sync needs) as (method,
    the reading frame's file:function), and lets it happen."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__")
    real = {n: getattr(torch.Tensor, n) for n in names}

    def counted(name):
        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            calls.append((name, f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_qualname}"))
            return real[name](self, *args, **kwargs)

        return read

    for n in names:
        setattr(torch.Tensor, n, counted(n))
    try:
        yield calls
    finally:
        for n, fn in real.items():
            setattr(torch.Tensor, n, fn)


def _one_rank_worker(rank, world, seed):
    """One process, fp32: a non-log step's collectives and host reads at each configured stage."""
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine
    from mmalign.run.train import _Parts, _Tally, _train_step

    class Runlog:
        def sample_keys(self, step, keys):
            pass

    counter, results = Collectives(), {}
    for stage, extra in (
        (0, ()),
        (1, ()),
        (2, ()),
        (1, ("train.grad_cache_chunk_size=4",)),
        (0, ("train.grad_cache_chunk_size=4",)),
        (1, ("train.grad_clip=1.0",)),
        (0, ("train.grad_clip=1.0",)),
    ):
        cfg = engine_cfg(stage, "train.log_every=2", *extra)
        torch.manual_seed(seed)
        engine = Engine(build_model(cfg.model), cfg)
        parts = _Parts(
            cfg,
            None,
            torch.device("cpu"),
            1,
            1.0,
            1.0,
            0,
            None,
            None,
            engine,
            None,
            None,
            build_objective(cfg, 1),
            contextlib.nullcontext,
            None,
        )
        batches = iter([Batch(*engine_batch(seed, 0, 1))])
        reads = []
        with counter.counting(), host_reads(reads):
            _, result = _train_step(parts, 1, batches, _Tally(), Runlog())  # step 1: not a log step
        results[stage, extra] = (counter.calls, sorted(reads), result.skipped)
    return results


@pytest.mark.integration
def test_one_rank_zero1_and_zero2_make_no_sync_beyond_zero0s(seed):
    """One process with fp32 weights runs ZeRO-1/2 configs at ZeRO-0 (mmalign/run/zero_stage.py): DeepSpeed's
    ZeRO optimizer made three all_reduces (over one rank) and read its global norm back each step."""
    out = run_ranks(_one_rank_worker, 1, seed, pooled=True)[0]
    zero0 = out[0, ()]
    calls, reads, skipped = zero0
    assert calls == [] and not skipped  # one rank: the finite-check guard needs no all_reduce either
    assert ("item", "engine.py:Engine._all_finite") in reads  # the guard's one read (the step's control flow)
    for (stage, extra), got in out.items():
        assert got == out[0, extra], (stage, extra, got, out[0, extra])  # ZeRO-0's calls and reads, no more


def _clamp_worker(rank, world, seed, ckpt_dir):
    from mmalign.data.batch import Batch
    from mmalign.dist import distributed as mdist
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine, consolidate_checkpoint

    counter, results = Collectives(), {}
    for name, stage, extra in (
        ("zero0", 0, ()),
        ("zero1", 1, ()),
        ("zero2_bf16", 2, ("deepspeed.precision=bf16",)),
        ("zero3", 3, ()),
    ):
        # start above ln 100; one small SGD step cannot bring it back under
        cfg = engine_cfg(stage, "model.init_logit_scale=5.0", "train.optimizer=sgd", "train.lr=1e-4", *extra)
        torch.manual_seed(seed)
        engine = Engine(build_model(cfg.model), cfg)
        calls = []
        real = engine.clamp_logit_scale

        def clamp():
            with counter.counting():
                real()
            calls.extend(counter.calls)

        engine.clamp_logit_scale = clamp
        engine.step(Batch(*engine_batch(seed + 1, rank, world)), build_objective(cfg, world))
        param = (
            engine.module.logit_scale.detach().reshape(-1)[0].clone() if stage < 3 else None
        )  # whole at 0-2
        seen = (
            engine.forward(*engine_batch(seed, rank, world)).logit_scale.detach().reshape(-1)[0]
        )  # exp (ZeRO-3 gathers)
        master = engine.full_params(master=True)["logit_scale"].reshape(-1)[
            0
        ]  # the fp32 master (a collective)
        engine.save_checkpoint(ckpt_dir, name)
        mdist.barrier()
        stored = consolidate_checkpoint(ckpt_dir, name)["logit_scale"].reshape(-1)[0] if rank == 0 else None
        results[name] = (calls, param, seen.clone(), master.clone(), stored)
    return results


@pytest.mark.integration
def test_the_clamp_makes_no_collective_and_agrees_on_every_rank_and_in_checkpoints(tmp_path, seed):
    ranks = run_ranks(_clamp_worker, 2, seed, str(tmp_path / "ckpt"), pooled=True)
    ln100 = torch.tensor(math.log(100.0), dtype=torch.float32)
    for name in ranks[0]:
        want_module = ln100.to(torch.bfloat16) if name.endswith("bf16") else ln100
        for rank, results in enumerate(ranks):
            calls, param, seen, master, _ = results[name]
            assert calls == [], (name, rank, calls)
            if param is not None:  # the module's copy (whole below ZeRO-3)
                assert param.dtype == want_module.dtype and torch.equal(param, want_module), (
                    name,
                    rank,
                    param,
                )
            assert torch.equal(seen, want_module.exp()), (
                name,
                rank,
                seen,
            )  # what the forward uses: exp(ln 100)
            assert torch.equal(master, ln100), (name, rank, master)
        stored = ranks[0][name][4]
        assert torch.equal(stored, ln100), (name, stored)


# ------------------------------------------------------------ the tiled backward


@contextlib.contextmanager
def no_host_reads():
    """Any read of a tensor's value into Python raises (what a host sync needs)."""
    names = ("item", "tolist", "__bool__", "__float__", "__int__")
    real = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(self, *args, **kwargs):
        raise AssertionError("host read of a device tensor in the tiled backward")

    for n in names:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, fn in real.items():
            setattr(torch.Tensor, n, fn)


def _features(n_rows, n_cols, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = torch.nn.functional.normalize(torch.randn(n_rows, dim, generator=g, dtype=torch.float64), dim=1)
    cols = torch.nn.functional.normalize(torch.randn(n_cols, dim, generator=g, dtype=torch.float64), dim=1)
    scale = torch.tensor(7.0, dtype=torch.float64)
    ids_r = torch.randint(0, 3, (n_rows,), generator=g)
    ids_c = torch.cat([ids_r, torch.randint(0, 3, (n_cols - n_rows,), generator=g)])
    weights = torch.randn(n_rows, generator=g, dtype=torch.float64)  # of both signs, and one zero
    weights[1] = 0.0
    return rows, cols, scale, ids_r, ids_c, weights


def _grads(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]
    out = fn(*leaves)
    return out, leaves


def _backward_without_reads_matches(got, got_leaves, want, want_leaves) -> None:
    """``got``'s backward reads nothing back to the host; loss and leaf gradients equal the reference's."""
    with no_host_reads():
        got.backward()
    want.backward()
    torch.testing.assert_close(got, want)
    for a, b in zip(got_leaves, want_leaves):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("select", ["all", "neg", "pos"])
@pytest.mark.parametrize("ids", [False, True])
def test_the_tiled_lse_backward_reads_nothing_back_and_matches_the_reference(select, ids):
    from mmalign.losses.positives import Positives
    from mmalign.losses.tiled import tiled_lse

    rows, cols, scale, ids_r, ids_c, w = _features(6, 10)
    pos = Positives(0, ids_r, ids_c) if ids else Positives(0)
    mask = (ids_r[:, None] == ids_c[None]) if ids else torch.eye(6, 10, dtype=torch.bool)  # (M, N) positives
    want_cols = select == "all"
    w_col = torch.linspace(-1.0, 1.0, 10, dtype=torch.float64)

    def tiled(r, c, s):
        lse_r, lse_c, _, _ = tiled_lse(
            r, c, s, 4, want_cols=want_cols, positives=pos, track=False, select=select
        )
        total = (w * lse_r.masked_fill(lse_r == -math.inf, 0.0)).sum()
        return total + ((w_col * lse_c).sum() if want_cols else 0.0)

    def naive(r, c, s):  # the full (M, N) matrix, float64
        logits = s * r @ c.T
        keep = {"all": torch.ones_like(mask), "neg": ~mask, "pos": mask}[select]
        lse_r = torch.logsumexp(logits.masked_fill(~keep, -math.inf), dim=1)
        has = keep.any(dim=1)
        total = (w * torch.where(has, lse_r, torch.zeros_like(lse_r))).sum()
        return total + ((w_col * torch.logsumexp(logits, dim=0)).sum() if want_cols else 0.0)

    got, got_leaves = _grads(tiled, rows, cols, scale)
    want, want_leaves = _grads(naive, rows, cols, scale)
    _backward_without_reads_matches(got, got_leaves, want, want_leaves)


@pytest.mark.parametrize("ids", [False, True])
def test_the_tiled_sigmoid_backward_reads_nothing_back_and_matches_the_reference(ids):
    from mmalign.losses.positives import Positives
    from mmalign.losses.tiled_sigmoid import tiled_sigmoid_rows

    rows, cols, scale, ids_r, ids_c, w = _features(6, 10)
    bias = torch.tensor(-2.0, dtype=torch.float64)
    pos = Positives(0, ids_r, ids_c) if ids else Positives(0)
    mask = (ids_r[:, None] == ids_c[None]) if ids else torch.eye(6, 10, dtype=torch.bool)

    def tiled(r, c, s, b):
        return (w * tiled_sigmoid_rows(r, c, s, b, 4, positives=pos, track=False)[0]).sum()

    def naive(r, c, s, b):
        z = mask.to(r.dtype) * 2 - 1  # +1 positives, -1 negatives
        return (w * -torch.nn.functional.logsigmoid(z * (s * r @ c.T + b)).sum(dim=1)).sum()

    got, got_leaves = _grads(tiled, rows, cols, scale, bias)
    want, want_leaves = _grads(naive, rows, cols, scale, bias)
    _backward_without_reads_matches(got, got_leaves, want, want_leaves)
