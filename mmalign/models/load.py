"""The one model loader: every command that reads a trained model (eval, report, export,
embed, search, serve, mine, ``mmalign.load``) calls :func:`load`.

A path may be

* a model folder (what :func:`mmalign.models.io.save_pretrained` writes, e.g. ``RUN/final``):
  ``model.safetensors`` + ``model_config.json``;
* a run directory: its ``final/``;
* an export of another tool's format: an open_clip ``local-dir:`` folder
  (``open_clip_config.json`` + weights) or a transformers ``CLIPModel`` folder (``config.json``
  + weights), as ``mmalign export`` writes them or as open_clip / HF ship them: built exactly
  as ``model.pretrained: FOLDER`` builds a run's model (:mod:`mmalign.models.init_from`);
* a step checkpoint ``RUN/checkpoints/step_N`` (``engine/`` is DeepSpeed's state, any ZeRO
  stage): the weights are consolidated into one fp32 state dict by
  :func:`mmalign.layout.ds_adapter.consolidate_checkpoint`, and the architecture is rebuilt from the
  resolved config stored *in that checkpoint* (``step_N/config.yaml``, written by
  :func:`mmalign.run.checkpoint.save`; the names are :mod:`mmalign.layout.run_dir`'s), never from ``RUN/config.yaml``, which may have been
  edited since.  A checkpoint from before checkpoints stored their config falls back to
  ``RUN/config.yaml`` with one logged warning.

A model folder can come from anyone, so its safetensors win whenever they are present: a
folder is read as a step checkpoint only when it has no saved model and sits at
``checkpoints/step_N``; even then every torch file is unpickled with ``weights_only=True``
(a planted pickle is a one-line error, never executed), and nothing in a folder is imported.

A path that is none of these, or a folder whose files are damaged, is a one-line
:class:`~mmalign.errors.UsageError` naming the path.

``weights="ema"`` reads the EMA weights a run kept (``train.ema_decay``, :mod:`mmalign.run.ema`)
instead of the raw ones: a run directory's or ``final/``'s sibling ``final_ema/``, or a step
checkpoint's per-rank EMA pieces (:mod:`mmalign.layout.ema_pieces`) laid over its consolidated
weights (frozen weights and buffers are the raw ones); anywhere else it is one line.
"""

from __future__ import annotations

import logging
import math
import pickle
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from mmalign.errors import ConfigError, UsageError, first_line
from mmalign.models.locate import CHECKPOINT, MODEL, checkpoint_config, is_step_checkpoint, locate  # noqa: F401 (re-exported)
from mmalign.models.two_tower import TwoTower

log = logging.getLogger(__name__)

EXPORT = "export"  # Loaded.kind of an open_clip / HF folder
WEIGHTS = ("raw", "ema")  # load()'s weights=: the trained weights, or their moving average


@dataclass
class Loaded:
    """A trained model and what its callers need besides the weights.

    Follows clip_benchmark's model protocol: :meth:`encode_image` / :meth:`encode_text`
    return L2-normalised joint-space embeddings, ``preprocess`` maps a PIL image to a
    tensor and ``tokenizer(list[str])`` returns token ids.
    """

    model: TwoTower  # eval mode, on the device asked for
    preprocess: Callable  # PIL image -> (3, S, S) tensor (the eval transform)
    tokenizer: Callable  # list[str] -> LongTensor (N, context_length)
    # model_config.json's keys (arch, preprocess_cfg, ...); "train_config" is the run's resolved
    # config when known (for a step checkpoint: the one stored in it)
    config: dict
    preprocess_cfg: dict = field(default_factory=dict)  # open_clip keys: size, mean, std, interpolation, ...
    tokenizer_file: Path | None = None  # a sentencepiece model to ship beside exported weights, else None
    kind: str = MODEL  # MODEL (a model folder), CHECKPOINT (a step checkpoint) or EXPORT (open_clip / HF)
    path: Path | None = None  # the folder the weights were read from (a run directory's final/)

    @torch.no_grad()
    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images)  # (B, D), normalised

    @torch.no_grad()
    def encode_text(self, tokens: torch.Tensor | list[str]) -> torch.Tensor:
        ids = self.tokenizer(tokens) if isinstance(tokens, (list, str)) else tokens  # (B, L)
        return self.model.encode_text(ids)  # (B, D), normalised

    @property
    def logit_scale(self) -> float:
        """exp of the learned log-scale, a plain float (detached: a float of a tensor that
        requires grad makes torch warn)."""
        return float(self.model.logit_scale.detach().exp())

    @property
    def source(self) -> str:
        """What was loaded, for messages: ``model folder X`` or ``step checkpoint X``."""
        what = {MODEL: "model folder", CHECKPOINT: "step checkpoint", EXPORT: "export folder"}[self.kind]
        return f"{what} {self.path}"


