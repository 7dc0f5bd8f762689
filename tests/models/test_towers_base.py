"""The tower registry (models/towers/base.py): a dict's ``kind:`` chooses its kind, a dict without
one (an old saved model, a preset, an open_clip config) is claimed by exactly one kind whatever
the registration order, every hook has a declared default, and a kind without ``flops()`` is
counted by torch's FLOP counter."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import mmalign
from mmalign.config import ConfigError, ModelConfig
from mmalign.data.transforms import preprocess_cfg
from mmalign.errors import UsageError
from mmalign.models import build_model
from mmalign.models.io import save_pretrained
from mmalign.models.presets import preset_arch
from mmalign.models.towers import (
    Towers,
    TowerSpec,
    register_tower,
    registered,
    spec_class,
    spec_from_cfg,
    unregister_tower,
)
from tests.harness import ROOT

BUILT_IN = ["open_clip_vit", "open_clip_resnet", "timm", "open_clip_text", "hf_text"]

# tower dicts without kind:, as old saved models, presets and open_clip configs hold them, and
# the kind each one is (written out here: the spec, not the code's answer)
OLD_DICTS = [
    ("vision", {"image_size": 16, "layers": 1, "width": 32, "patch_size": 4}, "open_clip_vit"),
    ("vision", {}, "open_clip_vit"),
    ("vision", {"image_size": 224, "layers": [3, 4, 6, 3], "width": 64}, "open_clip_resnet"),
    ("vision", {"timm_model_name": "test_resnet", "image_size": 32}, "timm"),
    ("vision", {"timm_model_name": "test_vit", "layers": [1, 1]}, "timm"),
    ("text", {"context_length": 16, "width": 32, "heads": 2, "layers": 1}, "open_clip_text"),
    ("text", {"tokenizer_kwargs": {"sentencepiece": "tok.model"}}, "open_clip_text"),
    ("text", {"hf_model_name": "/models/bert", "hf_tokenizer_name": "/models/bert"}, "hf_text"),
    ("text", {"hf_local_dir": "/models/bert"}, "hf_text"),
]


def _kinds() -> list[str]:
    return [spec_from_cfg(side, cfg).kind for side, cfg, _ in OLD_DICTS]


def test_registration_order_does_not_decide_a_kind():
    """Every order of registering the built-in kinds (the old registry asked the newest first, so
    importing them in another order changed what a dict was) gives each old dict its kind."""
    classes = {kind: spec_class(cls_side, kind) for kind, cls_side in _sides().items()}
    want = [kind for _, _, kind in OLD_DICTS]
    original = registered()
    try:
        for order in itertools.permutations(BUILT_IN):
            for kind in BUILT_IN:
                unregister_tower(kind)
            for kind in order:
                register_tower(kind)(classes[kind])
            assert registered() == [k for k in original if k not in BUILT_IN] + list(order)
            assert _kinds() == want, order
    finally:
        for kind in BUILT_IN:
            unregister_tower(kind)
        for kind in original:
            if kind in classes:
                register_tower(kind)(classes[kind])
    assert _kinds() == want


def _sides() -> dict[str, str]:
    return {k: "vision" for k in registered("vision")} | {k: "text" for k in registered("text")}


def test_a_kind_key_chooses_the_kind_over_the_claims():
    # claimed by the ViT without kind:, the timm kind with it
    assert spec_from_cfg("vision", {"image_size": 32}).kind == "open_clip_vit"
    spec = spec_from_cfg("vision", {"kind": "timm", "image_size": 32, "timm_model_name": "test_resnet"})
    assert spec.kind == "timm" and spec.to_cfg() == {"image_size": 32, "timm_model_name": "test_resnet"}
    arch = Towers.from_arch({"embed_dim": 8, "vision_cfg": {"kind": "timm"}, "text_cfg": {}}).to_arch()
    assert arch["vision_cfg"] == {"kind": "timm"} and arch["text_cfg"] == {"kind": "open_clip_text"}


@pytest.mark.parametrize(
    "vision, message",
    [
        ({"kind": "nope"}, "config key 'model.vision.kind': vision tower kind 'nope' is not registered"),
        ({"kind": "open_clip_text"}, "vision tower kind 'open_clip_text' is not registered"),
    ],
)
def test_an_unknown_kind_is_one_config_error_line(vision, message):
    with pytest.raises(ConfigError) as e:
        build_model(ModelConfig(preset="micro", vision=vision))
    assert message in str(e.value) and "\n" not in str(e.value)
    assert "open_clip_vit" in str(e.value)  # the registered vision kinds are named


def test_a_model_saved_without_kinds_loads_and_saves_them(tmp_path):
    """A model folder written before kind: existed (its arch's tower dicts have none) loads with
    the same kinds and outputs; saved again, its arch names them."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="micro-rn")).eval()
    assert model.arch["vision_cfg"]["kind"] == "open_clip_resnet"
    assert model.arch["text_cfg"]["kind"] == "open_clip_text"
    final = save_pretrained(model, tmp_path / "new", preprocess=preprocess_cfg(model.image_size))
    config = json.loads((final / "model_config.json").read_text())
    assert config["arch"]["vision_cfg"]["kind"] == "open_clip_resnet"
    for part in ("vision_cfg", "text_cfg"):  # as an older mmalign wrote it
        del config["arch"][part]["kind"]
    (final / "model_config.json").write_text(json.dumps(config))
    old = mmalign.load(final)
    assert (old.model.towers.vision.kind, old.model.towers.text.kind) == (
        "open_clip_resnet",
        "open_clip_text",
    )
    images = torch.randn(2, 3, model.image_size, model.image_size)
    with torch.no_grad():
        assert torch.equal(old.encode_image(images), model.encode_image(images))
    again = save_pretrained(old.model, tmp_path / "again", preprocess=preprocess_cfg(model.image_size))
    assert json.loads((again / "model_config.json").read_text())["arch"] == model.arch


def test_a_config_kind_other_than_the_presets_starts_from_its_own_keys():
    from mmalign.models.arch import resolve_arch

    arch = resolve_arch(
        ModelConfig(preset="micro", vision={"kind": "timm", "timm_model_name": "test_resnet"})
    )
    assert arch["vision_cfg"] == {
        "kind": "timm",
        "timm_model_name": "test_resnet",
        "timm_model_pretrained": False,
    }
    same = resolve_arch(ModelConfig(preset="micro", vision={"kind": "open_clip_vit", "width": 64}))
    assert same["vision_cfg"] == {"kind": "open_clip_vit", **preset_arch("micro")["vision_cfg"], "width": 64}


# ---------------------------------------------------------------- declared hooks
@dataclasses.dataclass
class _Bare(TowerSpec):
    side = "text"


def test_every_hook_has_a_declared_default():
    bare = _Bare()
    assert (bare.image_size, bare.context_length, bare.tokenizer_file, bare.folder) == (224, 77, None, None)
    assert not bare.ships_files and bare.export_files(ROOT / "nowhere") is None
    assert bare.lock_groups(nn.Linear(2, 2)) == 0 and not _Bare.claims({"anything": 1})
    for hook, args in (
        ("tokenizer", ()),
        ("open_clip_cfg", ()),
        ("onnx_input", (1,)),
        ("onnx_tokenizer", (None,)),
    ):
        with pytest.raises(UsageError, match=f"tower kind has no {hook.split('_')[0]}|kind has no"):
            getattr(bare, hook)(*args)
    with pytest.raises(NotImplementedError):
        bare.build(8, False)


def test_no_caller_looks_a_tower_hook_up_by_name():
    """The hooks are declared on TowerSpec: mmalign calls them, never ``getattr(spec, "hook")``."""
    hooks = [
        name
        for name, value in vars(TowerSpec).items()
        if not name.startswith("__") and (callable(value) or isinstance(value, (property, classmethod)))
    ]
    assert {"tokenizer", "tokenizer_file", "folder", "onnx_tokenizer", "export_files", "flops"} <= set(hooks)
    names = "|".join(hooks)
    found = re.compile(rf"(?:getattr|hasattr)\([^,()]+,\s*[\"']({names})[\"']")
    uses = [
        f"{path.relative_to(ROOT)}: {m.group(0)}"
        for path in sorted((ROOT / "mmalign").rglob("*.py"))
        for m in found.finditer(path.read_text())
        if m.group(1) != "lock"  # a module's own lock() (open_clip's), checked before TowerSpec.lock calls it
    ]
    assert uses == []


# ---------------------------------------------------------------- flops() by default
class _Pool(nn.Module):
    """A convolution, a mean over the grid and a linear head (B, 3, H, W) -> (B, D)."""

    def __init__(self, width: int, embed_dim: int, data_dependent: bool):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, stride=2)
        self.head = nn.Linear(width, embed_dim)
        self.data_dependent = data_dependent

    def forward(self, x):
        y = self.conv(x).mean((2, 3))  # (B, W)
        if self.data_dependent:  # reads a value: no meta-device forward
            y = y * (1.0 if float(y.abs().sum()) >= 0 else 2.0)
        return self.head(y)  # (B, D)


