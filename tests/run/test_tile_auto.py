"""``loss.tile_size: auto``: the choice around the budget, and the loss it picks against a naive
float64 full-matrix reference (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmalign.config import ConfigError, load_config
from mmalign.data.batch import Batch
from mmalign.losses import infonce, siglip
from mmalign.losses.tile_choice import choose_tile, resolve_tile
from mmalign.models.embeddings import Embeddings
from mmalign.objective import build_objective
from tests.harness import naive_clip_loss, unit

MIB = 2**20


def test_one_process_infonce_switches_at_the_budget():
    # untiled one-process InfoNCE: (1 saved + 2 transient) x B^2 x 4 bytes; 1 MiB holds B = 295, not 296
    assert 3 * 295**2 * 4 <= MIB < 3 * 296**2 * 4
    assert choose_tile("infonce", 295, 295, torch.float32, budget_mb=1) is None
    # tiled: 3 t^2 x 4 bytes; 256 fits 1 MiB (786432 bytes), 512 does not
    assert choose_tile("infonce", 296, 296, torch.float32, budget_mb=1) == 256
    # float64 logits take twice the bytes: the switch moves to B = 209 (3 * 209^2 * 8 = 1048344)
    assert choose_tile("infonce", 209, 209, torch.float64, budget_mb=1) is None
    assert choose_tile("infonce", 210, 210, torch.float64, budget_mb=1) == 128
    # bf16 / fp16 features: logits in float32, like fp32
    assert choose_tile("infonce", 295, 295, torch.bfloat16, budget_mb=1) is None
    assert choose_tile("infonce", 296, 296, torch.float16, budget_mb=1) == 256


def test_default_budget_sizes():
    # 256 MiB: one process keeps B = 4096 untiled (192 MiB) and tiles B = 8192 at 4096 (192 MiB of tiles)
    assert choose_tile("infonce", 4096, 4096) is None
    assert choose_tile("infonce", 8192, 8192) == 4096
    # sharded: two saved (B, W*B) matrices + 2 transients; B = 512 of W*B = 32768 is exactly 256 MiB
    assert choose_tile("infonce_sharded", 512, 32768) is None
    assert choose_tile("infonce_sharded", 512, 32769) == 4096
    # SigLIP keeps more (B, N) matrices: (4 + 2) x 512 x 16384 x 4 = 192 MiB fits, 2x that does not
    assert choose_tile("siglip", 512, 16384) is None
    assert choose_tile("siglip", 512, 32768) == 4096


def test_small_budget_floors_the_tile():
    assert choose_tile("infonce", 1000, 1000, torch.float32, budget_mb=0.001) == 64
    with pytest.raises(ValueError):
        choose_tile("infonce", 10, 10, budget_mb=0)
    with pytest.raises(ValueError):
        choose_tile("nope", 10, 10)


def test_integers_pass_through():
    assert resolve_tile(0, "infonce", 10**6, 10**6, torch.float32) is None
    assert resolve_tile(None, "infonce", 10**6, 10**6, torch.float32) is None
    assert resolve_tile(512, "infonce", 4, 4, torch.float32) == 512
    assert resolve_tile("auto", "infonce", 4, 4, torch.float32) is None


def test_config_keys():
    cfg = load_config(None, [])
    assert cfg.loss.tile_size == "auto" and cfg.loss.tile_budget_mb == 256.0
    assert load_config(None, ["loss.tile_size=512"]).loss.tile_size == 512
    for bad, key in (
        ("loss.tile_size=-1", "loss.tile_size"),
        ("loss.tile_size=big", "loss.tile_size"),
        ("loss.tile_budget_mb=0", "loss.tile_budget_mb"),
    ):
        with pytest.raises(ConfigError, match=f"config key '{key}'"):
            load_config(None, [bad])


def _naive_siglip(img, txt, scale, bias):
    logits = scale * img @ txt.T + bias  # (B, B)
    signs = 2 * torch.eye(img.shape[0], dtype=img.dtype) - 1
    return -F.logsigmoid(signs * logits).sum() / img.shape[0]


def _spy(monkeypatch, module, name, tile_arg):
    calls = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        calls.append(args[tile_arg])  # the tile edge
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return calls


# B = 150 float64 rows: the untiled InfoNCE needs 3 * 150^2 * 8 = 0.51 MiB, SigLIP 6 * 150^2 * 8 = 1.03 MiB.
# A 0.4 MiB budget tiles both at 128 (3 * 128^2 * 8 = 0.375 MiB): 2 x 2 tiles, a ragged edge; 2 MiB fits both.
@pytest.mark.parametrize("name", ["infonce", "siglip"])
@pytest.mark.parametrize("budget, tiled", [(0.4, True), (2.0, False)])
def test_auto_matches_the_naive_reference(gen, monkeypatch, name, budget, tiled):
    b, d = 150, 16
    extra = ["loss.name=siglip", "model.init_logit_bias=-10"] if name == "siglip" else []
    cfg = load_config(None, ["loss.tile_size=auto", f"loss.tile_budget_mb={budget}", *extra])
    objective = build_objective(cfg, 1)
    calls = (
        _spy(monkeypatch, siglip, "tiled_sigmoid_rows", 4)
        if name == "siglip"
        else _spy(monkeypatch, infonce, "tiled_lse", 3)
    )
    feats = {
        "image": unit(gen, b, d, torch.float64),
        "text": unit(gen, b, d, torch.float64),
        "logit_scale": torch.tensor([14.0], dtype=torch.float64),
    }
    if name == "siglip":
        feats["logit_bias"] = torch.tensor([-3.0], dtype=torch.float64)
    leaves = {k: v.clone().requires_grad_() for k, v in feats.items()}
    batch = Batch(torch.zeros(b, 1), torch.zeros(b, 1, dtype=torch.long))
    out = objective(Embeddings(**leaves), batch)
    out.loss.backward()
    assert calls == ([128] if tiled else []), calls  # the path auto took
    refs = {k: v.clone().requires_grad_() for k, v in feats.items()}
    want = (
        _naive_siglip(refs["image"], refs["text"], refs["logit_scale"], refs["logit_bias"])
        if name == "siglip"
        else naive_clip_loss(refs["image"], refs["text"], refs["logit_scale"])
    )
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-12)
    for k in leaves:
        torch.testing.assert_close(leaves[k].grad, refs[k].grad, rtol=1e-10, atol=1e-12)
