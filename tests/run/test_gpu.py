"""GPU checks (-m gpu; skipped without CUDA): a ZeRO-2 bf16 step and CUDA RNG replay in GradCache."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_zero2_bf16_step_on_cuda():
    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    cfg = load_config(
        None,
        [
            "model.preset=micro",
            "train.global_batch_size=16",
            "train.steps=2",
            "train.warmup_steps=0",
            "deepspeed.zero_stage=2",
            "deepspeed.precision=bf16",
            "train.grad_cache_chunk_size=8",
        ],
    )
    torch.manual_seed(0)
    engine = Engine(build_model(cfg.model).cuda(), cfg)
    objective = build_objective(cfg)
    images = torch.randn(16, 3, 16, 16, device="cuda")
    tokens = torch.randint(1, 49000, (16, 16), device="cuda")
    tokens[:, 0], tokens[:, 7], tokens[:, 8:] = 49406, 49407, 0
    before = engine.consolidated_state_dict()
    res = engine.step(Batch(images, tokens), objective)
    after = engine.consolidated_state_dict()
    assert not res.skipped and torch.isfinite(res.loss)
    assert sum(int(not torch.equal(before[k], after[k])) for k in before) > len(before) // 2


def test_grad_cache_replays_cuda_rng_with_patch_dropout(seed):
    import torch.nn.functional as F

    from mmalign.config import ModelConfig
    from mmalign.models import build_model
    from mmalign.models.embeddings import Embeddings
    from mmalign.run.gradcache import chunk_sizes, grad_cache_step, split_batch

    def loss(full):
        logits = full.logit_scale * full.image @ full.text.T
        labels = torch.arange(logits.shape[0], device=logits.device)
        return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2

    data_seed = seed + 1
    torch.manual_seed(data_seed)
    images = torch.randn(10, 3, 16, 16, device="cuda")
    tokens = torch.randint(1, 49000, (10, 16), device="cuda")
    tokens[:, 0], tokens[:, 9], tokens[:, 10:] = 49406, 49407, 0
    chunks = split_batch((images, tokens), chunk_sizes(10, 4))

    def fresh():
        torch.manual_seed(seed)
        return build_model(ModelConfig(preset="micro", vision={"patch_dropout": 0.5})).cuda().train()

    model = fresh()
    torch.manual_seed(data_seed)
    outs = [model(*c) for c in chunks]
    full = Embeddings(
        image=torch.cat([o.image for o in outs]),
        text=torch.cat([o.text for o in outs]),
        logit_scale=outs[0].logit_scale,
    )
    loss(full).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}

    model = fresh()
    torch.manual_seed(data_seed)
    grad_cache_step(lambda c: model(*c), chunks, loss, lambda x: x.backward())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-4, atol=1e-6)


def _cuda_batch(n: int, size: int):
    g = torch.Generator().manual_seed(0)
    images = torch.randn(n, 3, size, size, generator=g).cuda()
    tokens = torch.randint(1, 49000, (n, 16), generator=g)
    tokens[:, 0], tokens[:, 7], tokens[:, 8:] = 49406, 49407, 0
    return images, tokens.cuda()


def test_lamb_partition_layout_and_fp32_accumulation_on_cuda():
    """bf16 weights at ZeRO-1 (BF16_Optimizer, fp32 accumulation) with the per-tensor LAMB layout."""
    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    cfg = load_config(
        None,
        [
            "model.preset=micro",
            "train.global_batch_size=16",
            "train.steps=2",
            "train.warmup_steps=0",
            "deepspeed.zero_stage=1",
            "deepspeed.precision=bf16",
            "train.grad_cache_chunk_size=4",
            "train.optimizer=lamb",
        ],
    )
    torch.manual_seed(0)
    engine = Engine(build_model(cfg.model).cuda(), cfg)
    assert type(engine.ds.optimizer).__name__ == "BF16_Optimizer"
    objective = build_objective(cfg)
    images, tokens = _cuda_batch(16, 16)
    before = engine.consolidated_state_dict()
    res = engine.step(Batch(images, tokens), objective)
    after = engine.consolidated_state_dict()
    assert not res.skipped and torch.isfinite(res.loss)
    assert sum(int(not torch.equal(before[k], after[k])) for k in before) > len(before) // 2


def test_batchnorm_local_cached_step_commits_running_stats_once_on_cuda():
    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    cfg = load_config(
        None,
        [
            "model.preset=micro-rn",
            "model.batchnorm=local",
            "train.global_batch_size=12",
            "train.steps=2",
            "train.warmup_steps=0",
            "train.grad_cache_chunk_size=4",
        ],
    )
    torch.manual_seed(0)
    engine = Engine(build_model(cfg.model).cuda(), cfg)
    objective = build_objective(cfg)
    images, tokens = _cuda_batch(12, 32)
    res = engine.step(Batch(images, tokens), objective)
    assert not res.skipped
    tracked = {n: int(b) for n, b in engine.module.named_buffers() if n.endswith("num_batches_tracked")}
    assert tracked and set(tracked.values()) == {1}


def test_bf16_autocast_reaches_the_towers_under_deepspeed_on_cuda():
    """On CUDA DeepSpeed's wrapper sees the caller's autocast (issue 27): the engine enters
    train.precision's autocast inside the module, so the towers compute and return bf16 while
    the weights and their gradients stay fp32."""
    from torch import nn

    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    cfg = load_config(
        None,
        [
            "model.preset=micro",
            "train.global_batch_size=16",
            "train.steps=2",
            "train.warmup_steps=0",
            "deepspeed.zero_stage=0",
            "train.precision=bf16",
        ],
    )
    torch.manual_seed(0)
    engine = Engine(build_model(cfg.model).cuda(), cfg)
    seen = []
    for m in engine.module.modules():
        if isinstance(m, nn.Linear):
            m.register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    images = torch.randn(16, 3, 16, 16, device="cuda")
    tokens = torch.randint(1, 49000, (16, 16), device="cuda")
    tokens[:, 0], tokens[:, 7], tokens[:, 8:] = 49406, 49407, 0
    out = engine.forward(images, tokens)
    assert out.image.dtype == out.text.dtype == torch.bfloat16
    grad_dtypes = set()

    def before_update():
        grad_dtypes.update(p.grad.dtype for p in engine.module.parameters() if p.grad is not None)

    res = engine.step(Batch(images, tokens), build_objective(cfg), before_update=before_update)
    assert not res.skipped and set(seen) == {torch.bfloat16}
    assert grad_dtypes == {torch.float32} and {p.dtype for p in engine.module.parameters()} == {torch.float32}