def load(path: str | Path, device: str | torch.device = "cpu", weights: str = "raw") -> Loaded:
    """The model at ``path`` (a model folder, a run directory, ``RUN/final``,
    ``RUN/checkpoints/step_N`` or an open_clip / HF export folder), for inference: eval mode,
    frozen (``requires_grad`` False), on ``device``; ``weights="ema"``: its EMA weights
    (:func:`ema_source`)."""
    from mmalign.models.hub import resolve
    from mmalign.models.io import load_pretrained
    from mmalign.models.tokenizers import build_tokenizer, tokenizer_file

    path = resolve(path, "--model")  # a model name (ARCH/TAG, hf-hub:ORG/NAME, ORG/NAME): its local folder
    if weights not in WEIGHTS:
        raise UsageError(f"--weights: {weights!r} is not one of {', '.join(WEIGHTS)}")
    if weights == "ema":
        path = ema_source(path)
    kind, folder = (EXPORT, Path(path)) if export_kind(Path(path)) else locate(path)
    if kind == EXPORT:
        model, config = _load_export(folder)
        tokenizer = build_tokenizer(model.arch)  # a shipped sentencepiece model: an absolute path in the arch
        base = None
    elif kind == MODEL:
        model, config = load_pretrained(folder)
        tokenizer = build_tokenizer(model.arch, base_dir=folder)  # a saved tokenizer.model, relative to it
        base = folder
    else:
        model, config = _load_checkpoint(folder, ema=weights == "ema")
        tokenizer = build_tokenizer(model.arch)  # the run's own tokenizer file
        base = None
    spm = tokenizer_file(model.arch)
    spm_path = None if spm is None else (Path(spm) if Path(spm).is_absolute() or base is None else base / spm)
    # frozen whatever the kind: some CPU kernels round differently when a weight requires grad,
    # so two loads of one model would not give the same bits
    model.requires_grad_(False)
    return Loaded(
        model=model.to(device).eval(),
        preprocess=_eval_transform(config["preprocess_cfg"]),
        tokenizer=tokenizer,
        config=config,
        preprocess_cfg=dict(config["preprocess_cfg"]),
        tokenizer_file=spm_path,
        kind=kind,
        path=folder,
    )


def ema_source(path: str | Path) -> Path:
    """Where the EMA weights of the model at ``path`` are: a run directory's or ``final/``'s
    sibling ``final_ema/``, ``final_ema/`` itself (or a folder saved as EMA weights), or a step
    checkpoint holding EMA pieces. One UsageError line for anything else."""
    import json

    from mmalign.layout import ema_pieces
    from mmalign.layout.run_dir import FINAL, FINAL_EMA
    from mmalign.models.io import CONFIG
    from mmalign.models.io import WEIGHTS as WEIGHTS_FILE
    from mmalign.models.locate import check_exists

    p = check_exists(path)
    hint = f"a run trained with train.ema_decay keeps them in RUN/{FINAL_EMA}/ and in its step checkpoints"
    if is_step_checkpoint(p):
        if not ema_pieces.files(p):
            raise UsageError(f"--weights ema: step checkpoint {p} holds no EMA weights ({hint})")
        return p
    for folder in (p / FINAL_EMA, p.parent / FINAL_EMA if p.name == FINAL else None, p):
        if folder is None or not (folder / WEIGHTS_FILE).is_file() or not (folder / CONFIG).is_file():
            continue
        if folder.name == FINAL_EMA:
            return folder
        try:
            marked = json.loads((folder / CONFIG).read_text(encoding="utf-8")).get("weights") == "ema"
        except (ValueError, UnicodeDecodeError, AttributeError):
            marked = False
        if marked:
            return folder
    raise UsageError(f"--weights ema: {p} holds no EMA weights ({hint})")


