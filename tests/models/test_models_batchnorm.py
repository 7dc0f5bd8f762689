"""BatchNorm towers (``model.batchnorm``) under gradient caching, ranks and ZeRO.

References are plain torch, written here: the ``micro-rn`` model with torch's own
BatchNorm2d, one forward of the whole global batch, a naive float32 CLIP loss, one
SGD step.  ``frozen`` is compared with the reference whose BatchNorm layers are in
eval mode; ``sync`` (2 ranks, no caching) and ``local`` (1 process, no caching) with
the train-mode one, whose running statistics torch itself updates once.  Gradients
and parameters to <= 1e-5 relative (default torch BatchNorm under 2-chunk caching is
~0.6 off), running statistics to <= 1e-5.
"""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn

from mmalign.config import ConfigError, ModelConfig
from mmalign.models import build_model
from mmalign.models.batchnorm import BatchNorm, StepStatistics, check_batchnorm, convert_batchnorm
from mmalign.run.gradcache import chunk_sizes
from tests.harness import clip_batch, naive_clip_loss, run_cli, run_ranks

GLOBAL_BATCH = 12
FP32_SLACK = 4.0  # the engine's float32 and plain torch's round differently: same order, not same value
LR = 0.5
BUFFERS = ("running_mean", "running_var", "num_batches_tracked")


# ----------------------------------------------------------- the layer alone


@pytest.mark.parametrize("momentum", [0.1, None])
def test_local_and_sync_layers_outside_a_step_are_torchs_batchnorm(momentum):
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4, momentum=momentum))
    for mode in ("local", "sync"):
        ours = copy.deepcopy(ref)
        assert convert_batchnorm(ours, mode) == 1 and isinstance(ours[1], BatchNorm)
        theirs = copy.deepcopy(ref)
        for _ in range(3):
            x = torch.randn(5, 3, 8, 8) * 3 + 1
            a, b = theirs(x), ours(x)
            torch.testing.assert_close(b, a, rtol=0, atol=0)
            (a * x[:, :1, 1:-1, 1:-1]).sum().backward()
            (b * x[:, :1, 1:-1, 1:-1]).sum().backward()
            for name in BUFFERS:
                torch.testing.assert_close(getattr(ours[1], name), getattr(theirs[1], name), rtol=0, atol=0)
        assert int(ours[1].num_batches_tracked) == 3
        for p, q in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
        ours.eval(), theirs.eval()
        torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
        assert list(ours.state_dict()) == list(theirs.state_dict())
        plain = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
        plain.load_state_dict(ours.state_dict(), strict=True)  # same names: exports unchanged


def test_frozen_layer_uses_running_statistics_in_train_mode_and_never_updates_them():
    torch.manual_seed(1)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ref[1].running_mean.normal_()
    ref[1].running_var.uniform_(0.5, 2.0)
    ours = copy.deepcopy(ref)
    convert_batchnorm(ours, "frozen")
    ours.train()
    ref.eval()
    before = {k: v.clone() for k, v in ours.state_dict().items()}
    x = torch.randn(5, 3, 8, 8)
    torch.testing.assert_close(ours(x), ref(x), rtol=0, atol=0)
    ours(x).sum().backward()
    assert ours[1].weight.grad is not None and ours[1].bias.grad is not None  # affine still trains
    for k, v in ours.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_step_statistics_record_once_and_commit_one_update():
    """Chunks of a step, re-forwards in replay, one commit == one full-batch forward of torch's."""
    torch.manual_seed(2)
    ref = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    ours = copy.deepcopy(ref)
    convert_batchnorm(ours, "local")
    x = torch.randn(10, 3, 8, 8) * 2 - 1
    ref(x)
    with StepStatistics(ours) as bn:
        for part in x.split([4, 4, 2]):
            ours(part)
        with bn.replay():
            ours(x[:4])  # a re-forward: not recorded
        for name in BUFFERS:  # nothing touched before the commit
            assert torch.equal(getattr(ours[1], name), getattr(nn.BatchNorm2d(4), name)), name
        bn.commit()
    for name in BUFFERS:
        torch.testing.assert_close(getattr(ours[1], name), getattr(ref[1], name), rtol=1e-5, atol=1e-6)
    with StepStatistics(ours):  # a step that does not commit (skipped) changes nothing
        ours(x)
    torch.testing.assert_close(ours[1].running_var, ref[1].running_var, rtol=1e-5, atol=1e-6)
    assert int(ours[1].num_batches_tracked) == 1


