"""Every registered tower kind through one parametrised test: build, forward, a gradient on every
trainable parameter, lock, export round trips (open_clip, HF CLIPModel where the kind has one,
ONNX), init_from and its FLOP count against the counted one; the typed specs round-trip the saved
dicts exactly; a toy kind registered from this file alone trains, exports and reloads."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

import mmalign
from mmalign.config import ModelConfig, load_config
from mmalign.data.transforms import preprocess_cfg
from mmalign.errors import UsageError
from mmalign.export import export
from mmalign.models import build_model
from mmalign.models.io import save_pretrained
from mmalign.models.presets import PRESETS, preset_arch
from mmalign.models.towers import (
    Towers,
    TowerSpec,
    register_tower,
    registered,
    spec_from_cfg,
    unregister_tower,
)
from mmalign.run.monitors import flop_counter
from tests.harness import ROOT

CAPTIONS = ["a red circle", "a blue square on the left"]


def _model_cfg(kind: str, tmp_path) -> ModelConfig:
    """A tiny model whose vision or text tower is ``kind`` (the other one micro's)."""
    if kind == "open_clip_resnet":
        return ModelConfig(preset="micro-rn")
    if kind == "timm":
        return ModelConfig(preset="micro", vision={"timm_model_name": "test_resnet"}, image_size=32)
    if kind == "hf_text":
        from tests.models.test_hf_text_tower import make_bert_folder

        return ModelConfig(preset="micro", text={"hf_local_dir": str(make_bert_folder(tmp_path / "bert"))})
    return ModelConfig(preset="micro")


def _spec(model, kind):
    towers = model.towers
    return towers.vision if towers.vision.kind == kind else towers.text


def _counted(module: nn.Module, example: torch.Tensor) -> int:
    counter = flop_counter()
    with counter, torch.no_grad():
        module(example)
    return int(counter.get_total_flops())


BUILT_IN = ["open_clip_vit", "open_clip_resnet", "timm", "open_clip_text", "hf_text"]


def test_built_in_kinds_are_registered():
    assert set(BUILT_IN) <= set(registered())
    assert {"open_clip_vit", "open_clip_resnet", "timm"} <= set(registered("vision"))
    assert {"open_clip_text", "hf_text"} <= set(registered("text"))


@pytest.mark.parametrize("kind", BUILT_IN)
def test_every_tower_kind(kind, tmp_path):
    torch.manual_seed(0)
    model = build_model(_model_cfg(kind, tmp_path))
    spec = _spec(model, kind)
    assert spec.kind == kind
    side = "visual" if spec.side == "vision" else "text"
    module = getattr(model, side)
    from mmalign.models.tokenizers import build_tokenizer

    tokens = build_tokenizer(model.towers)(CAPTIONS)  # (2, L)
    assert tokens.shape == (2, model.context_length)
    images = torch.randn(2, 3, model.image_size, model.image_size)
    # forward + a gradient on every trainable parameter
    model.train()
    out = model(images=images, texts=tokens)
    assert out.image.shape == out.text.shape == (2, model.embed_dim)
    ((out.image @ out.text.T) * out.logit_scale).logsumexp(-1).sum().backward()
    missing = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or not p.grad.isfinite().all())
    ]
    assert missing == []
    # FLOPs: the kind's own count equals torch's counter on the real module (eval: no patch dropout)
    model.eval()
    example = spec.onnx_input(1, build_tokenizer(spec)) if spec.side == "text" else spec.onnx_input(1)
    assert spec.flops(model.embed_dim) == _counted(module, example)
    # save, reload, export
    final = save_pretrained(model, tmp_path / "final", preprocess=preprocess_cfg(model.image_size))
    loaded = mmalign.load(final)
    saved = json.loads((final / "model_config.json").read_text())["arch"]
    assert Towers.from_arch(saved).to_arch() == saved and _spec(loaded.model, kind).kind == kind
    assert kind in (saved["vision_cfg"]["kind"], saved["text_cfg"]["kind"])  # written into the saved arch
    with torch.no_grad():
        want_img, want_txt = model.encode_image(images), model.encode_text(tokens)
        assert torch.allclose(loaded.encode_image(images), want_img, atol=1e-5)
        assert torch.allclose(loaded.encode_text(loaded.tokenizer(CAPTIONS)), want_txt, atol=1e-5)
    _open_clip_round_trip(final, tmp_path, images, tokens, want_img, want_txt)
    _onnx_round_trip(final, tmp_path, images, tokens, want_img, want_txt)
    if model.towers.vision.hf_clip and model.towers.text.hf_clip:
        from transformers import CLIPModel

        export(final, "hf", tmp_path / "hf")
        hf = CLIPModel.from_pretrained(str(tmp_path / "hf")).eval()
        with torch.no_grad():
            img = hf.get_image_features(pixel_values=images).pooler_output
        assert torch.allclose(torch.nn.functional.normalize(img, dim=-1), want_img, atol=1e-4)
    else:
        with pytest.raises(UsageError, match=f"the {kind} .* tower kind"):
            export(final, "hf", tmp_path / "hf")
    # init_from: model.pretrained=FOLDER starts from these weights
    again = build_model(ModelConfig(pretrained=str(final))).eval()
    with torch.no_grad():
        assert torch.allclose(again.encode_image(images), want_img, atol=1e-5)
    # lock: the tower's weights stop taking gradients; the other tower's do not
    before = sum(p.requires_grad for p in module.parameters())
    model.lock(side, 0)
    trainable = [n for n, p in module.named_parameters() if p.requires_grad]
    # open_clip's HFTextEncoder / TimmModel locks keep their heads (and HF LayerNorms) trainable (LiT)
    assert len(trainable) < before and (kind in ("hf_text", "timm") or trainable == [])
    assert any(p.requires_grad for n, p in model.named_parameters() if not n.startswith(side + "."))
    assert spec.lock_groups(module) >= 0


