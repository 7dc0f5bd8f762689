"""train.precision=bf16 reaches the towers inside the DeepSpeed engine (issue 27, point 1).

DeepSpeed 0.19.8 switches a caller's autocast off around the module it wraps when
``torch.is_autocast_enabled()`` (no argument: CUDA's state) is True. On CPU that call is False,
so a CPU run never shows the bug; these tests make it read the CPU state instead, which is
exactly what a CUDA run sees, and check that the towers still compute in bf16, that gradients
and master weights stay fp32, and that the engine's step is the plain-PyTorch autocast step.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from tests.conftest import engine_batch, engine_cfg, naive_clip_loss

_real_is_autocast_enabled = torch.is_autocast_enabled


@pytest.fixture
def cuda_like_autocast_check(monkeypatch):
    """``torch.is_autocast_enabled()`` without an argument reports the CPU autocast state, as it
    reports CUDA's on a GPU; calls that name a device are unchanged."""

    def check(*args, **kwargs):
        if args or kwargs:
            return _real_is_autocast_enabled(*args, **kwargs)
        return _real_is_autocast_enabled("cpu")

    monkeypatch.setattr(torch, "is_autocast_enabled", check)


def _linear_output_dtypes(model: nn.Module) -> tuple[list, list]:
    """Forward hooks on every nn.Linear (and the attention modules' packed projections run by
    F.linear inside them: their out_proj is an nn.Linear too) recording the output dtypes."""
    seen, handles = [], []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            handles.append(m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype)))
    return seen, handles


def _plain_autocast_grads(model: nn.Module, images, tokens) -> dict[str, torch.Tensor]:
    """The reference: the towers under torch.autocast(bf16) called directly (no DeepSpeed), the
    naive CLIP loss in fp32 on the features, one backward."""
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(images, tokens)
    loss = naive_clip_loss(out.image.float(), out.text.float(), out.logit_scale.float())
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _fp32_grads(model: nn.Module, images, tokens) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = model(images, tokens)
    naive_clip_loss(out.image, out.text, out.logit_scale).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(got: dict, want: dict) -> float:
    num = sum(float((got[k].float() - want[k].float()).pow(2).sum()) for k in want)
    den = sum(float(want[k].float().pow(2).sum()) for k in want)
    return (num / den) ** 0.5


@pytest.mark.parametrize("stage", [0, 1])
def test_bf16_reaches_the_towers_inside_deepspeed_when_the_check_reads_cuda(cuda_like_autocast_check, stage, seed):
    from mmalign.data.batch import Batch
    from mmalign.engine import Engine
    from mmalign.models import build_model
    from mmalign.objective import build_objective

    assert torch.is_autocast_enabled() is False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled() is True  # the simulation: DeepSpeed's check now sees it

    cfg = engine_cfg(stage, "train.precision=bf16", "deepspeed.precision=fp32", "train.optimizer=sgd",
                     "train.lr=0.1", "train.warmup_steps=0", "train.weight_decay=0.0", "loss.tile_size=0")
    torch.manual_seed(seed)
    model = build_model(cfg.model)
    reference = copy.deepcopy(model)
    images, tokens = engine_batch(seed, 0, 1)
    engine = Engine(model, cfg)
    objective = build_objective(cfg)
    seen, handles = _linear_output_dtypes(engine.module)
    before = {k: v.clone() for k, v in engine.full_params(master=True).items()}
    grads = {}

    def before_update():
        grads.update(engine.full_grads())  # float() copies: read the dtype from the module below
        if stage == 0:
            dtypes = {p.grad.dtype for p in engine.module.parameters() if p.grad is not None}
            assert dtypes == {torch.float32}, dtypes  # fp32 gradient sums (#13)

    lr = engine.lr
    result = engine.step(Batch(images, tokens), objective, before_update=before_update)  # config's autocast
    for h in handles:
        h.remove()
    assert not result.skipped
    assert seen and set(seen) == {torch.bfloat16}, set(seen)  # every Linear of both towers ran in bf16
    assert {p.dtype for p in engine.module.parameters()} == {torch.float32}  # weights stay fp32
    if stage == 1:  # ZeRO-1 keeps the fp32 master partition and sums gradients into fp32 buffers
        opt = engine.ds.optimizer
        assert {t.dtype for t in opt.single_partition_of_fp32_groups} == {torch.float32}
        assert {t.grad.dtype for t in opt.single_partition_of_fp32_groups if t.grad is not None} <= {torch.float32}
    after = engine.full_params(master=True)
    assert {t.dtype for t in after.values()} == {torch.float32}

    # the step is the plain-PyTorch autocast step: same gradient, same SGD update
    plain = _plain_autocast_grads(reference, images, tokens)
    exact = _fp32_grads(copy.deepcopy(reference).float(), images, tokens)
    err_plain, err_fp32 = _rel(grads, plain), _rel(grads, exact)
    print(f"ZeRO-{stage}: engine vs plain bf16 autocast {err_plain:.2e}; vs fp32 {err_fp32:.2e}; "
          f"plain bf16 vs fp32 {_rel(plain, exact):.2e}")
    assert err_plain <= 1e-5, err_plain  # the same bf16 computation (only summation order may differ)
    assert 1e-4 < err_fp32 <= 5e-2, err_fp32  # really bf16 (not fp32), within bf16's bound of the fp32 gradient
    update = {k: after[k] - before[k] for k in plain}
    want = {k: -lr * plain[k] for k in plain}
    assert _rel(update, want) <= 2e-3


def test_the_old_call_shape_is_caught(cuda_like_autocast_check, seed):
    """A caller's autocast around the DeepSpeed call (the pre-fix engine) is switched off by
    DeepSpeed under the simulated check, and its warning is an error in tests (conftest)."""
    from mmalign.engine import Engine
    from mmalign.models import build_model

    cfg = engine_cfg(0, "train.precision=fp32")
    torch.manual_seed(seed)
    engine = Engine(build_model(cfg.model), cfg)
    images, tokens = engine_batch(seed, 0, 1)
    with pytest.raises(AssertionError, match="switched the caller's autocast off"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            engine.ds(images, tokens)


def test_fp32_config_runs_the_towers_in_fp32(cuda_like_autocast_check, seed):
    from mmalign.engine import Engine
    from mmalign.models import build_model

    cfg = engine_cfg(0, "train.precision=fp32")
    torch.manual_seed(seed)
    engine = Engine(build_model(cfg.model), cfg)
    seen, handles = _linear_output_dtypes(engine.module)
    out = engine.forward(*engine_batch(seed, 0, 1))
    for h in handles:
        h.remove()
    assert set(seen) == {torch.float32} and out.image.dtype == torch.float32
    # an explicit context still goes inside (bench scripts, the probe)
    seen, handles = _linear_output_dtypes(engine.module)
    out = engine.forward(*engine_batch(seed, 0, 1), autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16))
    for h in handles:
        h.remove()
    assert set(seen) == {torch.bfloat16}
    assert out.image.dtype == out.text.dtype == torch.bfloat16  # the towers' outputs, before encode's float()