def test_build_model_converts_and_keeps_state_dict_names():
    plain = build_model(ModelConfig(preset="micro-rn"))
    n_bn = sum(isinstance(m, nn.BatchNorm2d) for m in plain.modules())
    assert n_bn > 0
    for mode in ("frozen", "sync", "local"):
        model = build_model(ModelConfig(preset="micro-rn", batchnorm=mode))
        layers = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert len(layers) == n_bn and all(isinstance(m, BatchNorm) and m.mode == mode for m in layers)
        assert list(model.state_dict()) == list(plain.state_dict())
    vit = build_model(ModelConfig(preset="micro", batchnorm="sync"))  # no BatchNorm: the mode is ignored
    assert not any(isinstance(m, BatchNorm) for m in vit.modules())


def test_config_error_without_a_mode_under_caching_or_ranks():
    model = build_model(ModelConfig(preset="micro-rn"))
    for chunks, world in ((2, 1), (1, 2)):
        with pytest.raises(ConfigError) as e:
            check_batchnorm(model, None, chunks=chunks, world_size=world)
        msg = str(e.value)
        assert "\n" not in msg and "model.batchnorm" in msg and "frozen | sync | local" in msg, msg
    assert check_batchnorm(model, None, chunks=1, world_size=1) is None  # the quickstart: plain BatchNorm
    assert check_batchnorm(build_model(ModelConfig(preset="micro")), None, chunks=2, world_size=2) is None
    line = check_batchnorm(model, "local", chunks=3, world_size=2)
    assert "ghost" in line and all(
        isinstance(m, BatchNorm) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
    )
    from mmalign.config import load_config

    with pytest.raises(ConfigError, match="model.batchnorm"):
        load_config(None, ["model.batchnorm=global"])


@pytest.mark.integration
def test_cli_refuses_a_batchnorm_tower_on_two_processes_before_spawning(tmp_path):
    (tmp_path / "00000.tar").touch()  # a shard by name: the shards are checked before the towers
    result = run_cli(
        "train",
        "--nproc",
        "2",
        "--set",
        "model.preset=micro-rn",
        "--set",
        "train.global_batch_size=8",
        "--output",
        str(tmp_path / "run"),
        "--set",
        f"data.train={tmp_path / '00000.tar'}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "model.batchnorm" in lines[0] and "frozen | sync | local" in lines[0], (
        result.stderr
    )
    assert not (tmp_path / "run").exists()  # refused before any rank started


# ------------------------------------------------------ engine vs references


def _inputs(seed: int):
    return clip_batch(GLOBAL_BATCH, seed, image_size=32)


@torch.no_grad()
def _random_stats(model: nn.Module, seed: int) -> None:
    """Non-trivial running statistics, so that ``frozen`` is more than an affine map."""
    g = torch.Generator().manual_seed(seed)
    for name, buf in model.named_buffers():
        if name.endswith("running_mean"):
            buf.copy_(torch.randn(buf.shape, generator=g) * 0.1)
        elif name.endswith("running_var"):
            buf.copy_(torch.rand(buf.shape, generator=g) * 1.5 + 0.5)


def _reference(model_seed: int, data_seed: int, groups: list[list[int]] | None, dtype=torch.float64):
    """Plain torch in float64 with torch's BatchNorm2d; returns (grads, params after SGD,
    buffers after).

    ``groups=None``: BatchNorm in eval mode (what ``frozen`` must equal).  Else train
    mode, each group of rows of the global batch forwarded on its own (normalised with
    its own statistics), the naive loss over all rows, and the running statistics
    updated ONCE from every row's BatchNorm input (momentum 0.1, unbiased variance).
    One group = one uncached full-batch step.  Float64 because train-mode BatchNorm's
    own fp32 rounding already puts the attention pool's q/k gradients up to ~3e-5 from
    float64 (measured on this model). ``dtype=torch.float32``: the same in float32, to measure
    how far float32 itself is from float64 on this draw."""
    torch.manual_seed(model_seed)
    model = build_model(ModelConfig(preset="micro-rn"))
    _random_stats(model, model_seed)
    model.to(dtype)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}
    initial = {n: {k: getattr(m, k).clone() for k in BUFFERS} for n, m in layers.items()}
    inputs = {n: [] for n in layers}
    for n, m in layers.items():
        m.train(groups is not None)
        m.register_forward_pre_hook(lambda mod, args, n=n: inputs[n].append(args[0].detach()))
    images, tokens = _inputs(data_seed)
    outs = [model(images[g].to(dtype), tokens[g]) for g in (groups or [list(range(GLOBAL_BATCH))])]
    img = torch.cat([o.image for o in outs])  # (B, D) in group order: the loss is
    txt = torch.cat([o.text for o in outs])  # invariant to a joint permutation of pairs
    naive_clip_loss(img, txt, outs[0].logit_scale).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.clamp_logit_scale()
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, m in layers.items():  # torch updated once per group: redo it once per step
            for k in BUFFERS:
                getattr(m, k).copy_(initial[n][k])
            if groups is not None:
                x = torch.cat(inputs[n])  # (B, C, H, W): every row once
                var, mean = torch.var_mean(x, dim=(0, 2, 3), unbiased=True)
                m.running_mean.mul_(0.9).add_(0.1 * mean)
                m.running_var.mul_(0.9).add_(0.1 * var)
                m.num_batches_tracked.add_(1)
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    return grads, params, buffers


