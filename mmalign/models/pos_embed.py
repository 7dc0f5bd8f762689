"""A ViT checkpoint at another image size or patch grid: its position embeddings resampled.

``model.pretrained*`` into a model whose ``image_size`` (or ``patch_size``) differs from the
source's gives weights of other shapes in two places: the position embedding (one vector per
patch of the grid, after the prefix tokens: the class token, timm's register tokens) and, for
a new patch size, the patch-embedding kernel. :func:`fit_grids` resamples both to the model's
shapes, with one log line each (from grid, to grid); every other weight keeps its shape.

* :func:`resample_pos_embed` is timm's ``resample_abs_pos_embed`` (same arguments, same
  result: tested against it): the grid part reshaped to an image of ``D`` channels and
  interpolated (bicubic, antialiased when shrinking), the prefix tokens kept as they are.
* :func:`resample_patch_embed` is FlexiViT's pseudo-inverse resize (timm's
  ``resample_patch_embed``): the new kernel ``w'`` makes ``<resize(x), w'> = <x, w>`` for every
  patch ``x`` in the least-squares sense, so a B/16 kernel on a 2x larger image gives back the
  B/32 features.

Which weights are grids is a table (:data:`GRIDS`): open_clip's ViT and a timm ViT trunk.
A tower kind with another layout adds a :class:`Grid` to it.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MODES = ("bicubic", "bilinear", "nearest", "area")  # F.interpolate's 2-D modes
GRID_KEYS = ("image_size", "patch_size")  # vision_cfg keys a resample absorbs


def _pair(size) -> tuple[int, int]:
    return (int(size[0]), int(size[1])) if isinstance(size, (list, tuple)) else (int(size), int(size))


def _resize(x: torch.Tensor, size: tuple[int, int], mode: str, antialias: bool) -> torch.Tensor:
    """``x`` (B, C, H, W) float32 -> (B, C, h, w); antialias only where torch has it."""
    if mode not in MODES:
        raise ValueError(f"interpolation {mode!r}: one of {', '.join(MODES)}")
    if mode in ("bicubic", "bilinear"):
        return F.interpolate(x, size=size, mode=mode, antialias=antialias)
    return F.interpolate(x, size=size, mode=mode)


def resample_pos_embed(
    pe: torch.Tensor,
    new_grid: tuple[int, int] | list[int],
    old_grid: tuple[int, int] | list[int] | None = None,
    num_prefix_tokens: int = 1,
    mode: str = "bicubic",
    antialias: bool = True,
    name: str = "position embedding",
) -> torch.Tensor:
    """``pe`` (N, D) as open_clip keeps it, or (1, N, D) as timm does, with its grid part
    interpolated from ``old_grid`` (default: a square of the N - prefix vectors) to
    ``new_grid``; the first ``num_prefix_tokens`` vectors are kept. Returns ``pe`` itself when
    nothing changes, else a new tensor of ``pe``'s dtype (interpolated in float32, as timm)."""
    batched = pe.dim() == 3
    x = pe if batched else pe.unsqueeze(0)  # (1, N, D)
    cells = x.shape[1] - num_prefix_tokens
    new = _pair(new_grid)
    if old_grid is None:
        side = math.isqrt(max(cells, 0))
        if side * side != cells:
            raise ValueError(
                f"{name}: {cells} grid vectors after {num_prefix_tokens} prefix token(s) are no square "
                f"grid; give its grid"
            )
        old = (side, side)
    else:
        old = _pair(old_grid)
        if old[0] * old[1] != cells:
            raise ValueError(f"{name}: {cells} grid vectors do not make a {old[0]}x{old[1]} grid")
    if old == new:
        return pe
    prefix, grid = x[:, :num_prefix_tokens], x[:, num_prefix_tokens:]  # (1, P, D), (1, h*w, D)
    dim = grid.shape[-1]
    if x.is_meta:  # the start-up check: shapes only
        grid = torch.empty(1, new[0] * new[1], dim, dtype=x.dtype, device="meta")
    else:
        image = grid.float().reshape(1, old[0], old[1], dim).permute(0, 3, 1, 2)  # (1, D, h, w)
        image = _resize(image, new, mode, antialias)  # (1, D, h', w')
        grid = image.permute(0, 2, 3, 1).reshape(1, new[0] * new[1], dim).to(x.dtype)  # (1, h'*w', D)
    out = torch.cat([prefix, grid], dim=1)  # (1, P + h'*w', D)
    if not x.is_meta:  # the start-up check stays quiet: the build logs it once
        log.info("%s resampled (%s) from %dx%d to %dx%d", name, mode, old[0], old[1], new[0], new[1])
    return out if batched else out[0]


def patch_resize_matrix(
    old: tuple[int, int], new: tuple[int, int], mode: str = "bicubic", antialias: bool = True
) -> torch.Tensor:
    """The linear map (h'*w', h*w) that resizing an h x w patch to h' x w' is, column by column:
    the resized one-hot patches (float64)."""
    eye = torch.eye(old[0] * old[1], dtype=torch.float32).reshape(-1, 1, old[0], old[1])  # (hw, 1, h, w)
    resized = _resize(eye, new, mode, antialias)  # (hw, 1, h', w')
    return resized.reshape(old[0] * old[1], -1).T.double()  # (h'w', hw)


