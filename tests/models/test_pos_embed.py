"""A ViT checkpoint at a new image size or patch size: the position embeddings equal timm's
``resample_abs_pos_embed`` on the same tensor (class token kept), the patch kernel timm's
``resample_patch_embed``; every other weight is the source's; one log line (from grid, to grid);
a grid that cannot be read is one ConfigError line."""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from timm.layers import resample_abs_pos_embed, resample_patch_embed

from mmalign.config import Config, ConfigError, ModelConfig, resolve, validate
from mmalign.data.transforms import preprocess_cfg
from mmalign.export import export
from mmalign.models import TwoTower, build_model, check_buildable
from mmalign.models.io import save_pretrained
from mmalign.models.load import load
from mmalign.models.pos_embed import resample_patch_embed as our_patch
from mmalign.models.pos_embed import resample_pos_embed
from mmalign.models.presets import PRESETS

POS, PATCH = "visual.positional_embedding", "visual.conv1.weight"


@pytest.mark.parametrize(
    "cells,new,old,prefix,mode,antialias",
    [
        (49, (14, 14), None, 1, "bicubic", True),  # a larger image: 7x7 -> 14x14
        (196, (7, 7), None, 1, "bicubic", True),  # smaller: the antialiasing filter acts
        (196, (9, 12), None, 1, "bicubic", False),
        (15, (6, 4), (3, 5), 1, "bicubic", True),  # a non-square source grid, given
        (64, (5, 5), None, 0, "bicubic", True),  # SigLIP: no class token
        (36, (8, 8), None, 4, "bilinear", True),  # a class token and three registers
        (16, (6, 6), None, 1, "nearest", False),
    ],
)
@pytest.mark.parametrize("batched", [False, True])
def test_equals_timm_resample_abs_pos_embed(cells, new, old, prefix, mode, antialias, batched):
    g = torch.Generator().manual_seed(cells + prefix)
    pe = torch.randn(1, prefix + cells, 24, generator=g)  # (1, N, D): timm's layout
    want = resample_abs_pos_embed(
        pe, list(new), None if old is None else list(old), prefix, mode, antialias=antialias
    )
    got = resample_pos_embed(pe if batched else pe[0], new, old, prefix, mode, antialias)
    assert got.shape == ((1,) if batched else ()) + (prefix + new[0] * new[1], 24)
    assert torch.equal(got if batched else got.unsqueeze(0), want)
    assert torch.equal(got.reshape(-1, 24)[:prefix], pe[0, :prefix])  # the prefix tokens as they were


def test_bfloat16_keeps_its_dtype_as_timm_does():
    pe = torch.randn(1, 1 + 16, 8, generator=torch.Generator().manual_seed(1)).bfloat16()
    got = resample_pos_embed(pe, (6, 6))
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, resample_abs_pos_embed(pe, [6, 6]))


def test_the_same_grid_is_returned_untouched_and_a_wrong_grid_is_a_clear_error():
    pe = torch.randn(17, 8)
    assert resample_pos_embed(pe, (4, 4)) is pe
    with pytest.raises(ValueError, match="no square grid"):
        resample_pos_embed(torch.randn(1 + 15, 8), (4, 4))
    with pytest.raises(ValueError, match="do not make a 3x4 grid"):
        resample_pos_embed(torch.randn(1 + 16, 8), (4, 4), (3, 4))


@pytest.mark.parametrize("old,new", [(4, 8), (8, 4), (14, 16), (4, 6)])
def test_patch_kernel_equals_timm_resample_patch_embed(old, new):
    w = torch.randn(12, 3, old, old, generator=torch.Generator().manual_seed(old * new))  # (O, C, p, p)
    want = resample_patch_embed(w, [new, new])  # timm: float32 pseudo-inverse
    got = our_patch(w, (new, new))
    assert got.shape == want.shape and got.dtype == w.dtype
    assert (got - want).abs().max().item() <= 2e-4 * want.abs().max().item()