def _groups(mode: str, chunk: int, world: int) -> list[list[int]] | None:
    """The rows each forward normalises together: one rank's chunk (local) or the same
    chunk of every rank (sync)."""
    if mode == "frozen":
        return None
    local = GLOBAL_BATCH // world
    sizes = chunk_sizes(local, chunk)
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    per_rank = [
        [list(range(r * local + s, r * local + s + n)) for s, n in zip(starts, sizes)] for r in range(world)
    ]
    if mode == "local":
        return [g for rank in per_rank for g in rank]
    return [sum((per_rank[r][c] for r in range(world)), []) for c in range(len(sizes))]


def _cfg(mode, stage: int, chunk: int):
    from mmalign.config import load_config

    return load_config(
        None,
        [
            "model.preset=micro-rn",
            f"train.global_batch_size={GLOBAL_BATCH}",
            "train.steps=1",
            "train.warmup_steps=0",
            "train.optimizer=sgd",
            f"train.lr={LR}",
            "train.weight_decay=0.0",
            f"train.grad_cache_chunk_size={chunk}",
            f"deepspeed.zero_stage={stage}",
            f"model.batchnorm={'null' if mode is None else mode}",
        ],
    )


# (mode, ZeRO stage, chunk size, loss made non-finite)
CASES = {
    1: [
        ("frozen", 0, 6, False),
        ("frozen", 0, 5, False),
        ("frozen", 2, 5, False),
        ("local", 0, 0, False),
        ("local", 0, 6, False),
        ("local", 0, 5, False),
        ("local", 0, 6, True),
        ("local", 0, 0, True),
    ],
    2: [
        ("frozen", 0, 0, False),
        ("frozen", 0, 3, False),
        ("frozen", 3, 4, False),
        ("sync", 0, 0, False),
        ("sync", 0, 4, False),
        ("local", 0, 3, False),
    ],
}


def _worker(rank: int, world: int, model_seed: int, data_seed: int) -> dict:
    from mmalign.data.batch import Batch
    from mmalign.dist import distributed as mdist
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    images, tokens = _inputs(data_seed)
    local = GLOBAL_BATCH // world
    images, tokens = images[rank * local : (rank + 1) * local], tokens[rank * local : (rank + 1) * local]
    results = {}
    # no mode: refused before DeepSpeed is built (caching on 1 process; 2 processes without caching)
    cfg = _cfg(None, 0, 6 if world == 1 else 0)
    try:
        Engine(build_model(cfg.model), cfg)
        results["error"] = None
    except ConfigError as e:
        results["error"] = str(e)
    for mode, stage, chunk, poison in CASES[world]:
        cfg = _cfg(mode, stage, chunk)
        torch.manual_seed(model_seed)
        model = build_model(cfg.model)
        _random_stats(model, model_seed)
        engine = Engine(model, cfg)
        objective = build_objective(cfg)
        captured = {}
        batch = Batch(images, tokens)

        def loss_of(out):
            result = objective(out, batch)
            return types.SimpleNamespace(loss=result.loss * float("nan"), stats={}) if poison else result

        # the objective whose loss is NaN when poisoned
        poisoned = types.SimpleNamespace(loss_for=lambda batch, stats=None: loss_of)
        step = engine.step(batch, poisoned, before_update=lambda: captured.update(engine.full_grads()))
        state = engine.consolidated_state_dict()
        buffers = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
        gathered = [mdist.all_gather_nograd(buffers[n].double().reshape(1, -1)) for n in sorted(buffers)]
        same_on_ranks = all(torch.equal(g[0], g[-1]) for g in gathered)
        if rank == 0:
            results[(mode, stage, chunk, poison)] = (
                engine.plan.chunks,
                step.skipped,
                captured,
                state,
                buffers,
                same_on_ranks,
            )
    return results


def _rel(a: torch.Tensor, b: torch.Tensor, floor: float = 1e-12) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(floor))


