"""Building the typed config: the dataclass defaults <- a YAML file <- ``--set a.b=c``.

Each value is checked against its field's annotation here (a wrong type is one line naming
the key; the few lossless conversions, int -> float, are made); what values a key may take
is its metadata's business (:mod:`mmalign.config.checks`).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

import yaml

from mmalign.config.checks import show_value
from mmalign.config.schema import Config
from mmalign.errors import ConfigError
from mmalign.resources import recipe_path

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

_D = TypeVar("_D", bound="DataclassInstance")


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", str(tp)).replace("NoneType", "null")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check ``value`` against the annotation ``tp``; convert the few lossless cases."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError:
                pass
        raise ConfigError(
            f"config key '{key}': expected {' or '.join(map(_type_name, args))}, got {show_value(value)}"
        )
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(
                f"config key '{key}': expected one of {_type_name(tp)}, got {show_value(value)}"
            )
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):  # an annotation: a class
        if not isinstance(value, dict):
            raise ConfigError(f"config key '{key}': expected a mapping, got {show_value(value)}")
        return _build(tp, value, key + ".")
    if origin is list and typing.get_args(tp) and dataclasses.is_dataclass(typing.get_args(tp)[0]):
        # a list of entries (eval.during): each one a mapping of its dataclass, named KEY[i]
        if not isinstance(value, list):
            raise ConfigError(f"config key '{key}': expected a list of mappings, got {show_value(value)}")
        return [_coerce(item, typing.get_args(tp)[0], f"{key}[{i}]") for i, item in enumerate(value)]
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
        list: lambda v: isinstance(v, list),
        dict: lambda v: isinstance(v, dict),
    }.get(origin or tp)  # list[float]: the container is checked here, its items by the key's rule
    if ok is None:
        raise TypeError(f"unsupported annotation {tp!r} for {key}")
    if not ok(value):
        raise ConfigError(f"config key '{key}': expected {_type_name(tp)}, got {show_value(value)}")
    if tp is float:  # nan/inf pass every "> 0" check and fail much later; so does an int too big for a float
        if isinstance(value, int) and abs(value) > 2**1023 or not math.isfinite(value):
            raise ConfigError(f"config key '{key}': expected a finite number, got {show_value(value)}")
        return float(value)
    return value


def _build(cls: type[_D], data: dict[str, Any], prefix: str = "") -> _D:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise ConfigError(f"unknown config key '{prefix}{key}' (valid: {', '.join(sorted(names))})")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    for f in dataclasses.fields(cls):  # a key without a default (an eval.during entry's suite, every)
        if (
            f.name not in kwargs
            and f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
        ):
            raise ConfigError(f"config key '{prefix}{f.name}' is required")
    return cls(**kwargs)


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """Insert ``value`` at ``a.b.c`` in a nested dict, creating mappings on the way."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"config key '{dotted}': '{part}' is not a mapping")
        node = child
    node[parts[-1]] = value


def parse_override(text: str) -> tuple[str, Any]:
    """``a.b=c`` -> ("a.b", yaml-parsed c).  ``c`` is parsed as YAML, so 3, 1e-3, true,
    [0.5, 1.0] and null work; the field's annotation then checks the result."""
    if "=" not in text:
        raise ConfigError(f"override '{text}' must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ConfigError(f"override '{text}' has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except (yaml.YAMLError, ValueError, RecursionError):  # ValueError: an int of > 4300 digits; deep [[[[...
        value = raw
    # "1e-3" is a string to YAML 1.1; a float field still deserves it.
    if isinstance(value, str):
        try:
            value = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError:
            pass
    return key, value


def build_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file <- overrides, each value of its key's type (neither resolved nor
    validated: :func:`mmalign.config.load_config` does both)."""
    tree: dict[str, Any] = {}
    if path is not None:
        path = recipe_path(path)  # a file, or a shipped recipe's name (one line when neither)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {e.start}: {e.reason})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
        except (
            ValueError,
            RecursionError,
        ) as e:  # an int of > 4300 digits; nesting deeper than Python's stack
            raise ConfigError(f"config file {path} is not a usable config ({type(e).__name__})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping at the top level")
        tree = loaded
    for item in overrides:
        key, value = parse_override(item)
        _set_path(tree, key, value)
    return _build(Config, tree)