def _open_clip_round_trip(final, tmp_path, images, tokens, want_img, want_txt):
    import open_clip

    out = export(final, "open_clip", tmp_path / "oc")
    oc, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    oc.eval()
    with torch.no_grad():
        assert torch.allclose(oc.encode_image(images, normalize=True), want_img, atol=1e-5)
        assert torch.allclose(oc.encode_text(tokens, normalize=True), want_txt, atol=1e-5)


def _onnx_round_trip(final, tmp_path, images, tokens, want_img, want_txt):
    import onnxruntime as ort

    out = export(final, "onnx", tmp_path / "onnx")
    img = ort.InferenceSession(str(out / "image_encoder.onnx"), providers=["CPUExecutionProvider"])
    txt = ort.InferenceSession(str(out / "text_encoder.onnx"), providers=["CPUExecutionProvider"])
    assert np.abs(img.run(None, {"pixels": images.numpy()})[0] - want_img.numpy()).max() <= 1e-4
    assert np.abs(txt.run(None, {"tokens": tokens.numpy()})[0] - want_txt.numpy()).max() <= 1e-4


@pytest.mark.parametrize(
    "name",
    [
        "tiny",
        "tiny-rn",
        "micro",
        "micro-rn",
        "RN50",
        "ViT-B-32",
        "ViT-L-14",
        "convnext_base",
        "EVA02-B-16",
        "ViT-B-16-SigLIP",
        "coca_ViT-B-32",
    ],
)
def test_specs_round_trip_saved_dicts_exactly(name):
    """A dict without kind: comes back with its kind first and every other key as it was, in its
    order; the dict with kind: comes back equal."""
    arch = preset_arch(name)
    back = Towers.from_arch(arch).to_arch()
    for part in ("vision_cfg", "text_cfg"):
        assert list(back[part]) == ["kind", *arch[part]]
        assert {k: v for k, v in back[part].items() if k != "kind"} == arch[part]
    assert {k: v for k, v in back.items() if k not in ("vision_cfg", "text_cfg")} == {
        k: v for k, v in arch.items() if k not in ("vision_cfg", "text_cfg")
    }
    again = Towers.from_arch(back).to_arch()
    assert again == back and all(list(again[p]) == list(back[p]) for p in ("vision_cfg", "text_cfg"))


def test_typed_fields_and_analytic_flops():
    towers = Towers.from_arch(preset_arch("micro"))  # ViT 1x32 on 16 px / 4 px patches, text 1x32 over 16
    assert (towers.vision.kind, towers.text.kind) == ("open_clip_vit", "open_clip_text")
    assert (towers.vision.width, towers.vision.patch_size, towers.text.context_length) == (32, 4, 16)
    patches, t, w = 16, 17, 32
    block = t * w * 3 * w + 2 * t * t * w + t * w * w + 2 * t * w * 4 * w
    assert towers.vision.flops(32) == 2 * (patches * 3 * 16 * w + block + w * 32)
    block = 16 * w * 3 * w + 2 * 16 * 16 * w + 16 * w * w + 2 * 16 * w * 4 * w
    assert towers.text.flops(32) == 2 * (block + w * 32)
    changed = towers.vision.replace(width=64)
    assert changed.to_cfg()["width"] == 64 and towers.vision.to_cfg()["width"] == 32