def _close(
    got: dict,
    ref: dict,
    what: str,
    case,
    tol: float = 1e-5,
    tensor_tol: float | None = None,
    ref32: dict | None = None,
) -> None:
    """Over the whole set to ``tol``, and per tensor to ``tensor_tol`` (default ``tol``)
    relative to max(its norm, 1e-4 x the set's): some gradients are float noise around an
    exact zero (the attention pool's key bias: softmax ignores a shift shared by all keys).
    With ``ref32`` (the reference computed in float32), each bound is at least FP32_SLACK x
    plain float32's own distance from float64 on this draw: the problem's conditioning."""
    total = float(torch.linalg.vector_norm(torch.stack([r.double().norm() for r in ref.values()])))

    base = tol if tensor_tol is None else tensor_tol
    for n, r in ref.items():
        assert got[n] is not None, (case, what, n)
        err, limit = _rel(got[n], r, 1e-4 * total), base
        if ref32 is not None:
            limit = max(limit, FP32_SLACK * _rel(ref32[n], r, 1e-4 * total))
        assert err <= limit, (case, what, n, err, limit)

    def flat(d: dict) -> torch.Tensor:
        return torch.cat([d[n].double().reshape(-1) for n in ref])

    limit = tol if ref32 is None else max(tol, FP32_SLACK * _rel(flat(ref32), flat(ref)))
    assert _rel(flat(got), flat(ref)) <= limit, (case, what, _rel(flat(got), flat(ref)), limit)


@pytest.mark.integration
@pytest.mark.parametrize("world", [1, 2])
def test_engine_batchnorm_modes_match_full_batch_references(world, seed):
    model_seed, data_seed = seed, seed + 1
    results = run_ranks(_worker, world, model_seed, data_seed, pooled=True)[0]
    error = results.pop("error")
    assert error is not None and "\n" not in error and "frozen | sync | local" in error, error
    assert len(results) == len(CASES[world])
    full = _reference(model_seed, data_seed, [list(range(GLOBAL_BATCH))])  # one uncached train-mode step
    initial = _reference(model_seed, data_seed, None)[2]  # eval mode: the buffers as initialised
    running = [n for n in initial if "running" in n]
    for case, (chunks, skipped, grads, state, buffers, same_on_ranks) in results.items():
        mode, stage, chunk, poison = case
        assert same_on_ranks, case  # running statistics are identical on every rank
        assert len(chunks) == (1 if chunk == 0 else -(-GLOBAL_BATCH // world // chunk)), (case, chunks)
        if poison:  # a skipped step leaves every buffer as it was
            assert skipped, case
            for n, b in initial.items():
                assert torch.equal(buffers[n].double(), b.double()), (case, n)
            continue
        assert not skipped, case
        groups = _groups(mode, chunk, world)
        ref_grads, ref_params, ref_buffers = _reference(model_seed, data_seed, groups)
        params = {n: state[n] for n in ref_params}
        # Whole-set bound 1e-5 (default BatchNorm under caching is ~0.6 off); per tensor 1e-4 in
        # every mode: the attention pool's q/k projection gradients are differences of nearly
        # equal terms (softmax ignores a shift shared by all keys), so their fp32 rounding reaches
        # ~1.2e-5 relative on some draws even in frozen mode (seen once in a full run). Ghost
        # groups of < 4 rows normalise < 4 values per channel at the 1 x 1 last stage, which
        # amplifies fp32 rounding: whole-set 1e-4 there, and on some draws far more: plain torch
        # in float32 is itself up to ~2e-2 from float64 on a few % of draws (a 2-row group, e.g.
        # seed 1782980526). There the bound is the conditioning measured on the draw: a few times
        # the float32 reference's own distance from the float64 one.
        tol = 1e-5 if groups is None or min(map(len, groups)) >= 4 else 1e-4
        tensor_tol = 1e-4
        ref32 = None
        if groups is not None and min(map(len, groups)) < 4:
            ref32_grads, ref32_params, _ = _reference(model_seed, data_seed, groups, torch.float32)
            ref32 = {"grad": ref32_grads, "param": ref32_params}
        _close(grads, ref_grads, "grad", case, tol, tensor_tol, ref32 and ref32["grad"])
        _close(params, ref_params, "param", case, tol, tensor_tol, ref32 and ref32["param"])
        _close({n: buffers[n] for n in running}, {n: ref_buffers[n] for n in running}, "buffers", case)
        tracked = {int(b) for n, b in buffers.items() if n.endswith("num_batches_tracked")}
        assert tracked == {0 if mode == "frozen" else 1}, (case, tracked)  # frozen: buffers never move
        if mode == "frozen":
            for n, b in initial.items():
                assert torch.equal(buffers[n].double(), b.double()), (case, n)
        else:
            # each sample counted once per step: the first layer (whose input does not depend on
            # the chunking) has the running statistics of one uncached full-batch step
            first = [n for n in running if n.startswith("visual.bn1.")]
            _close({n: buffers[n] for n in first}, {n: full[2][n] for n in first}, "bn1 vs uncached", case)