def export_kind(path: Path) -> str | None:
    """OPEN_CLIP_DIR / HF_DIR for a folder of another tool's format, None otherwise (an mmalign
    model folder with its own ``config.json`` stays mmalign's)."""
    from mmalign.models.arch import HF_CONFIG, HF_DIR, OPEN_CLIP_CONFIG, OPEN_CLIP_DIR
    from mmalign.models.io import CONFIG

    if not path.is_dir():
        return None
    if (path / OPEN_CLIP_CONFIG).is_file():
        return OPEN_CLIP_DIR
    if (path / HF_CONFIG).is_file() and not (path / CONFIG).is_file():
        return HF_DIR
    return None


def _load_export(folder: Path) -> tuple[TwoTower, dict]:
    """An open_clip / HF folder -> (model, a model_config.json-like dict): the architecture it
    carries (:func:`mmalign.models.arch.source_arch`, as ``model.pretrained`` reads it), its
    weights under our names (:mod:`mmalign.models.foreign_weights`); problems are one-line
    UsageErrors."""
    import json

    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.arch import OPEN_CLIP_CONFIG, resolve_arch
    from mmalign.models.foreign_weights import read_foreign
    from mmalign.models.misfit import misfit

    try:
        arch = resolve_arch(ModelConfig(pretrained=str(folder)))
        state = read_foreign(folder, "--model")
        assert state is not None  # an open_clip folder (OPEN_CLIP_CONFIG) always has its weights read
        bias, scale = state.get("logit_bias"), state.get("logit_scale")
        model = TwoTower(
            arch,
            init_logit_bias=None if bias is None else float(bias.reshape(-1)[0]),
            # a published scale above the default clamp (SigLIP's ~112-117) is the model's own
            max_logit_scale=100.0 if scale is None else max(100.0, math.exp(float(scale.reshape(-1)[0]))),
        )
    except ConfigError as e:
        why = (
            first_line(e)
            .removeprefix("config key 'model.pretrained': ")
            .removeprefix("config key '--model': ")
        )
        raise UsageError(f"export folder {folder}: {why}") from None
    except Exception as e:  # open_clip's constructors on a bad tower setting
        raise UsageError(
            f"export folder {folder}: its towers cannot be built: {type(e).__name__}: {first_line(e)}"
        ) from None
    problem = misfit(model.state_dict(), state)
    if problem:
        raise UsageError(f"export folder {folder}: its weights do not fit its own config: {problem}")
    model.load_state_dict(state, strict=True)
    pre = preprocess_cfg(model.image_size)
    if (folder / OPEN_CLIP_CONFIG).is_file():  # its own size; our eval transform keeps OpenAI's mean and std
        shipped = json.loads((folder / OPEN_CLIP_CONFIG).read_text()).get("preprocess_cfg") or {}
        pre.update({k: v for k, v in shipped.items() if k == "size"})
        other = [
            k
            for k in ("mean", "std")
            if k in shipped
            and [round(float(x), 4) for x in shipped[k]] != [round(float(x), 4) for x in pre[k]]
        ]
        if other:
            log.warning(
                "export folder %s asks for its own image %s; mmalign's eval transform uses OpenAI's "
                "(embeddings differ slightly from open_clip's own preprocessing)",
                folder,
                " and ".join(other),
            )
    from mmalign.models.siglip_hf import model_preprocess

    pre = model_preprocess(model.arch, pre)  # a SigLIP model's own resize (no crop)
    config = {
        "arch": model.arch,
        "max_logit_scale": model.max_logit_scale,
        "preprocess_cfg": pre,
        "init_logit_bias": None
        if model.logit_bias is None
        else float(model.logit_bias.detach().reshape(-1)[0]),
    }
    return model, config