def resample_patch_embed(
    weight: torch.Tensor,
    new_size: tuple[int, int] | list[int],
    mode: str = "bicubic",
    antialias: bool = True,
    name: str = "patch embedding",
) -> torch.Tensor:
    """A patch-embedding kernel ``weight`` (O, C, h, w) for patches of ``new_size``: the
    pseudo-inverse of the resize (FlexiViT), so that a resized patch meets the new kernel as
    the old patch met the old one (least squares when shrinking)."""
    old, new = _pair(weight.shape[-2:]), _pair(new_size)
    if old == new:
        return weight
    if weight.is_meta:
        return torch.empty(*weight.shape[:2], *new, dtype=weight.dtype, device="meta")
    pinv = torch.linalg.pinv(patch_resize_matrix(old, new, mode, antialias).T)  # (h'w', hw)
    flat = weight.double().reshape(*weight.shape[:2], -1)  # (O, C, hw)
    out = (flat @ pinv.T).reshape(*weight.shape[:2], *new)  # (O, C, h', w')
    log.info("%s resampled (%s) from %dx%d to %dx%d patches", name, mode, old[0], old[1], new[0], new[1])
    return out.to(weight.dtype)


# ---------------------------------------------------------------- which weights are grids


@dataclass(frozen=True)
class Grid:
    """Where a tower layout keeps its grid: the position embedding's and the patch kernel's
    names in TwoTower's state dict, and, from the built model, the module that owns them, its
    grid and its prefix-token count."""

    pos_key: str
    patch_key: str
    module: str  # the submodule (dotted) that owns the grid
    grid: Callable[[Any], tuple[int, int]]
    prefix: Callable[[Any], int]


def _timm_prefix(trunk) -> int:
    return 0 if getattr(trunk, "no_embed_class", False) else int(getattr(trunk, "num_prefix_tokens", 1))


GRIDS: list[Grid] = [
    Grid(  # open_clip's VisionTransformer: (N, D), the class token first
        "visual.positional_embedding",
        "visual.conv1.weight",
        "visual",
        lambda m: _pair(m.grid_size),
        lambda m: 1,
    ),
    Grid(  # a timm ViT trunk in open_clip's TimmModel: (1, N, D)
        "visual.trunk.pos_embed",
        "visual.trunk.patch_embed.proj.weight",
        "visual.trunk",
        lambda m: _pair(m.patch_embed.grid_size),
        _timm_prefix,
    ),
]


def _fixed(module, pos_key: str) -> bool:
    """open_clip's sin-cos position embedding: a function of the grid (frozen), not learnt."""
    param = getattr(module, pos_key.rsplit(".", 1)[-1], None)
    return isinstance(param, torch.nn.Parameter) and not param.requires_grad and param.dim() == 2


def source_grid(arch: dict | None) -> tuple[int, int] | None:
    """The patch grid a source's architecture states (open_clip's ViT keys), None when unknown."""
    cfg = (arch or {}).get("vision_cfg") or {}
    if "image_size" not in cfg or "patch_size" not in cfg or "timm_model_name" in cfg:
        return None
    (h, w), (ph, pw) = _pair(cfg["image_size"]), _pair(cfg["patch_size"])
    return h // ph, w // pw


def fit_grids(
    model: torch.nn.Module,
    own: dict,
    state: dict,
    where: str,
    old_grid: tuple[int, int] | None = None,
    mode: str = "bicubic",
) -> dict:
    """``state`` (TwoTower's names) with each grid weight whose shape differs from ``own``'s
    resampled to the model's grid: the patch kernel to the model's patch size, the position
    embedding to its grid (``old_grid``: the source's, when its architecture states it; else a
    square). Other weights are left as they are (a misfit is still refused by the caller)."""
    out = dict(state)
    for g in GRIDS:
        if g.pos_key not in own or g.pos_key not in state:
            continue
        try:
            module = model.get_submodule(g.module)
        except AttributeError:
            continue
        patch = state.get(g.patch_key)
        if patch is not None and g.patch_key in own and patch.shape != own[g.patch_key].shape:
            want = own[g.patch_key].shape
            if patch.dim() != 4 or tuple(patch.shape[:2]) != tuple(want[:2]):
                continue  # another width or channel count: a misfit, refused by the caller
            out[g.patch_key] = resample_patch_embed(patch, want[-2:], mode, name=f"{where}: {g.patch_key}")
        pe = state[g.pos_key]
        if pe.shape == own[g.pos_key].shape or pe.shape[-1] != own[g.pos_key].shape[-1]:
            continue
        if _fixed(module, g.pos_key):
            out[g.pos_key] = own[g.pos_key]  # a sin-cos table: the model's own, built for its grid
            continue
        prefix = g.prefix(module)
        grid = (
            old_grid if old_grid is not None and old_grid[0] * old_grid[1] + prefix == pe.shape[-2] else None
        )
        out[g.pos_key] = resample_pos_embed(
            pe, g.grid(module), grid, prefix, mode, name=f"{where}: {g.pos_key}"
        )
    return out


__all__ = [
    "GRIDS",
    "GRID_KEYS",
    "Grid",
    "fit_grids",
    "patch_resize_matrix",
    "resample_patch_embed",
    "resample_pos_embed",
    "source_grid",
]
