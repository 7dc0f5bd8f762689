"""timm image towers, offline: ``model.vision.timm_model_name: NAME`` (open_clip's ``TimmModel``:
a timm trunk without its classifier, then open_clip's pooling / projection head).

timm's own ``pretrained=True`` downloads, so the architecture always says
``timm_model_pretrained: false`` (random init) and weights come from a local file,
``model.timm_weights: PATH``: a timm checkpoint of the same model (``.safetensors``, or a
torch file read with ``weights_only=True``; a ``state_dict`` / ``model`` wrapper is
unwrapped), e.g. ``timm.create_model(NAME, pretrained=True).state_dict()`` saved on a
connected machine, or the ``model.safetensors`` of its Hugging Face hub repo.  The file is
loaded into the trunk after the model is built (before ``model.pretrained*`` and locking):
the model's own timm checkpoint filter runs first (it e.g. resamples a ViT's position
embeddings to another image size), the classifier weights are dropped (the tower has
none), and anything else missing or unexpected is one ConfigError line listing the names.

Image size: open_clip builds the trunk at timm's default input size; when
``model.vision.image_size`` differs and the trunk can change it (timm ViTs'
``set_input_size``), it is changed right after construction, as open_clip's
``force_image_size`` does.  Convolutional trunks take any size unchanged.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mmalign.errors import ConfigError, first_line

KEY = "config key 'model.timm_weights'"


def is_timm(vision_cfg: dict) -> bool:
    return bool(vision_cfg.get("timm_model_name"))


def check_timm_cfg(vision_cfg: dict, weights: str | None) -> dict:
    """``vision_cfg`` with ``timm_model_pretrained`` false (a copy); misuse as one ConfigError."""
    vision_cfg = dict(vision_cfg)
    if weights is not None and not is_timm(vision_cfg):
        raise ConfigError(f"{KEY} loads a timm trunk; set model.vision.timm_model_name too")
    if not is_timm(vision_cfg):
        return vision_cfg
    import timm

    name = vision_cfg["timm_model_name"]
    if not timm.is_model(name):
        raise ConfigError(
            f"config key 'model.vision.timm_model_name': timm has no model {name!r} "
            f"(timm.list_models() names them)"
        )
    if vision_cfg.get("timm_model_pretrained") and weights is None:
        raise ConfigError(
            "config key 'model.vision.timm_model_pretrained': true would download the weights; "
            "set model.timm_weights to a local timm checkpoint file instead (or false: random init)"
        )
    if weights is not None and not Path(weights).is_file():
        raise ConfigError(f"{KEY}: {weights} is not a file")
    vision_cfg["timm_model_pretrained"] = False  # the file is loaded by load_timm_weights
    return vision_cfg


def fit_input_size(visual: nn.Module, vision_cfg: dict) -> None:
    """A timm trunk whose weights depend on the input size (a ViT's position embeddings) is
    set to ``vision_cfg["image_size"]`` (open_clip's ``force_image_size``)."""
    trunk = getattr(visual, "trunk", None)
    size = vision_cfg.get("image_size")
    if trunk is None or size is None or not hasattr(trunk, "set_input_size"):
        return
    wanted = tuple(size) if isinstance(size, (list, tuple)) else (int(size), int(size))
    default = tuple(trunk.pretrained_cfg.get("input_size", (3, *wanted))[1:])
    if default != wanted:
        timm_model: Any = visual  # open_clip's TimmModel
        timm_model.set_input_size(wanted)


def _read(path: Path) -> dict:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(str(path), map_location="cpu", weights_only=True)  # a pickle never runs code here
    for wrapper in ("state_dict", "model", "state_dict_ema"):
        if isinstance(state, dict) and isinstance(state.get(wrapper), dict):
            state = state[wrapper]
            break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"{KEY}: {path} holds no state dict of tensors")
    return {k[len("module.") :] if k.startswith("module.") else k: v for k, v in state.items()}


def load_timm_weights(visual: nn.Module, path: str | Path) -> None:
    """The timm checkpoint at ``path`` into ``visual.trunk`` (open_clip's TimmModel)."""
    trunk: Any = visual.get_submodule("trunk")  # a timm model (pretrained_cfg, default_cfg)
    path = Path(path)
    try:
        state = _read(path)
    except ConfigError:
        raise
    except Exception as e:  # safetensors / torch.load errors on a foreign or cut file, a refused pickle
        raise ConfigError(
            f"{KEY}: {path} is not a readable weights file ({type(e).__name__}: {first_line(e)[:160]})"
        ) from None
    filter_fn = getattr(sys.modules.get(type(trunk).__module__), "checkpoint_filter_fn", None)
    if filter_fn is not None:  # timm's per-family remapping (pos-embed resampling, old layouts)
        try:
            state = filter_fn(state, trunk)
        except Exception as e:
            raise ConfigError(
                f"{KEY}: timm's checkpoint filter for {type(trunk).__name__} refused {path} "
                f"({type(e).__name__}: {first_line(e)[:160]})"
            ) from None
    own = trunk.state_dict()
    classifier = trunk.pretrained_cfg.get("classifier") or ()
    for name in (classifier,) if isinstance(classifier, str) else classifier:
        if f"{name}.weight" not in own:  # the tower has no classifier: the checkpoint's is not used
            state.pop(f"{name}.weight", None)
            state.pop(f"{name}.bias", None)
    from mmalign.models.misfit import misfit

    problem = misfit(own, state)
    if problem:
        raise ConfigError(
            f"{KEY}: {path} does not fit timm's {visual.trunk.__class__.__name__} "
            f"({getattr(trunk, 'default_cfg', {}).get('architecture', '?')}): {problem}"
        )
    if any(p.is_meta for p in trunk.parameters()):  # check_buildable's meta model: checked only
        return
    with torch.no_grad():
        trunk.load_state_dict(state, strict=True)


def open_clip_refusal(towers, state: dict) -> str | None:
    """Why open_clip (which builds a timm trunk at its default input size) cannot load these
    weights, or None: a trunk resized by :func:`fit_input_size` has other shapes.  ``towers``:
    a model's typed towers (models/towers/) or its architecture dict."""
    # duck-typed, not an import of models/towers/: the timm kind there builds its trunk with this module
    arch = towers.to_arch() if hasattr(towers, "to_arch") else towers
    if not is_timm(arch["vision_cfg"]):
        return None
    from open_clip.model import _build_vision_tower

    with torch.device("meta"):
        cfg = {k: v for k, v in arch["vision_cfg"].items() if k != "kind"}  # open_clip's keys only
        plain = _build_vision_tower(arch["embed_dim"], {**cfg, "timm_model_pretrained": False})
    wrong = [
        k
        for k, v in plain.state_dict().items()
        if f"visual.{k}" in state and tuple(state[f"visual.{k}"].shape) != tuple(v.shape)
    ]
    if not wrong:
        return None
    return (
        f"--format open_clip: the timm trunk {arch['vision_cfg']['timm_model_name']} was resized to image_size "
        f"{arch['vision_cfg'].get('image_size')} ({wrong[0]} changed shape), which open_clip's TimmModel "
        f"cannot build; export with --format onnx, or train at the trunk's default size"
    )


__all__ = ["check_timm_cfg", "fit_input_size", "is_timm", "load_timm_weights", "open_clip_refusal"]