# ---------------------------------------------------------------- model.pretrained* at a new size


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A random micro model (16 px images, 4 px patches: a 4x4 grid) saved, and its exports."""
    root = tmp_path_factory.mktemp("pos_embed")
    torch.manual_seed(11)
    model = TwoTower(copy.deepcopy(PRESETS["micro"]), init_logit_scale=math.log(20.0))
    save_pretrained(model, root / "run" / "final", preprocess=preprocess_cfg(model.image_size))
    export(root / "run", "open_clip", root / "oc")
    export(root / "run", "hf", root / "hf")
    return root


def _cfg(**model_keys) -> ModelConfig:
    cfg = Config(model=ModelConfig(**model_keys))
    resolve(cfg)
    validate(cfg)
    return cfg.model


@pytest.mark.parametrize(
    "keys",
    [
        {"pretrained": "run", "image_size": 32},  # 4x4 -> 8x8
        {"pretrained": "oc", "image_size": 24},  # 4x4 -> 6x6
        {"pretrained": "hf", "image_size": 12},  # 4x4 -> 3x3, from transformers' names
        {"pretrained": "oc/open_clip_model.safetensors", "preset": "micro", "image_size": 20},  # no arch
        {"pretrained_image": "run", "preset": "micro", "image_size": 32},  # one tower
        {"pretrained": "run", "vision": {"image_size": [16, 28]}},  # a non-square grid: 4x4 -> 4x7
    ],
)
def test_a_new_image_size_resamples_the_position_embedding_as_timm(src, keys, caplog):
    keys = {k: (str(src / v) if k.startswith("pretrained") else v) for k, v in keys.items()}
    source = load(src / "run").model.state_dict()
    size = keys["image_size"] if "image_size" in keys else keys["vision"]["image_size"]
    grid = (size[0] // 4, size[1] // 4) if isinstance(size, list) else (size // 4, size // 4)
    check_buildable(_cfg(**keys))  # the start-up check (meta device) passes and logs nothing
    assert "resampled" not in caplog.text
    with caplog.at_level(logging.INFO, logger="mmalign.models.pos_embed"):
        model = build_model(_cfg(**keys))
    got = model.state_dict()
    want = resample_abs_pos_embed(source[POS].unsqueeze(0), list(grid), [4, 4], 1)[0]
    assert got[POS].shape == (1 + grid[0] * grid[1], 32)
    assert torch.allclose(got[POS], want, rtol=0, atol=1e-6)  # the HF round trip: float32 exact
    assert torch.equal(got[POS][0], source[POS][0])  # the class token kept
    tower = "visual." if "pretrained_image" in keys else ""
    same = [k for k in source if k != POS and k.startswith(tower)]
    assert all(torch.allclose(got[k], source[k], rtol=0, atol=1e-6) for k in same)
    lines = [r.getMessage() for r in caplog.records if "resampled" in r.getMessage()]
    where = "model.pretrained_image" if tower else "model.pretrained"
    assert lines == [f"{where}: {POS} resampled (bicubic) from 4x4 to {grid[0]}x{grid[1]}"]
    images = torch.randn(2, 3, grid[0] * 4, grid[1] * 4)
    with torch.no_grad():
        assert model.eval().encode_image(images).shape == (2, 32)


def _patchwise_resize(images: torch.Tensor, patch: int, new: int) -> torch.Tensor:
    """Each patch x patch block of ``images`` (B, 3, H, W) resized on its own to new x new."""
    b, c, h, w = images.shape
    blocks = images.reshape(b, c, h // patch, patch, w // patch, patch).permute(0, 2, 4, 1, 3, 5)
    flat = blocks.reshape(-1, c, patch, patch)  # (B * gh * gw, C, p, p)
    up = torch.nn.functional.interpolate(flat, size=(new, new), mode="bicubic", antialias=True)
    up = up.reshape(b, h // patch, w // patch, c, new, new).permute(0, 3, 1, 4, 2, 5)
    return up.reshape(b, c, h // patch * new, w // patch * new)


def test_a_new_patch_size_resamples_the_kernel_so_resized_patches_give_the_source_embeddings(src, caplog):
    """FlexiViT's promise: patches 4 -> 8 on images 16 -> 32 (the same 4x4 grid), each patch
    upsampled on its own, give the source model's embeddings of the original images."""
    source = load(src / "run").model
    with caplog.at_level(logging.INFO, logger="mmalign.models.pos_embed"):
        model = build_model(_cfg(pretrained=str(src / "run"), image_size=32, vision={"patch_size": 8})).eval()
    want = resample_patch_embed(source.state_dict()[PATCH], [8, 8])
    got = model.state_dict()[PATCH]
    assert (got - want).abs().max().item() <= 2e-4 * want.abs().max().item()
    assert torch.equal(model.state_dict()[POS], source.state_dict()[POS])  # the grid did not change
    assert "visual.conv1.weight resampled (bicubic) from 4x4 to 8x8 patches" in caplog.text
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = source.encode_image(images), model.encode_image(_patchwise_resize(images, 4, 8))
    assert (a - b).abs().max().item() <= 1e-4


