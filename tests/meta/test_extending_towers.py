"""docs/architecture.md "Adding a tower kind", followed step by step from outside the package:
a toy image tower kind is defined and registered here, chosen by ``kind:`` on the command line,
trained, saved with its kind and loaded back, then unregistered."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import mmalign
from mmalign.errors import UserError
from mmalign.models.towers import TowerSpec, register_tower, unregister_tower
from tests.harness import cli_main


class ToyTower(nn.Module):
    """Step 3's module: images (B, 3, H, W) -> features (B, D)."""

    def __init__(self, width: int, embed_dim: int):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 4, stride=4)  # 4x4 patches
        self.proj = nn.Linear(width, embed_dim)

    def forward(self, images):
        return self.proj(self.conv(images).mean((2, 3)))  # (B, D)

    def lock(self, unlocked_groups=0, freeze_bn_stats=False):  # the default lock() hook calls this
        self.requires_grad_(False)


@pytest.fixture
def toy_kind():
    # steps 1 and 2: a TowerSpec dataclass with its side and its config keys, registered by name
    @register_tower("toy_patches")
    @dataclasses.dataclass
    class ToySpec(TowerSpec):
        side = "vision"
        image_size: int = 16
        toy_width: int = 8

        def build(self, embed_dim, quick_gelu):  # step 3
            return ToyTower(self.toy_width, embed_dim)

        def onnx_input(self, batch, tokenizer=None):  # step 4: a hook this kind has
            return torch.randn(batch, 3, self.image_size, self.image_size)  # (B, 3, H, W)

    yield ToySpec
    unregister_tower("toy_patches")


def test_a_tower_kind_added_as_the_guide_says(toy_kind, micro_overrides, tmp_path):
    # step 5: kind: in the tower's config dict selects it (here through mmalign train --set)
    fast = ["train.steps=2", "train.global_batch_size=8", "eval.suite=none", "monitor.probe_size=0"]
    kind = ["model.vision.kind=toy_patches", "model.vision.toy_width=6"]
    res = cli_main("train", *[a for o in micro_overrides + fast + kind for a in ("--set", o)])
    assert res.returncode == 0, res.stderr
    run = tmp_path / "run"
    # step 6: the saved architecture names the kind, with only its own keys
    arch = json.loads((run / "final" / "model_config.json").read_text())["arch"]
    assert arch["vision_cfg"] == {"kind": "toy_patches", "toy_width": 6}
    assert arch["text_cfg"]["kind"] == "open_clip_text"
    loaded = mmalign.load(run)
    spec = loaded.model.towers.vision
    assert isinstance(spec, toy_kind) and spec.toy_width == 6 and isinstance(loaded.model.visual, ToyTower)
    images = torch.randn(2, 3, 16, 16)
    assert loaded.encode_image(images).shape == (2, loaded.model.embed_dim)
    # step 4's defaults: no flops() written, so torch's FLOP counter counts a forward at batch 1
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        loaded.model.visual(images[:1])
    assert spec.flops(loaded.model.embed_dim) == counter.get_total_flops() > 0
    with pytest.raises(UserError, match="toy_patches tower kind has no open_clip export"):
        spec.open_clip_cfg()
    # step 2: once unregistered, the saved model names a kind nobody knows: one line
    unregister_tower("toy_patches")
    with pytest.raises(UserError, match="vision tower kind 'toy_patches' is not registered") as e:
        mmalign.load(run)
    assert "\n" not in str(e.value)
