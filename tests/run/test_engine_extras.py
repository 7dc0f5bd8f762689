"""The DeepSpeed engine with extra per-sample inputs: a second image view (NT-Xent term)
and mined negative captions.

Reference: one process, the full global batch, one forward, a naive float32 objective
written out here (CLIP + each image row's own mined negatives + weight x NT-Xent over all
views), plain torch SGD. Compared: 1 and 2 ranks x ZeRO {0, 3} x caching {off, uneven
chunks}, running the trainer's own objective (``build_objective``: contrastive + mined negatives +
image-image terms, gathered across ranks). Checked: rank-averaged
gradients and parameters after one step, to <= 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_ranks

pytestmark = pytest.mark.integration

GLOBAL_BATCH, K, LR, WEIGHT, TAU = 8, 2, 0.5, 0.7, 0.1


def _cfg(stage: int, chunk: int):
    from mmalign.config import load_config

    return load_config(
        None,
        [
            "model.preset=micro",
            f"train.global_batch_size={GLOBAL_BATCH}",
            "train.steps=1",
            "train.warmup_steps=0",
            "train.optimizer=sgd",
            f"train.lr={LR}",
            "train.weight_decay=0.0",
            f"train.grad_cache_chunk_size={chunk}",
            f"deepspeed.zero_stage={stage}",
            "data.views=2",
            f"loss.image_image_weight={WEIGHT}",
            f"loss.image_image_temperature={TAU}",
            f"data.hard_negatives={K}",
        ],
    )


def _tokens(g, n):
    tokens = torch.randint(1, 49000, (n, 16), generator=g)
    tokens[:, 0], tokens[:, 9], tokens[:, 10:] = 49406, 49407, 0
    return tokens


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g)
    images2 = torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=g)
    tokens = _tokens(g, GLOBAL_BATCH)
    neg = _tokens(g, GLOBAL_BATCH * K).reshape(GLOBAL_BATCH, K, 16)
    mask = torch.rand(GLOBAL_BATCH, K, generator=g) < 0.7
    return images, tokens, images2, neg, mask


def _naive_objective(out, mask):
    img, txt, scale = out.image, out.text, out.logit_scale
    img2, neg = out.image2, out.neg_text
    b = img.shape[0]
    labels = torch.arange(b)
    neg_logits = (scale * torch.einsum("bd,bkd->bk", img, neg)).masked_fill(~mask, float("-inf"))
    i2t = F.cross_entropy(torch.cat([scale * img @ txt.T, neg_logits], dim=1), labels)
    t2i = F.cross_entropy(scale * txt @ img.T, labels)
    z = torch.cat([img, img2])
    sim = (z @ z.T / TAU).masked_fill(torch.eye(2 * b, dtype=torch.bool), float("-inf"))
    return (i2t + t2i) / 2 + WEIGHT * F.cross_entropy(sim, torch.cat([labels + b, labels]))


def _reference(model_seed: int, data_seed: int):
    from mmalign.config import ModelConfig
    from mmalign.models import build_model

    torch.manual_seed(model_seed)
    model = build_model(ModelConfig(preset="micro"))
    images, tokens, images2, neg, mask = _inputs(data_seed)
    _naive_objective(model(images, tokens, images2=images2, neg_texts=neg), mask).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.clamp_logit_scale()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, model_seed: int, data_seed: int) -> dict:
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    local = GLOBAL_BATCH // world
    images, tokens, images2, neg, mask = (t[rank * local : (rank + 1) * local] for t in _inputs(data_seed))
    results = {}
    for stage in (0, 3):
        for name, chunk in (("off", 0), ("uneven", 3)):
            cfg = _cfg(stage, chunk)
            torch.manual_seed(model_seed)
            engine = Engine(build_model(cfg.model), cfg)
            objective = build_objective(cfg, world)
            captured = {}
            batch = Batch(images, tokens, images2=images2, neg_tokens=neg, neg_mask=mask)
            result = engine.step(
                objective.select(batch), objective, before_update=lambda: captured.update(engine.full_grads())
            )
            params = engine.consolidated_state_dict()
            if rank == 0:
                results[(stage, name)] = (engine.plan.chunks, captured, params, result.stats)
    return results


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


@pytest.mark.parametrize("world", [1, 2])
def test_engine_with_view_and_mined_negatives_matches_full_batch_reference(world, seed):
    model_seed, data_seed = seed, seed + 1
    ref_grads, ref_params = _reference(model_seed, data_seed)
    results = run_ranks(_worker, world, model_seed, data_seed, pooled=True)[0]
    assert len(results) == 4
    for (stage, name), (chunks, grads, params, stats) in results.items():
        assert (len(chunks) > 1) == (name == "uneven"), chunks
        for n, ref in ref_grads.items():
            assert grads[n] is not None, (stage, name, n)
            assert _rel(grads[n], ref) <= 1e-5, (world, stage, name, "grad", n, _rel(grads[n], ref))
        for n, ref in ref_params.items():
            assert _rel(params[n], ref) <= 1e-5, (world, stage, name, "param", n, _rel(params[n], ref))
        assert {"image_image_loss", "contrastive_loss", "mined_neg_prob", "mined_neg_valid"} <= set(stats)