def _layer_formula_flops(module: nn.Module, example: torch.Tensor) -> int:
    """FLOPs by the textbook formulas, layer by layer (shapes from forward hooks): a Conv2d is
    2 x (C_in / groups) x k_h x k_w x C_out x H_out x W_out, a Linear 2 x in x out per row.
    Independent of torch's FLOP counter, which the towers' own counts use."""
    total = [0]

    def conv(m, args, out):
        kh, kw = m.kernel_size
        total[0] += 2 * (m.in_channels // m.groups) * kh * kw * out.numel()

    def linear(m, args, out):
        total[0] += 2 * m.in_features * out.numel()

    hooks = [m.register_forward_hook(conv) for m in module.modules() if isinstance(m, nn.Conv2d)]
    hooks += [m.register_forward_hook(linear) for m in module.modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        module(example)
    for h in hooks:
        h.remove()
    return total[0]


def test_timm_and_hf_flops_equal_the_analytic_count(tmp_path):
    """The two kinds whose count is measured (timm's trunks and transformers' encoders are too
    many for one formula each) against formulas: timm's test_resnet layer by layer (convolutions
    and linears), the BERT text tower as a transformer (models/towers/vit.transformer_flops) plus
    open_clip's mean pooler (no matmul) and its two-layer projection."""
    from mmalign.models.towers.vit import transformer_flops

    model = build_model(_model_cfg("timm", tmp_path)).eval()
    spec = _spec(model, "timm")
    assert spec.flops(model.embed_dim) == _layer_formula_flops(model.visual, spec.onnx_input(1)) > 0

    model = build_model(_model_cfg("hf_text", tmp_path)).eval()
    spec = _spec(model, "hf_text")
    width, layers, mlp, d = 16, 1, 32, model.embed_dim  # make_bert_folder's config
    hidden = (width + d) // 2  # open_clip's "mlp" projection: width -> (width + D) / 2 -> D
    want = transformer_flops(spec.context_length, width, layers, mlp) + 2 * (width * hidden + hidden * d)
    assert spec.flops(d) == want


def test_presets_are_package_data():
    import tomllib

    files = sorted(p.stem for p in (ROOT / "mmalign/models/preset_data").glob("*.yaml"))
    assert files == sorted(PRESETS) and {"tiny", "tiny-rn", "micro", "micro-rn"} <= set(files)
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "mmalign"
    ]
    assert "models/preset_data/*.yaml" in data


# ---------------------------------------------------------------- a toy kind, from this file alone
class _Toy(nn.Module):
    """Average-pool to 4x4, then one linear map to the joint space."""

    def __init__(self, width: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Linear(3 * 16, width)
        self.head = nn.Linear(width, embed_dim)

    def forward(self, x):  # (B, 3, H, W) -> (B, D)
        pooled = nn.functional.adaptive_avg_pool2d(x, 4).flatten(1)  # (B, 48)
        return self.head(torch.relu(self.proj(pooled)))

    def lock(self, unlocked_groups=0, freeze_bn_stats=False):
        for p in self.parameters():
            p.requires_grad = False


@dataclasses.dataclass
class ToySpec(TowerSpec):
    side = "vision"
    image_size: int = 16
    toy_width: int = 8

    @classmethod
    def claims(cls, cfg):
        return "toy_width" in cfg

    def build(self, embed_dim, quick_gelu):
        return _Toy(self.toy_width, embed_dim)

    def onnx_input(self, batch, tokenizer=None):
        return torch.randn(batch, 3, self.image_size, self.image_size)

    def flops(self, embed_dim):
        return 2 * (48 * self.toy_width + self.toy_width * embed_dim)


@pytest.fixture
def toy_kind():
    register_tower("toy_pool")(ToySpec)
    yield "toy_pool"
    unregister_tower("toy_pool")


def test_a_toy_kind_registered_here_trains_exports_and_reloads(toy_kind, micro_overrides, tmp_path):
    from mmalign.run.train import train

    assert isinstance(spec_from_cfg("vision", {**PRESETS["micro"]["vision_cfg"], "toy_width": 8}), ToySpec)
    fast = ["train.steps=3", "train.global_batch_size=8", "eval.suite=none", "monitor.probe_size=0"]
    run = train(load_config(None, micro_overrides + fast + ["model.vision.toy_width=8"]), show_progress=False)
    loaded = mmalign.load(run)
    assert isinstance(loaded.model.visual, _Toy) and loaded.model.towers.vision.kind == toy_kind
    images = torch.randn(2, 3, 16, 16)
    out = export(run, "onnx", tmp_path / "onnx")
    import onnxruntime as ort

    got = ort.InferenceSession(str(out / "image_encoder.onnx"), providers=["CPUExecutionProvider"])
    assert (
        np.abs(got.run(None, {"pixels": images.numpy()})[0] - loaded.encode_image(images).numpy()).max()
        <= 1e-5
    )
    with pytest.raises(UsageError, match="toy_pool tower kind has no open_clip export"):
        export(run, "open_clip", tmp_path / "oc")
    assert _counted(loaded.model.visual, images[:1]) == loaded.model.towers.vision.flops(
        loaded.model.embed_dim
    )


def test_a_text_kind_without_a_tokenizer_hook_fails_loudly(tmp_path):
    @dataclasses.dataclass
    class Mute(TowerSpec):
        side = "text"
        mute_width: int = 4
        context_length: int = 8

        @classmethod
        def claims(cls, cfg):
            return "mute_width" in cfg

    register_tower("mute_text")(Mute)
    try:
        from mmalign.models.tokenizers import build_tokenizer

        with pytest.raises(UsageError, match="mute_text text tower kind has no tokenizer"):
            build_tokenizer({"embed_dim": 8, "vision_cfg": {}, "text_cfg": {"mute_width": 4}})
    finally:
        unregister_tower("mute_text")
