"""FLIP patch dropout (model.patch_dropout, train.unmasked_steps; Li et al. 2023): which tokens the
image transformer sees in training, evaluation and export, the engine's cached step against the
chunk-wise one-pass reference with the same masks, the FLOP count, and the config errors."""

from __future__ import annotations

import json

import pytest
import torch

from mmalign.config import ConfigError, ModelConfig, load_config
from mmalign.models import build_model, check_buildable
from mmalign.models.flip import patch_dropout_at
from mmalign.run.gradcache import split_batch
from mmalign.run.monitors import forward_flops_per_sample
from tests.harness import chunkwise_clip_loss, clip_batch

DROP = 0.5
FULL = 1 + (16 // 4) ** 2  # micro: class token + 16 patches of 4 px on 16 px images
KEPT = 1 + int(16 * (1 - DROP))  # open_clip keeps max(1, int(patches * (1 - p))) patches and the class token


_batch = clip_batch  # (n, seed) -> random images and token rows


def _model(seed: int, drop: float = DROP):
    torch.manual_seed(seed)
    return build_model(ModelConfig(preset="micro", patch_dropout=drop)).train()


def _token_counts(model) -> list:
    """(training?, sequence length) of every input of the image transformer (after the dropout)."""
    seen = []
    model.visual.transformer.register_forward_pre_hook(
        lambda m, args: seen.append((m.training, args[0].shape[1]))
    )
    return seen


# ------------------------------------------------------------------ config


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["model.patch_dropout=1.0"], "model.patch_dropout"),
        (["model.patch_dropout=-0.1"], "model.patch_dropout"),
        (["train.unmasked_steps=2"], "train.unmasked_steps"),  # without patch dropout
        (
            ["model.patch_dropout=0.5", "train.steps=3", "train.warmup_steps=0", "train.unmasked_steps=4"],
            "train.unmasked_steps",
        ),
        (["model.patch_dropout=0.5", "model.vision.patch_dropout=0.25"], "model.patch_dropout"),
    ],
)
def test_bad_keys_are_one_line_config_errors(overrides, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        load_config(None, ["model.preset=micro", *overrides])
    assert "\n" not in str(e.value)


def test_a_resnet_tower_is_refused():
    with pytest.raises(ConfigError, match=r"model\.patch_dropout.*ModifiedResNet") as e:
        check_buildable(ModelConfig(preset="micro-rn", patch_dropout=0.5))
    assert "\n" not in str(e.value)


def test_the_tower_key_is_mirrored_and_the_saved_arch_carries_no_dropout():
    cfg = load_config(None, ["model.preset=micro", "model.vision.patch_dropout=0.5"])
    assert cfg.model.patch_dropout == 0.5  # the loop's schedule reads model.patch_dropout
    model = build_model(ModelConfig(preset="micro", patch_dropout=DROP))
    assert model.visual.patch_dropout.prob == DROP
    assert "patch_dropout" not in model.arch["vision_cfg"]  # final/ and exports: no training-only key


# ------------------------------------------------------------------ masks: train, eval, ranks, schedule


def test_training_keeps_the_fraction_and_evaluation_keeps_every_patch(seed):
    model = _model(seed)
    seen = _token_counts(model)
    images, tokens = _batch(4, seed)
    model(images, tokens)
    with torch.no_grad():
        model.eval()(images, tokens)
        model.encode_image(images)
    assert seen == [(True, KEPT), (False, FULL), (False, FULL)]


def _kept_patches(seed: int, images) -> torch.Tensor:
    """Which patches survive: the rows of the image transformer's input, identified by value."""
    model = _model(0)
    rows = []
    model.visual.transformer.register_forward_pre_hook(lambda m, args: rows.append(args[0]))
    torch.manual_seed(seed)  # what train.py's seed_everything(cfg.seed + rank) does to torch
    with torch.no_grad():
        model.encode_image(images)
    return rows[0]


def test_masks_differ_per_rank_seed_and_repeat_under_the_same_seed(seed):
    images, _ = _batch(4, seed)
    rank0, rank0_again, rank1 = (_kept_patches(s, images) for s in (seed, seed, seed + 1))
    assert rank0.shape[1] == KEPT
    assert torch.equal(rank0, rank0_again)
    assert not torch.equal(rank0, rank1)


def test_the_last_unmasked_steps_come_from_the_step_alone():
    cfg = load_config(
        None,
        [
            "model.preset=micro",
            "model.patch_dropout=0.5",
            "train.steps=10",
            "train.warmup_steps=0",
            "train.unmasked_steps=3",
        ],
    )
    assert [patch_dropout_at(cfg, s) for s in range(1, 11)] == [0.5] * 7 + [0.0] * 3
    cfg.train.unmasked_steps = 0
    assert patch_dropout_at(cfg, 10) == 0.5


# ------------------------------------------------------------------ FLOPs


def _naive_vit_flops(tokens: int, width: int = 32, patch: int = 4, patches: int = 16, embed: int = 32) -> int:
    """micro's image tower (1 block, MLP ratio 4) for one image, as 2 x multiply-adds: the patch
    convolution (all patches), per token qkv + out + 2 MLP matrices (2 x 12 d^2), attention's
    QK^T and AV (4 N^2 d), the projection of the class token."""
    conv = 2 * patches * width * 3 * patch * patch
    block = 24 * tokens * width**2 + 4 * tokens**2 * width
    return conv + block + 2 * width * embed


def test_forward_flops_count_only_the_kept_tokens(seed):
    model = _model(seed)
    masked = forward_flops_per_sample(model, 16, 16, towers=("visual",))
    model.set_patch_dropout(0.0)
    full = forward_flops_per_sample(model, 16, 16, towers=("visual",))
    assert masked == _naive_vit_flops(KEPT)
    assert full == _naive_vit_flops(FULL)
    # the block's matrices are linear in the kept tokens, attention quadratic (4 N^2 d, width 32)
    linear = [f - _naive_vit_flops(0) - 4 * n**2 * 32 for f, n in ((masked, KEPT), (full, FULL))]
    assert linear[0] / linear[1] == pytest.approx(KEPT / FULL)


# ------------------------------------------------------------------ the engine's cached step


def _chunkwise_reference(seed: int, mask_seed: int, chunks):
    """The chunks forwarded once each with grad, in the same RNG sequence (the masks the cache
    must replay), one loss on the concatenation, one backward."""
    model = _model(seed)
    torch.manual_seed(mask_seed)
    outs = [model(*c) for c in chunks]
    chunkwise_clip_loss(outs).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _engine_worker(rank: int, world: int, seed: int) -> dict:
    from mmalign.data.batch import Batch
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    out = {}
    for chunk in (3, 0):  # 4 cached chunks; one pass
        cfg = load_config(
            None,
            [
                "model.preset=micro",
                f"model.patch_dropout={DROP}",
                "train.global_batch_size=10",
                "train.steps=3",
                "train.warmup_steps=0",
                "train.optimizer=sgd",
                "train.lr=0.5",
                "train.weight_decay=0.0",
                f"train.grad_cache_chunk_size={chunk}",
                "deepspeed.zero_stage=0",
            ],
        )
        model = _model(seed)
        seen = _token_counts(model)
        engine = Engine(model, cfg)
        captured = {}
        torch.manual_seed(seed + 1)
        engine.step(
            Batch(*_batch(10, seed + 1)),
            build_objective(cfg),
            before_update=lambda: captured.update(engine.full_grads()),
        )
        out[chunk] = (captured, engine.plan.chunks, seen)
    return out


def test_engine_cached_step_equals_the_one_pass_with_the_same_masks(seed):
    from tests.harness import run_ranks

    results = run_ranks(_engine_worker, 1, seed, pooled=True)[0]
    for chunk, (got, chunks, seen) in results.items():
        want = _chunkwise_reference(seed, seed + 1, split_batch(_batch(10, seed + 1), list(chunks)))
        assert len(chunks) == (4 if chunk else 1)
        assert {n for n, g in got.items() if g is not None} == set(want)
        for name, g in want.items():
            rel = float((got[name] - g).norm() / g.norm().clamp_min(1e-12))
            assert rel <= 1e-5, (chunk, name, rel)
        assert {length for _, length in seen} == {KEPT}  # every forward (and re-forward) masked
    # The chunks draw their masks one after the other from the one generator (open_clip draws
    # (b, patches) normals per chunk, rows in order), so one pass and the chunks see the same
    # masks.  The test can fail: other masks give other gradients.
    got = results[3][0]
    other = _chunkwise_reference(seed, seed + 2, split_batch(_batch(10, seed + 1), list(results[3][1])))
    assert max(float((got[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in other.items()) > 1e-3


# ------------------------------------------------------------------ the loop


def test_a_run_masks_until_the_last_unmasked_steps_and_evaluates_and_exports_unmasked(
    micro_overrides, monkeypatch
):
    """Kept tokens counted with a hook on the image transformer's input, per forward."""
    import mmalign.run.train as train_module
    from mmalign.models.load import load
    from mmalign.run import in_run_eval

    seen = []

    def build_with_hook(cfg):
        model = build_model(cfg)
        seen.append(_token_counts(model))
        return model

    monkeypatch.setattr(train_module, "build_model", build_with_hook)
    monkeypatch.setattr(in_run_eval, "build_model", build_with_hook)  # the evaluation's own model
    cfg = load_config(
        None,
        micro_overrides
        + [
            "train.steps=4",
            "train.warmup_steps=0",
            "train.log_every=2",
            "train.checkpoint_every=3",
            f"model.patch_dropout={DROP}",
            "train.unmasked_steps=2",
        ],
    )
    out = train_module.train(cfg, show_progress=False)
    counts = seen[0]
    trained = [length for training, length in counts if training]
    # two FLOP counts (masked, then unmasked), then steps 1-2 masked, steps 3-4 unmasked
    assert trained == [KEPT, FULL, KEPT, KEPT, FULL, FULL], trained
    probed = [length for training, length in counts if not training]
    assert probed and set(probed) == {FULL}  # the probe (eval mode)
    # the final evaluation builds its own model (with the same patch dropout): eval mode, every patch
    assert seen[1] and set(seen[1]) == {(False, FULL)}, seen[1]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_sample = {r["step"]: r["tflops"] * 1e12 / r["samples_per_s"] for r in records if "tflops" in r}
    # fwd + bwd = 3 x the forward: the window of the unmasked steps 3-4 counts the dropped tokens too
    assert per_sample[4] - per_sample[2] == pytest.approx(
        3 * (_naive_vit_flops(FULL) - _naive_vit_flops(KEPT)), rel=1e-6
    )
    loaded = load(out / "final")
    exported = _token_counts(loaded.model)
    with torch.no_grad():
        loaded.model.train()(*_batch(2, 0))  # even in train mode: final/ carries no patch dropout
    assert exported == [(True, FULL)]

    # a resume after the switch (from step 3's checkpoint) runs step 4 unmasked too
    train_module.train(cfg, show_progress=False, resume="latest")
    assert [length for training, length in seen[2] if training] == [KEPT, FULL, FULL]
