"""The tower contract and its registry.

A tower kind is one typed spec class (a dataclass of its open_clip-style config keys) that
knows how to build its module, what input it takes (``image_size`` / ``context_length``),
how it is locked, exported and tokenised, and its FLOP count.  Every hook is declared here
with a default; a kind overrides those it has.  Kinds register themselves with
:func:`register_tower`.

A tower dict (``vision_cfg`` / ``text_cfg``) names its kind with ``kind:``; architectures are
saved with it (:meth:`Towers.to_arch <mmalign.models.towers.arch.Towers.to_arch>`).  A dict
without one (written before ``kind:`` existed, an open_clip config, a preset) is the kind that
claims it (:meth:`TowerSpec.claims`): a specific kind's claim wins over a ``fallback`` kind's
(open_clip's ViT / text transformer), so registration order never matters.

Saved formats are the open_clip dicts: ``from_cfg(cfg).to_cfg() == cfg`` for every kind
(the keys a config gave, in its order, and nothing else, ``kind`` aside), so old exports and
checkpoints load unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar, cast

from mmalign.errors import ConfigError, UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

KIND_KEY = "kind"  # the tower dict's key naming its kind

Tokenizer = Callable[[list[str]], "torch.Tensor"]  # captions -> (N, context_length) ids


@dataclass
class TowerSpec:
    """Base of every kind: typed fields named as the config keys, plus ``extra`` (keys the
    kind does not type, passed through to its builder) and ``given`` (the keys the source
    config had, in order: :meth:`to_cfg` writes those and any field changed from its default)."""

    kind: ClassVar[str] = ""  # set by register_tower
    side: ClassVar[str] = ""  # "vision" or "text"
    fallback: ClassVar[bool] = False  # claims what no specific kind claims (dicts without kind:)
    hf_clip: ClassVar[bool] = False  # exportable as a transformers CLIPModel tower (export/to_hf.py)
    marker: ClassVar[str] = ""  # the config key that names the kind, for messages
    ships_files: ClassVar[bool] = False  # export_files() copies files a saved model or export needs

    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    given: tuple[str, ...] = field(default=(), repr=False, compare=False)

    # ------------------------------------------------------------- config dicts
    @classmethod
    def typed_keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("extra", "given"))

    @classmethod
    def claims(cls, cfg: dict[str, Any]) -> bool:
        """Whether a tower dict without ``kind:`` is this kind's (old saved models, open_clip
        configs, presets).  By default none: a new kind is chosen by ``kind:``."""
        return False

    @classmethod
    def from_cfg(cls, cfg: dict[str, Any]) -> TowerSpec:
        typed = set(cls.typed_keys())
        values = {k: _plain(v) for k, v in cfg.items() if k in typed}
        extra = {k: v for k, v in cfg.items() if k not in typed}
        return cls(**values, extra=extra, given=tuple(cfg))

    def to_cfg(self) -> dict[str, Any]:
        """The kind's own keys (no ``kind``): what its builder and open_clip take."""
        defaults = {f.name: _default(f) for f in dataclasses.fields(self) if f.name in self.typed_keys()}
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

    def saved_cfg(self) -> dict[str, Any]:
        """The tower dict as architectures are saved: ``kind`` first, then :meth:`to_cfg`."""
        return {KIND_KEY: self.kind} | self.to_cfg()

    def replace(self: _Spec, **changes: Any) -> _Spec:
        """A copy with typed fields or extra keys changed."""
        typed = set(self.typed_keys())
        extra = {**self.extra, **{k: v for k, v in changes.items() if k not in typed}}
        return dataclasses.replace(self, **{k: v for k, v in changes.items() if k in typed}, extra=extra)

    # ------------------------------------------------------------- inputs
    @property
    def image_size(self) -> int | tuple[int, ...]:
        """An image tower's input side (or (H, W)); open_clip's default where a kind has none."""
        return 224

    @property
    def context_length(self) -> int:
        """A text tower's token ids per caption; open_clip's default where a kind has none."""
        return 77

    @property
    def tokenizer_file(self) -> str | None:
        """The sentencepiece model file this text tower's ids come from, or None."""
        return None

    @property
    def folder(self) -> str | None:
        """The local folder this tower's files come from (a Hugging Face model), or None."""
        return None

    # ------------------------------------------------------------- behaviour
    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        raise NotImplementedError(f"tower kind {self.kind!r} has no build()")

    def tokenizer(self, base_dir: str | Path | None = None) -> Tokenizer:
        """A text tower's tokenizer: ``list[str] -> (N, context_length)`` ids; a relative file or
        folder resolves against ``base_dir``.  No default (never CLIP BPE by accident)."""
        raise UsageError(f"the {self.kind} {self.side} tower kind has no tokenizer() hook")

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
        lock = cast("Callable[..., None]", module.lock)  # checked callable by lock()
        if self.side == "vision":
            lock(unlocked_groups=unlocked, freeze_bn_stats=False)  # BatchNorm: model.batchnorm=frozen
        else:
            lock(unlocked_layers=unlocked)

    def lock_groups(self, module: nn.Module) -> int:
        """How many groups ``lock(..., unlocked=N)`` can leave trainable."""
        return 0

    def open_clip_cfg(self) -> dict[str, Any]:
        """This tower's config in ``open_clip_config.json`` (export/to_open_clip.py)."""
        raise UsageError(f"--format open_clip: the {self.kind} tower kind has no open_clip export")

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        """An example input of ``batch`` rows (to trace the ONNX graph with, and to count FLOPs)."""
        raise UsageError(f"--format onnx: the {self.kind} tower kind has no ONNX export hook")

    def onnx_tokenizer(self, tokenizer_file: str | None) -> dict[str, Any]:
        """A text tower's ``tokenizer`` entry of ``onnx_config.json``."""
        raise UsageError(f"--format onnx: the {self.kind} text tower kind has no ONNX tokenizer hook")

    def export_files(self, out: Path) -> None:
        """Files the tower needs beside a saved model or an export, into ``out`` (with
        ``ships_files`` set); none by default."""

    def flops(self, embed_dim: int) -> int:
        """Forward FLOPs for one sample (2 per multiply-add of matmuls, convolutions and
        attention, as torch's FLOP counter and mmalign.run.monitors count them).

        By default torch's FLOP counter (models/flops.py) on a forward of the built tower at
        batch 1 (:meth:`onnx_input`): on the meta device (no memory, no maths), or on a CPU copy
        where the forward reads values.  A kind with an analytic count overrides this."""
        import torch

        tokenizer = self.tokenizer() if self.side == "text" else None
        try:
            with torch.device("meta"):
                module = self.build(embed_dim, False).eval()
                example = self.onnx_input(1, tokenizer).to("meta")
                return _counted(module, example)
        except (NotImplementedError, RuntimeError):  # a data-dependent op: count a real copy
            module = self.build(embed_dim, False).eval()
            return _counted(module, self.onnx_input(1, tokenizer))


