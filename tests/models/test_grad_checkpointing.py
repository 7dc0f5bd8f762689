"""Activation checkpointing (``train.grad_checkpointing``): same gradients, less memory.

Reference: plain autograd on the same model (same init, same dropout, no checkpointing), full
batch or the same chunks forwarded one after the other, the symmetric CLIP loss written out.
Dropout is put into every block so that the recompute in the backward must replay the RNG
state of the first forward (torch's non-reentrant checkpoint, as open_clip calls it, keeps it),
and under gradient caching the engine's re-forward replays it once more.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import chunkwise_clip_loss, clip_batch, max_rel_error, naive_clip_loss, run_ranks

BATCH, CHUNK = 8, 4


def _model(seed: int):
    """micro towers with 2 blocks each, and dropout (p = 0.2) at the end of every block's MLP."""
    from mmalign.config import ModelConfig
    from mmalign.models import build_model

    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="micro", vision={"layers": 2}, text={"layers": 2}))
    for tower in (model.visual, model.text):
        for block in tower.transformer.resblocks:
            block.mlp.add_module("drop", torch.nn.Dropout(0.2))
    return model


def _reference(model_seed: int, data_seed: int, step_seed: int, chunk: int) -> dict:
    """Plain autograd gradients: the chunks forwarded in order (as the gradient cache's first pass
    does, so the dropout masks are drawn in the same order), one loss on all of them."""
    model = _model(model_seed)
    images, tokens = clip_batch(BATCH, data_seed)
    torch.manual_seed(step_seed)
    size = chunk or BATCH
    outs = [model(images[i : i + size], tokens[i : i + size]) for i in range(0, BATCH, size)]
    chunkwise_clip_loss(outs).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _worker(rank: int, world: int, model_seed: int, data_seed: int, step_seed: int) -> dict:
    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    images, tokens = clip_batch(BATCH, data_seed)
    results = {}
    for checkpointing in (True, False):
        for chunk in (0, CHUNK):
            cfg = load_config(
                None,
                [
                    "model.preset=micro",
                    "model.vision.layers=2",
                    "model.text.layers=2",
                    f"train.global_batch_size={BATCH}",
                    f"train.grad_cache_chunk_size={chunk}",
                    "train.steps=1",
                    "train.warmup_steps=0",
                    "train.optimizer=sgd",
                    "train.weight_decay=0.0",
                    f"train.grad_checkpointing={str(checkpointing).lower()}",
                ],
            )
            model = _model(model_seed)
            calls = []
            model.visual.transformer.resblocks[0].register_forward_pre_hook(lambda *_: calls.append(1))
            engine = Engine(model, cfg)
            captured = {}
            torch.manual_seed(step_seed)
            engine.step(
                Batch(images, tokens),
                build_objective(cfg),
                before_update=lambda: captured.update(engine.full_grads()),
            )
            results[checkpointing, chunk] = (captured, len(calls))
    return results


@pytest.mark.integration
def test_checkpointed_engine_steps_equal_plain_autograd(seed):
    model_seed, data_seed, step_seed = seed, seed + 1, seed + 2
    results = run_ranks(_worker, 1, model_seed, data_seed, step_seed, pooled=True)[0]
    # block forwards begun per step (a pre-hook: torch may stop a recompute early). Plain: one
    # (uncached); cached: a first pass over both chunks (the last keeps its graph) and the first
    # chunk's re-forward. Checkpointed: plus one recompute per backward through a chunk.
    calls = {key: n for key, (_, n) in results.items()}
    assert calls == {(False, 0): 1, (False, CHUNK): 3, (True, 0): 2, (True, CHUNK): 5}, calls
    for chunk in (0, CHUNK):
        # the same engine step with and without checkpointing: the recompute replays the
        # forward, dropout masks included
        err, name = max_rel_error(results[True, chunk][0], results[False, chunk][0])
        assert err <= 1e-6, (chunk, name, err)
        # and both equal plain autograd with the loss written out (the engine's exactness bound:
        # its loss kernel sums in another order than the naive one, ~1e-6 on small biases)
        ref = _reference(model_seed, data_seed, step_seed, chunk)
        err, name = max_rel_error(results[True, chunk][0], ref)
        assert err <= 1e-5, (chunk, name, err)
    # the dropout masks matter: other masks give other gradients, so equal ones were replayed
    err, name = max_rel_error(
        _reference(model_seed, data_seed, step_seed + 1, 0), _reference(model_seed, data_seed, step_seed, 0)
    )
    assert err > 1e-3, (name, err)


def _peak_bytes(model, images, tokens) -> dict[bool, int]:
    """Peak CPU bytes allocated during one forward + backward, without and with checkpointing
    (above what was live when each began), from the profiler's allocation events: each op's own
    allocations at its start, frees as they come. One profiler session for both (starting one
    costs seconds); an op the towers never run (``sinh_``) marks where the second run starts (a
    record_function range would take the frees outside ops as its own, at its start)."""
    from torch.profiler import ProfilerActivity, profile

    marker = torch.zeros(1)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        for on in (False, True):
            model.set_grad_checkpointing(on)
            model.zero_grad(set_to_none=False)
            marker.sinh_()
            out = model(images, tokens)
            naive_clip_loss(out.image, out.text, out.logit_scale).backward()
            del out
    events = sorted(prof.events(), key=lambda e: e.time_range.start)
    marks = [e.time_range.start for e in events if e.name == "aten::sinh_"]
    assert len(marks) == 2, marks
    peaks, live = {False: 0, True: 0}, {False: 0, True: 0}
    for e in events:
        if e.time_range.start >= marks[0]:
            on = e.time_range.start >= marks[1]
            live[on] += e.self_cpu_memory_usage
            peaks[on] = max(peaks[on], live[on])
    return peaks


def test_checkpointing_lowers_peak_memory_at_a_fixed_batch(seed, record_property):
    from mmalign.config import ModelConfig
    from mmalign.models import build_model

    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="tiny"))  # 4 + 4 blocks of width 128, 65 image tokens
    images, tokens = clip_batch(16, seed + 1, image_size=32, context=32)
    grads = {}
    for on in (False, True):  # also allocates .grad: not measured below
        model.set_grad_checkpointing(on)
        model.zero_grad(set_to_none=True)
        out = model(images, tokens)
        naive_clip_loss(out.image, out.text, out.logit_scale).backward()
        grads[on] = {n: p.grad.clone() for n, p in model.named_parameters()}
    err, name = max_rel_error(grads[True], grads[False])
    assert err <= 1e-6, (name, err)
    peaks = _peak_bytes(model, images, tokens)  # activations and the backward's temporaries
    line = (
        f"peak forward+backward memory above weights and grads, tiny preset, batch 16: "
        f"{peaks[False] / 2**20:.1f} MiB plain, {peaks[True] / 2**20:.1f} MiB checkpointed"
    )
    print(line)
    record_property("peak_memory", line)
    assert peaks[True] < 0.5 * peaks[False], line


def test_a_tower_without_checkpointing_is_a_config_error():
    from mmalign.config import ConfigError, ModelConfig
    from mmalign.models import build_model

    model = build_model(ModelConfig(preset="micro-rn"))  # open_clip's ModifiedResNet: a no-op setter
    with pytest.raises(ConfigError, match=r"train.grad_checkpointing.*image tower \(ModifiedResNet\)"):
        model.set_grad_checkpointing(True)
    model.set_grad_checkpointing(False)  # turning it off is always fine
    vit = build_model(ModelConfig(preset="micro"))
    vit.set_grad_checkpointing(True)
    assert vit.visual.transformer.grad_checkpointing and vit.text.transformer.grad_checkpointing
