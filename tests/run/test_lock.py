"""LiT locking (model.lock_image / model.lock_text): which weights train, that the locked ones
never move and hold no optimiser state, and that gradient caching forwards a fully locked tower
once per chunk while its step stays the chunk-wise one-pass reference's, dropout on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mmalign.config import ConfigError, ModelConfig, load_config
from mmalign.models import build_model, check_buildable
from mmalign.models.embeddings import Embeddings
from mmalign.models.two_tower import TwoTower
from mmalign.run.gradcache import chunk_sizes, grad_cache_step, split_batch
from tests.harness import chunkwise_clip_loss, clip_batch, naive_clip_loss

DROP = 0.3


def _naive_loss(full: Embeddings) -> torch.Tensor:
    return naive_clip_loss(full.image, full.text, full.logit_scale)


_batch = clip_batch  # (n, seed) -> random images and token rows


def _with_dropout(model: TwoTower) -> TwoTower:
    """Dropout after the first block of BOTH towers (open_clip's text tower has none): the locked
    tower's first pass consumes random numbers too, so a replay that ignored the tower order fails."""
    for block in (model.visual.transformer.resblocks[0], model.text.transformer.resblocks[0]):
        block.register_forward_hook(lambda m, args, out: F.dropout(out, DROP, m.training))
    return model.train()


def _model(seed: int, **lock) -> TwoTower:
    torch.manual_seed(seed)
    return _with_dropout(build_model(ModelConfig(preset="micro", vision={"patch_dropout": 0.5}, **lock)))


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _count_forwards(tower: nn.Module) -> list:
    calls = []
    tower.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    return calls


def _reencode(model):
    """What the engine's re-forward does (Engine.encode with ``first``), in plain torch."""

    def reencode(chunk, first):
        inputs, reused = model.without_locked({"images": chunk[0], "texts": chunk[1]}, first)
        return model(inputs.get("images"), inputs.get("texts")).replace(**reused)

    return reencode


# ------------------------------------------------------------------ config and build


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.lock_image_unlocked_groups=1"], "model.lock_image_unlocked_groups"),
        (["model.lock_text_unlocked_layers=1"], "model.lock_text_unlocked_layers"),
        (["model.lock_image_freeze_bn_stats=true"], "model.lock_image_freeze_bn_stats"),
        (
            ["model.lock_image=true", "model.lock_image_unlocked_groups=-1"],
            "model.lock_image_unlocked_groups",
        ),
        (["model.lock_text=true", "model.lock_text_unlocked_layers=-2"], "model.lock_text_unlocked_layers"),
        (["model.lock_image=true", "model.lock_text=true"], "model.lock_text"),
        (
            ["model.lock_image=true", "model.lock_image_freeze_bn_stats=true", "model.batchnorm=sync"],
            "model.lock_image_freeze_bn_stats",
        ),
    ],
)
def test_bad_lock_keys_are_one_line_config_errors(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert f"'{key}'" in str(e.value) and "\n" not in str(e.value)


def test_freeze_bn_stats_is_the_frozen_batchnorm_mode():
    cfg = load_config(
        None, ["model.preset=micro-rn", "model.lock_image=true", "model.lock_image_freeze_bn_stats=true"]
    )
    assert cfg.model.batchnorm == "frozen"
    model = build_model(cfg.model)
    modes = {m.mode for m in model.visual.modules() if hasattr(m, "mode")}
    assert modes == {"frozen"}
    assert not any(p.requires_grad for p in model.visual.parameters())


def test_a_resnet_tower_refuses_partial_locking_and_a_tower_without_lock_is_refused():
    cfg = ModelConfig(preset="micro-rn", lock_image=True, lock_image_unlocked_groups=1)
    with pytest.raises(ConfigError, match="config key 'model.lock_image'") as e:
        check_buildable(cfg)  # before any process starts
    assert "\n" not in str(e.value)
    model = build_model(ModelConfig(preset="micro"))
    model.text = nn.Linear(2, 2)  # a tower with no lock()
    with pytest.raises(ConfigError, match="config key 'model.lock_text'.*no lock"):
        model.lock("text")


def test_lock_freezes_the_tower_and_unlocked_groups_leave_the_last_ones_trainable():
    model = build_model(ModelConfig(preset="micro", lock_image=True))
    assert not any(p.requires_grad for p in model.visual.parameters())
    assert all(p.requires_grad for p in model.text.parameters()) and model.logit_scale.requires_grad
    assert model.fully_locked() == ("visual",)
    # ViT groups: stem, the blocks but the last, (last block + ln_post), proj: 1 = proj only
    model = build_model(ModelConfig(preset="micro", lock_image=True, lock_image_unlocked_groups=1))
    assert [n for n, p in model.visual.named_parameters() if p.requires_grad] == ["proj"]
    assert model.fully_locked() == ()
    model = build_model(ModelConfig(preset="micro", lock_text=True, lock_text_unlocked_layers=1))
    assert [n for n, p in model.text.named_parameters() if p.requires_grad] == ["text_projection"]
    model = build_model(ModelConfig(preset="micro", lock_text=True))
    assert model.fully_locked() == ("text",)
    assert all(p.requires_grad for p in model.visual.parameters())


# ------------------------------------------------------------------ gradient caching


def _chunkwise_reference(seed, data_seed, chunks, **lock):
    """The same chunks forwarded once each, with grad, in the same RNG sequence (the dropout
    masks the cache must replay), one loss on the concatenation, one backward."""
    model = _model(seed, **lock)
    torch.manual_seed(data_seed)
    outs = [model(*c) for c in chunks]
    chunkwise_clip_loss(outs).backward()
    return _grads(model), torch.get_rng_state()


@pytest.mark.parametrize(
    "lock, tower, fully",
    [
        ({"lock_image": True}, "visual", True),
        ({"lock_text": True}, "text", True),
        ({"lock_image": True, "lock_image_unlocked_groups": 1}, "visual", False),
    ],
)
def test_cached_step_equals_the_one_pass_with_dropout_and_skips_the_locked_re_forward(
    lock, tower, fully, seed
):
    data_seed = seed + 1
    chunks = split_batch(_batch(10, data_seed), chunk_sizes(10, 3))  # 4 chunks
    n = len(chunks)
    want, rng_after = _chunkwise_reference(seed, data_seed, chunks, **lock)

    model = _model(seed, **lock)
    calls = _count_forwards(getattr(model, tower))
    torch.manual_seed(data_seed)
    grad_cache_step(
        lambda c: model(*c), chunks, _naive_loss, lambda x: x.backward(), reencode=_reencode(model)
    )
    got = _grads(model)
    assert got.keys() == want.keys()
    assert all(not p.requires_grad for n_, p in getattr(model, tower).named_parameters() if n_ != "proj")
    for name in want:
        rel = float((got[name] - want[name]).norm() / want[name].norm().clamp_min(1e-12))
        assert rel <= 1e-5, (name, rel)
    assert torch.equal(torch.get_rng_state(), rng_after)
    # a fully locked tower: one forward per chunk; partly locked: re-forwarded like any tower
    assert len(calls) == (n if fully else 2 * n - 1), calls


def test_without_the_locked_tower_last_the_replay_is_wrong(monkeypatch, seed):
    """The test above can fail: with the locked image tower run first (in the reference too),
    the re-forward of the text tower starts at the chunk's RNG state, not where it started."""
    monkeypatch.setattr(TwoTower, "_tower_order", lambda self: ("visual", "text"))
    data_seed = seed + 1
    chunks = split_batch(_batch(10, data_seed), chunk_sizes(10, 3))
    want, _ = _chunkwise_reference(seed, data_seed, chunks, lock_image=True)
    model = _model(seed, lock_image=True)
    torch.manual_seed(data_seed)
    grad_cache_step(
        lambda c: model(*c), chunks, _naive_loss, lambda x: x.backward(), reencode=_reencode(model)
    )
    got = _grads(model)
    assert max(float((got[n] - want[n]).norm() / want[n].norm()) for n in want) > 1e-3


# ------------------------------------------------------------------ the engine (DeepSpeed)


def _engine_cfg(stage: int, chunk: int, *extra: str):
    return load_config(
        None,
        [
            "model.preset=micro",
            "model.vision.patch_dropout=0.5",
            "train.global_batch_size=10",
            "train.steps=3",
            "train.warmup_steps=0",
            "train.optimizer=sgd",
            "train.lr=0.5",
            "train.weight_decay=0.0",
            f"train.grad_cache_chunk_size={chunk}",
            f"deepspeed.zero_stage={stage}",
            *extra,
        ],
    )


def _exact_worker(rank: int, world: int, seed: int) -> dict:
    """Engine steps (ZeRO-0, 4 cached chunks, dropout on) with each lock: the rank-averaged
    gradients, and how often the visual tower ran."""
    from mmalign.data.batch import Batch
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    out = {}
    for name, lock in (
        ("image", {"lock_image": True}),
        ("text", {"lock_text": True}),
        ("image_partial", {"lock_image": True, "lock_image_unlocked_groups": 1}),
    ):
        cfg = _engine_cfg(0, 3, *[f"model.{k}={str(v).lower()}" for k, v in lock.items()])
        model = _model(seed, **lock)
        calls = _count_forwards(model.visual)
        engine = Engine(model, cfg)
        captured = {}
        torch.manual_seed(seed + 1)
        engine.step(
            Batch(*_batch(10, seed + 1)),
            build_objective(cfg),
            before_update=lambda: captured.update(engine.full_grads()),
        )
        out[name] = (captured, len(calls), engine.plan.chunks)
    return out


def test_engine_cached_step_with_a_locked_tower_equals_the_one_pass_with_dropout(seed):
    from tests.harness import run_ranks

    results = run_ranks(_exact_worker, 1, seed, pooled=True)[0]
    for name, lock in (
        ("image", {"lock_image": True}),
        ("text", {"lock_text": True}),
        ("image_partial", {"lock_image": True, "lock_image_unlocked_groups": 1}),
    ):
        got, visual_calls, chunks = results[name]
        n = len(chunks)
        assert n == 4, chunks
        want, _ = _chunkwise_reference(
            seed, seed + 1, split_batch(_batch(10, seed + 1), list(chunks)), **lock
        )
        for key, g in want.items():
            rel = float((got[key] - g).norm() / g.norm().clamp_min(1e-12))
            assert rel <= 1e-5, (name, key, rel)
        assert all(got[k] is None for k in got if k not in want), name  # locked: no gradient at all
        # counted with a forward hook: the fully locked image tower runs n times, not 2n - 1
        assert visual_calls == {"image": n, "text": 2 * n - 1, "image_partial": 2 * n - 1}[name], (
            name,
            visual_calls,
        )


def _steps_worker(rank: int, world: int, seed: int) -> dict:
    """3 cached steps with the image tower locked at each ZeRO stage (and bf16 weights at ZeRO-1),
    a checkpoint, a resume and a consolidation of the checkpoint."""
    import tempfile

    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine, consolidate_checkpoint

    out = {}
    for stage, precision in ((0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16")):
        cfg = _engine_cfg(
            stage, 4, "model.lock_image=true", "train.optimizer=adamw", f"deepspeed.precision={precision}"
        )
        torch.manual_seed(seed)
        model = build_model(cfg.model)
        engine = Engine(model, cfg)
        for s in range(3):
            engine.step(Batch(*_batch(10, seed + s)), build_objective(cfg))
        if stage == 0:  # the optimiser's own state, keyed by parameter
            held = [p for g in engine.base_optimizer.param_groups for p in g["params"]]
            assert all(p.requires_grad for p in held) and all(
                p.requires_grad for p in engine.base_optimizer.state
            )
            numel = sum(p.numel() for p in held)
        elif stage < 3:  # DeepSpeed's flat fp32 partitions the optimiser steps
            numel = sum(t.numel() for g in engine.base_optimizer.param_groups for t in g["params"])
        else:
            numel = sum(t.numel() for t in engine.ds.optimizer.fp32_partitioned_groups_flat)
        state = engine.consolidated_state_dict()
        with tempfile.TemporaryDirectory() as d:
            engine.save_checkpoint(d, "t")
            # (a BF16_Optimizer checkpoint is not one zero_to_fp32 reads: no consolidation from files)
            from_files = consolidate_checkpoint(d, "t") if precision == "fp32" else None
            resumed = Engine(build_model(cfg.model), cfg)
            resumed.load_checkpoint(d, "t")
            again = resumed.consolidated_state_dict()
        out[(stage, precision)] = (numel, state, from_files, again)
    return out


@pytest.mark.integration
def test_locked_tower_is_bitwise_unchanged_and_has_no_optimizer_state(seed):
    from tests.harness import run_ranks

    torch.manual_seed(seed)
    init = build_model(ModelConfig(preset="micro")).state_dict()
    locked = [n for n in init if n.startswith("visual.") and not n.endswith("attn_mask")]
    trainable = sum(v.numel() for n, v in init.items() if n.startswith("text.") and "attn_mask" not in n) + 1
    for (stage, precision), (numel, state, from_files, again) in run_ranks(
        _steps_worker, 1, seed, pooled=True
    )[0].items():
        where = (stage, precision)
        assert trainable <= numel < trainable + 64, (where, numel, trainable)  # padding only: no visual.*
        for name in locked:
            # bf16 weights: DeepSpeed casts the module and keeps no fp32 master of a locked tensor,
            # so the locked weights are the bf16 rounding of the initial ones, then never move
            want = init[name] if precision == "fp32" else init[name].bfloat16().float()
            for got in (state, again) if from_files is None else (state, from_files, again):
                assert torch.equal(got[name], want), (where, name)
        assert not torch.equal(state["text.text_projection"], init["text.text_projection"]), where
        assert torch.equal(again["text.text_projection"], state["text.text_projection"]), where