_Spec = TypeVar("_Spec", bound=TowerSpec)


def _counted(module: nn.Module, example: torch.Tensor) -> int:
    import torch

    from mmalign.models.flops import flop_counter

    counter = flop_counter()
    with counter, torch.no_grad():
        module(example)
    return int(counter.get_total_flops())


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return None if f.default_factory is dataclasses.MISSING else f.default_factory()


def _plain(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


def _cfg_value(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


# ------------------------------------------------------------------ registry
_KINDS: dict[str, type[TowerSpec]] = {}


def register_tower(kind: str) -> Callable[[type[_Spec]], type[_Spec]]:
    """Class decorator: register a :class:`TowerSpec` subclass (its ``side`` set) as ``kind``."""

    def add(cls: type[_Spec]) -> type[_Spec]:
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


def spec_class(side: str, kind: str) -> type[TowerSpec]:
    """The registered class of ``kind``, a ``side`` tower; an unknown kind is one ConfigError."""
    cls = _KINDS.get(kind)
    if cls is None or cls.side != side:
        known = ", ".join(sorted(registered(side)))
        raise ConfigError(f"{side} tower kind {kind!r} is not registered (registered {side} kinds: {known})")
    return cls


def claimant(side: str, cfg: dict[str, Any]) -> type[TowerSpec]:
    """The kind of a tower dict without ``kind:``: the one specific kind that claims it, else
    the one fallback kind that does (never the registration order)."""
    claims = [_KINDS[k] for k in registered(side) if _KINDS[k].claims(cfg)]
    for tier in ([c for c in claims if not c.fallback], [c for c in claims if c.fallback]):
        if len(tier) == 1:
            return tier[0]
        if tier:
            names = ", ".join(sorted(c.kind for c in tier))
            raise ConfigError(f"{side} tower kinds {names} all claim the config {cfg}: name one with 'kind:'")
    raise ConfigError(f"no {side} tower kind claims the config {cfg}: name one with 'kind:'")


def tower_kind(side: str, cfg: dict[str, Any]) -> str:
    """The kind a tower dict names (``kind:``), or the kind that claims it."""
    return str(cfg[KIND_KEY]) if KIND_KEY in cfg else claimant(side, cfg).kind


def spec_from_cfg(side: str, cfg: dict[str, Any]) -> TowerSpec:
    """The typed spec of a ``vision_cfg`` / ``text_cfg`` dict: its ``kind:``, or the kind that
    claims it (:func:`claimant`)."""
    cfg = dict(cfg)
    kind = cfg.pop(KIND_KEY, None)
    cls = claimant(side, cfg) if kind is None else spec_class(side, str(kind))
    return cls.from_cfg(cfg)


__all__ = [
    "KIND_KEY",
    "Tokenizer",
    "TowerSpec",
    "claimant",
    "register_tower",
    "registered",
    "spec_class",
    "spec_from_cfg",
    "tower_kind",
    "unregister_tower",
]
