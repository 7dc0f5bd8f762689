"""The tower contract and its registry.

A tower kind is one typed spec class (a dataclass of its open_clip-style config keys) that
knows how to build its module, what input it takes (``image_size`` / ``context_length``),
how it is locked, exported and tokenised, and its FLOP count.  Kinds register themselves
with :func:`register_tower`; :func:`spec_from_cfg` picks the kind that claims a
``vision_cfg`` / ``text_cfg`` dict.  Later registrations are asked first, so a new kind can
claim configs that a built-in fallback (open_clip's ViT / text transformer) would otherwise
take.

Saved formats are the open_clip dicts: ``from_cfg(cfg).to_cfg() == cfg`` for every kind
(the keys a config gave, in its order, and nothing else), so old exports and checkpoints
load unchanged.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from torch import nn

from mmalign.errors import ConfigError, UsageError


@runtime_checkable
class Tower(Protocol):
    """What the model, the tokenizer, the exporters and the monitors ask of a tower."""

    kind: ClassVar[str]
    side: ClassVar[str]  # "vision" or "text"

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module: ...

    def lock(self, module: nn.Module, unlocked: int, key: str) -> None: ...

    def lock_groups(self, module: nn.Module) -> int: ...

    def to_cfg(self) -> dict: ...

    def open_clip_cfg(self) -> dict: ...

    def onnx_input(self, batch: int, tokenizer=None): ...

    def flops(self, embed_dim: int) -> int: ...


@dataclass
class TowerSpec:
    """Base of every kind: typed fields named as the config keys, plus ``extra`` (keys the
    kind does not type, passed through to its builder) and ``given`` (the keys the source
    config had, in order: :meth:`to_cfg` writes those and any field changed from its default)."""

    kind: ClassVar[str] = ""
    side: ClassVar[str] = ""
    hf_clip: ClassVar[bool] = False  # exportable as a transformers CLIPModel tower (export/to_hf.py)
    marker: ClassVar[str] = ""  # the config key that names the kind, for messages

    extra: dict = field(default_factory=dict, repr=False)
    given: tuple = field(default=(), repr=False, compare=False)

    # ------------------------------------------------------------- config dicts
    @classmethod
    def typed_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("extra", "given"))

    @classmethod
    def claims(cls, cfg: dict) -> bool:
        """Whether a config dict is this kind's (the fallback kinds claim anything)."""
        return True

    @classmethod
    def from_cfg(cls, cfg: dict) -> TowerSpec:
        typed = set(cls.typed_keys())
        values = {k: _plain(v) for k, v in cfg.items() if k in typed}
        extra = {k: v for k, v in cfg.items() if k not in typed}
        return cls(**values, extra=extra, given=tuple(cfg))

    def to_cfg(self) -> dict:
        defaults = {
            f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(self)
            if f.name in self.typed_keys()
        }
        values = {k: getattr(self, k) for k in self.typed_keys()}
        out = {}
        for key in self.given:  # the source's order first
            if key in values:
                out[key] = _cfg_value(values[key])
            elif key in self.extra:
                out[key] = self.extra[key]
        for key, value in values.items():  # then fields set since (never defaults not asked for)
            if key not in out and value != defaults.get(key):
                out[key] = _cfg_value(value)
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    def replace(self, **changes) -> TowerSpec:
        """A copy with typed fields or extra keys changed."""
        typed = set(self.typed_keys())
        extra = {**self.extra, **{k: v for k, v in changes.items() if k not in typed}}
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if k in typed}, extra=extra)

    # ------------------------------------------------------------- behaviour
    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        raise NotImplementedError(f"tower kind {self.kind!r} has no build()")

    def lock(self, module: nn.Module, unlocked: int, key: str) -> None:
        """LiT: freeze the module's weights but its last ``unlocked`` groups (its own
        ``lock()``); a refusal is one ConfigError naming ``key``."""
        if not callable(getattr(module, "lock", None)):
            raise ConfigError(f"config key '{key}': the {type(module).__name__} tower has no lock() method")
        try:
            self._lock(module, unlocked)
        except AssertionError as e:  # open_clip's ModifiedResNet: partial locking unsupported
            raise ConfigError(
                f"config key '{key}': {type(module).__name__}.lock refused {unlocked} unlocked groups: {e}"
            ) from None

    def _lock(self, module: nn.Module, unlocked: int) -> None:
        if self.side == "vision":
            module.lock(unlocked_groups=unlocked, freeze_bn_stats=False)  # BatchNorm: model.batchnorm=frozen
        else:
            module.lock(unlocked_layers=unlocked)

    def lock_groups(self, module: nn.Module) -> int:
        """How many groups ``lock(..., unlocked=N)`` can leave trainable."""
        return 0

    def open_clip_cfg(self) -> dict:
        """This tower's config in ``open_clip_config.json`` (export/to_open_clip.py)."""
        raise UsageError(f"--format open_clip: the {self.kind} tower kind has no open_clip export")

    def onnx_input(self, batch: int, tokenizer=None):
        """An example input of ``batch`` rows to trace the ONNX graph with."""
        raise UsageError(f"--format onnx: the {self.kind} tower kind has no ONNX export hook")

    def flops(self, embed_dim: int) -> int:
        """Forward FLOPs for one sample (2 per multiply-add of matmuls, convolutions and
        attention, as torch's FLOP counter and mmalign.run.monitors count them)."""
        raise NotImplementedError(f"tower kind {self.kind!r} has no FLOP count")


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _cfg_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ------------------------------------------------------------------ registry
_KINDS: dict[str, type[TowerSpec]] = {}


def register_tower(kind: str):
    """Class decorator: register a :class:`TowerSpec` subclass (its ``side`` set) as ``kind``."""

    def add(cls: type[TowerSpec]) -> type[TowerSpec]:
        if cls.side not in ("vision", "text"):
            raise ValueError(f"tower kind {kind!r}: side must be 'vision' or 'text', got {cls.side!r}")
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise ValueError(f"tower kind {kind!r} is already registered ({_KINDS[kind].__name__})")
        cls.kind = kind
        _KINDS[kind] = cls
        return cls

    return add


def unregister_tower(kind: str) -> None:
    _KINDS.pop(kind, None)


def registered(side: str | None = None) -> list[str]:
    """Registered kinds, in registration order."""
    return [k for k, c in _KINDS.items() if side is None or c.side == side]


def tower_kind(spec: TowerSpec) -> str:
    return type(spec).kind


def spec_class(kind: str) -> type[TowerSpec]:
    if kind not in _KINDS:
        raise ConfigError(f"unknown tower kind {kind!r} (registered: {', '.join(_KINDS)})")
    return _KINDS[kind]


def spec_from_cfg(side: str, cfg: dict) -> TowerSpec:
    """The typed spec of a ``vision_cfg`` / ``text_cfg`` dict: the newest kind that claims it."""
    for kind in reversed(registered(side)):
        if _KINDS[kind].claims(cfg):
            return _KINDS[kind].from_cfg(cfg)
    raise ConfigError(f"no {side} tower kind claims the config {cfg}")


def build_tower(spec: TowerSpec, embed_dim: int, quick_gelu: bool = False) -> nn.Module:
    return spec.build(int(embed_dim), bool(quick_gelu))


__all__ = [
    "Tower",
    "TowerSpec",
    "build_tower",
    "register_tower",
    "registered",
    "spec_class",
    "spec_from_cfg",
    "tower_kind",
    "unregister_tower",
]