def test_a_grid_that_is_no_square_is_one_config_error(src, tmp_path):
    state = load_file(str(src / "oc" / "open_clip_model.safetensors"))
    state[POS] = torch.randn(1 + 6, 32)  # six grid vectors: no square, and a file states no grid
    save_file(state, str(tmp_path / "odd.safetensors"))
    for build in (check_buildable, build_model):
        with pytest.raises(ConfigError) as e:
            build(_cfg(pretrained=str(tmp_path / "odd.safetensors"), preset="micro", image_size=32))
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("config key 'model.pretrained': ")
        assert "6 grid vectors after 1 prefix token(s) are no square grid" in msg


def test_another_width_is_still_refused(src):
    with pytest.raises(ConfigError, match=r"model.pretrained_image.*vision_cfg.width"):
        build_model(
            _cfg(preset="micro", image_size=32, vision={"width": 64}, pretrained_image=str(src / "run"))
        )


def test_a_run_fine_tunes_at_the_new_size(src, micro_overrides, caplog):
    """The whole path: load_config -> train at 24 px from a 16 px model; final/ is a 24 px model
    (its preprocessing too) whose image tower, locked, holds the resampled embedding."""
    from mmalign.config import load_config
    from mmalign.run.train import train

    overrides = [o for o in micro_overrides if not o.startswith("model.preset")]
    cfg = load_config(
        None,
        overrides
        + [
            f"model.pretrained={src / 'run'}",
            "model.image_size=24",
            "model.lock_image=true",
            "train.steps=2",
            "train.warmup_steps=0",
            "monitor.probe_size=0",
            "train.checkpoint_every=0",
            "train.eval_every=0",
        ],
    )
    with caplog.at_level(logging.INFO, logger="mmalign.models.pos_embed"):
        out = train(cfg, show_progress=False)
    assert "visual.positional_embedding resampled (bicubic) from 4x4 to 6x6" in caplog.text
    final = load(out)
    assert final.model.image_size == 24 and final.preprocess_cfg["size"] in (24, [24, 24])
    source = load(src / "run").model.state_dict()[POS]
    want = resample_abs_pos_embed(source.unsqueeze(0), [6, 6], [4, 4], 1)[0]
    assert torch.equal(final.model.state_dict()[POS], want)


@pytest.mark.parametrize("mode", ["bilinear", "nearest"])
def test_model_pretrained_resample_picks_the_interpolation(src, mode):
    model = build_model(_cfg(pretrained=str(src / "run"), image_size=24, pretrained_resample=mode))
    source = load(src / "run").model.state_dict()[POS]
    antialias = mode == "bilinear"  # timm passes antialias to every mode; torch has it for these two only
    want = resample_abs_pos_embed(source.unsqueeze(0), [6, 6], [4, 4], 1, mode, antialias=antialias)[0]
    assert torch.equal(model.state_dict()[POS], want)
    from mmalign.config import load_config

    with pytest.raises(ConfigError, match="model.pretrained_resample") as e:
        load_config(None, [f"model.pretrained={src / 'run'}", "model.pretrained_resample=lanczos"])
    assert "\n" not in str(e.value)


def test_a_timm_vit_trunk_is_resampled_as_timm_does(tmp_path):
    """A timm ViT image tower (timm's ``test_vit``, 16 px patches) saved at 32 px (a 2x2 grid)
    and started again at 64 px (4x4): ``trunk.pos_embed`` (1, N, D), its class token kept."""
    from mmalign.config import load_config

    vit = ["model.preset=micro", "model.vision.timm_model_name=test_vit"]
    torch.manual_seed(4)
    small = build_model(load_config(None, vit + ["model.image_size=32"]).model)
    save_pretrained(small, tmp_path / "small", preprocess=preprocess_cfg(32))
    model = build_model(
        load_config(None, [f"model.pretrained={tmp_path / 'small'}", "model.image_size=64"]).model
    )
    key = "visual.trunk.pos_embed"
    source, got = small.state_dict(), model.state_dict()
    prefix = model.visual.trunk.num_prefix_tokens
    assert got[key].shape == (1, prefix + 16, source[key].shape[-1])
    assert torch.equal(got[key], resample_abs_pos_embed(source[key], [4, 4], [2, 2], prefix))
    assert all(torch.equal(got[k], v) for k, v in source.items() if k != key)


def test_a_preset_that_agrees_with_the_source_may_come_with_a_new_size(src):
    """``model.preset`` must describe the source: at the source's grid when the config asks for
    a new one (a config that trained at the new size describes its own export too)."""
    model = build_model(_cfg(pretrained=str(src / "run"), preset="micro", image_size=32))
    assert model.state_dict()[POS].shape == (1 + 64, 32)
    with pytest.raises(ConfigError, match=r"^config key 'model.preset': 'tiny' differs") as e:
        build_model(_cfg(pretrained=str(src / "run"), preset="tiny", image_size=32))
    assert "\n" not in str(e.value)