@dataclasses.dataclass
class _Counted(TowerSpec):
    side = "vision"
    image_size: int = 12
    pool_width: int = 6
    data_dependent: bool = False

    def build(self, embed_dim, quick_gelu):
        return _Pool(self.pool_width, embed_dim, self.data_dependent)

    def onnx_input(self, batch, tokenizer=None):
        return torch.randn(batch, 3, self.image_size, self.image_size)  # (B, 3, H, W)


@pytest.mark.parametrize("data_dependent", [False, True])
def test_a_kind_without_flops_is_counted_by_torchs_flop_counter(data_dependent):
    spec = _Counted(data_dependent=data_dependent)
    module = spec.build(16, False).eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        module(torch.randn(1, 3, 12, 12))
    # conv: 5 x 5 outputs x 6 channels x 27 multiply-adds; head: 6 x 16; 2 FLOPs each
    assert spec.flops(16) == counter.get_total_flops() == 2 * (25 * 6 * 27 + 6 * 16)


class _Bag(nn.Module):
    """Mean of token embeddings (B, L) -> (B, D)."""

    def __init__(self, embed_dim: int):
        super().__init__()
        self.embed = nn.Embedding(100, embed_dim)

    def forward(self, tokens):
        return self.embed(tokens).mean(1)  # (B, D)


def test_a_text_kind_without_a_tokenizer_is_refused_before_the_run():
    """check_buildable (before any rank starts): one ConfigError naming model.text, never a
    default tokenizer."""
    from mmalign.models import check_buildable

    @dataclasses.dataclass
    class Bag(TowerSpec):
        side = "text"

        def build(self, embed_dim, quick_gelu):
            return _Bag(embed_dim)

    register_tower("bag_text")(Bag)
    try:
        with pytest.raises(
            ConfigError, match="^config key 'model.text': the bag_text text tower kind has no tokenizer"
        ):
            check_buildable(ModelConfig(preset="micro", text={"kind": "bag_text"}))
    finally:
        unregister_tower("bag_text")
