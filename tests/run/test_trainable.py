"""Locked towers are visible (issue 28, point 10): each tower's state (locked, partly unlocked,
trainable) and the trainable / frozen parameter counts, checked against counts taken here from
``requires_grad``. A real LiT run's line, train.log and first metrics record are checked in
tests/cli/test_progress.py."""

from __future__ import annotations

import pytest
import torch

from mmalign.config import ModelConfig
from mmalign.models import build_model
from mmalign.run import trainable


def _counts(module) -> tuple[int, int]:
    params = list(module.parameters())
    return (
        sum(p.numel() for p in params if p.requires_grad),
        sum(p.numel() for p in params if not p.requires_grad),
    )


@pytest.mark.parametrize(
    "lock, image, text",
    [
        ({}, "trainable", "trainable"),
        ({"lock_image": True}, "locked", "trainable"),
        ({"lock_image": True, "lock_image_unlocked_groups": 1}, "partly unlocked", "trainable"),
        ({"lock_text": True}, "trainable", "locked"),
        ({"lock_text": True, "lock_text_unlocked_layers": 1}, "trainable", "partly unlocked"),
    ],
    ids=["none", "image", "image-partial", "text", "text-partial"],
)
def test_tower_states_and_counts(lock, image, text):
    cfg = ModelConfig(preset="micro", **lock)
    model = build_model(cfg)
    counts = trainable.param_counts(model, cfg)
    n_trainable, n_frozen = _counts(model)
    assert (counts["params_trainable"], counts["params_frozen"]) == (n_trainable, n_frozen)
    assert n_trainable + n_frozen == sum(p.numel() for p in model.parameters())
    assert (counts["image_tower"], counts["text_tower"]) == (image, text)
    for name, tower in (("image", model.visual), ("text", model.text)):
        assert (counts[f"{name}_params_trainable"], counts[f"{name}_params_frozen"]) == _counts(tower)

    line = trainable.describe(counts)
    assert line.startswith(f"parameters: {n_trainable:,} trainable, {n_frozen:,} frozen; ")
    vt, vf = _counts(model.visual)
    tt, tf = _counts(model.text)
    expected = {
        "trainable": (f"image tower: trainable ({vt:,})", f"text tower: trainable ({tt:,})"),
        "locked": (f"image tower: locked ({vf:,} frozen)", f"text tower: locked ({tf:,} frozen)"),
        "partly unlocked": (
            f"image tower: partly unlocked (last 1 layer group: {vt:,} trainable, {vf:,} frozen)",
            f"text tower: partly unlocked (last 1 layer: {tt:,} trainable, {tf:,} frozen)",
        ),
    }
    assert expected[image][0] in line and expected[text][1] in line, line
    if "partly unlocked" in (image, text):
        assert 0 < min(vt, tt) and 0 < max(vf, tf)  # the premise: the partial tower has both kinds


def test_tower_dropout_is_named_as_the_one_per_rank_draw():
    """micro has no dropout (no line); a Dropout added to one block's MLP is named with its p."""
    model = build_model(ModelConfig(preset="micro"))
    assert trainable.dropout_line(model) is None
    model.visual.transformer.resblocks[0].mlp.add_module("drop", torch.nn.Dropout(0.1))
    line = trainable.dropout_line(model)
    assert line is not None and "\n" not in line and "p = 0.1" in line and "each rank's generator" in line