def _eval_transform(preprocess_cfg: dict):
    from mmalign.data.transforms import eval_transform

    size = preprocess_cfg["size"]
    mode = "squash" if preprocess_cfg.get("resize_mode") == "squash" else "shortest"  # squash: SigLIP's
    return eval_transform(int(size[0] if isinstance(size, (list, tuple)) else size), resize_mode=mode)


def _load_checkpoint(step_dir: Path, ema: bool = False) -> tuple[TwoTower, dict]:
    """``RUN/checkpoints/step_N`` -> (model, a model_config.json-like dict): weights
    consolidated from any ZeRO stage, architecture from the checkpoint's own config; with
    ``ema``, the trainable weights' EMA from its per-rank pieces."""
    from mmalign.config import load_config, to_dict
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.layout.ds_adapter import consolidate_checkpoint  # imports deepspeed: only on this path
    from mmalign.layout.run_dir import ENGINE_TAG
    from mmalign.models.arch import resolve_arch
    from mmalign.models.misfit import misfit

    config_file = checkpoint_config(step_dir)
    try:
        cfg = load_config(config_file)
        arch = resolve_arch(cfg.model)
        # plain torch BatchNorm whatever model.batchnorm says, as final/ is loaded (the
        # modes differ in train mode only)
        model = TwoTower(
            arch,
            init_logit_scale=cfg.model.init_logit_scale,
            init_logit_bias=cfg.model.init_logit_bias,
            max_logit_scale=cfg.model.max_logit_scale,
        )
    except ConfigError as e:
        raise UsageError(
            f"step checkpoint {step_dir}: its config {config_file} cannot be used ({e})"
        ) from None
    except Exception as e:  # open_clip's constructors on a bad tower setting
        raise UsageError(
            f"step checkpoint {step_dir}: the towers of {config_file} cannot be built: "
            f"{type(e).__name__}: {first_line(e)}"
        ) from None
    try:
        state = consolidate_checkpoint(step_dir, ENGINE_TAG)
    except FileNotFoundError as e:
        raise UsageError(f"step checkpoint {step_dir}: {e}") from None
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError) as e:
        # weights_only refuses anything but tensors and plain containers (a planted or
        # foreign pickle); a cut file fails as RuntimeError/EOFError.
        refused = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        why = (
            f"it would import {refused.group(1)}" if refused else f"{type(e).__name__}: {first_line(e)[:160]}"
        )
        raise UsageError(
            f"step checkpoint {step_dir} holds a file that is not a plain weights file ({why}); not loaded"
        ) from None
    if ema:
        state.update(_ema_weights(step_dir))
    problem = misfit(model.state_dict(), state)
    if problem:
        raise UsageError(f"step checkpoint {step_dir}: its weights do not fit {config_file}: {problem}")
    # Non-persistent buffers (e.g. the causal mask) are in neither; strict=True still
    # catches any missing or unexpected parameter.
    model.load_state_dict(state, strict=True)
    config: dict = {
        "arch": model.arch,
        "init_logit_bias": None
        if model.logit_bias is None
        else float(model.logit_bias.detach().reshape(-1)[0]),
        "max_logit_scale": model.max_logit_scale,
        "preprocess_cfg": preprocess_cfg(model.image_size),
        "train_config": to_dict(cfg),
    }
    if ema:
        config["weights"] = "ema"
    return model, config


def _ema_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """The whole EMA tensors of a step checkpoint's per-rank pieces; one UsageError line when
    they are missing, cut or not plain weights files."""
    from mmalign.layout import ema_pieces

    try:
        full, _ = ema_pieces.assemble(ema_pieces.read(step_dir))
    except (pickle.UnpicklingError, RuntimeError, EOFError, KeyError, ValueError, TypeError) as e:
        raise UsageError(
            f"step checkpoint {step_dir}: its EMA weights cannot be read ({type(e).__name__}: "
            f"{first_line(e)[:160]})"
        ) from None
    return full


__all__ = [
    "CHECKPOINT",
    "EXPORT",
    "MODEL",
    "WEIGHTS",
    "Loaded",
    "ema_source",
    "checkpoint_config",
    "is_step_checkpoint",
    "load",
    "locate",
]
