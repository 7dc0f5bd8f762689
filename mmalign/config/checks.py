"""Each config key's domain, declared beside the key and checked by one generic validator.

:mod:`mmalign.config.schema` declares every key with :func:`knob`: its default, the one
sentence docs/configuration.md's table shows (``doc``), its unit, and its ``rule`` (a :class:`Span`, a
:class:`Seq`, a :class:`Text`, ...) in the field's metadata.  A value's *type* is checked
while the dataclasses are built (:mod:`mmalign.config.load`); :func:`check_domains` walks the
built config and checks each key against the rule in its metadata; the combinations of keys
are :func:`mmalign.config.validate`'s.

On top of each key's own rule, every value must survive the code that uses it: an int fits
int64 (torch's seeds, counters and tensor sizes), a float fits float32 (the dtype of the
weights it scales), a string holds no NUL byte (the OS refuses it in a path), a path can be
asked about (a name too long for the file system is refused here, not at first use), and a
list or mapping is a finite tree (YAML anchors can make one that holds itself).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mmalign.errors import ConfigError

INT64_MAX = 2**63 - 1
FLOAT32_MAX = 3.4028234663852886e38
LOG_FLOAT32_MAX = math.log(FLOAT32_MAX)  # ~88.7: exp() of a larger log-scale overflows float32
MAX_NODES = 10_000  # list / mapping values: more entries than any real config holds
MAX_DEPTH = 32
MAX_LOCAL = 1024  # threads / loader processes on one host: more is a typo, and each one is started


def show_value(value: Any) -> str:
    """``repr(value)``, cut to fit a one-line message."""
    try:
        text = repr(value)
    except ValueError:  # an int of more digits than Python will print
        return "a number of more than 4300 digits"
    return text if len(text) <= 80 else text[:77] + "..."


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass(frozen=True)
class Span:
    """A number in [lo, hi]; either end may be open.  ``note`` explains the special values.
    ``hi_key``: the upper end is another key's value (``train.steps``), read by check_domains."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""
    hi_key: str = ""

    def holds(self, v: Any) -> bool:
        if not _number(v) or not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return bool(above and below)

    def within(self, cfg: Any) -> Span:
        """This span with ``hi_key`` read from ``cfg`` (itself when it has none)."""
        if not self.hi_key:
            return self
        hi = _lookup(cfg, self.hi_key)
        return dataclasses.replace(self, hi=hi) if _number(hi) and math.isfinite(hi) else self

    def describe(self, unit: str = "") -> str:
        if self.hi == math.inf and not self.hi_key:
            text = (
                "any finite number"
                if self.lo == -math.inf
                else f"{'>' if self.lo_open else '>='} {self.lo:g}"
            )
        else:
            hi = (
                f"{self.hi:g}"
                if not self.hi_key
                else self.hi_key
                if self.hi == math.inf
                else f"{self.hi_key}={self.hi:g}"
            )
            text = f"in {'(' if self.lo_open else '['}{self.lo:g}, {hi}{')' if self.hi_open else ']'}"
        return text + (f" {unit}" if unit else "") + (f" ({self.note})" if self.note else "")

    def check(self, key: str, value: Any, unit: str = "") -> None:
        if value == "auto":  # the int-or-auto keys: their annotation already allowed the word
            return
        if not self.holds(value):
            raise ConfigError(f"config key '{key}' must be {self.describe(unit)}, got {show_value(value)}")


@dataclass(frozen=True)
class Seq:
    """A list of numbers: exactly ``len(items)`` of them, the i-th in ``items[i]`` (``each``
    instead: any positive count, all in it); ``ordered``: non-decreasing ([lo, hi] ranges)."""

    items: tuple[Span, ...] = ()
    each: Span | None = None
    ordered: bool = False
    what: str = ""

    def describe(self, unit: str = "") -> str:
        return self.what + (f" ({unit})" if unit else "")

    def check(self, key: str, value: Any, unit: str = "") -> None:
        spans = (
            self.items if self.each is None else (self.each,) * (len(value) if isinstance(value, list) else 0)
        )
        ok = (
            isinstance(value, list)
            and len(value) == len(spans)
            and len(spans) > 0
            and all(s.holds(v) for s, v in zip(spans, value))
            and (not self.ordered or all(a <= b for a, b in zip(value, value[1:])))
        )
        if not ok:
            raise ConfigError(f"config key '{key}' must be {self.what}, got {show_value(value)}")


@dataclass(frozen=True)
class Text:
    """A string: non-empty unless ``empty_ok``; ``pattern`` (a full match) for names and
    enum-like strings; ``path``: the file system can be asked about it."""

    empty_ok: bool = False
    pattern: str | None = None
    what: str = "a non-empty string"
    path: bool = False

    def describe(self, unit: str = "") -> str:
        return self.what

    def check(self, key: str, value: Any, unit: str = "") -> None:
        if value == "" and self.empty_ok:
            return
        named = isinstance(value, str) and value.strip()
        if not named or (self.pattern is not None and not re.fullmatch(self.pattern, value)):
            raise ConfigError(f"config key '{key}' must be {self.what}, got {show_value(value)}")
        if self.path:
            _probe_path(key, value)


def _lookup(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _probe_path(key: str, value: str) -> None:
    """A path the OS cannot even look up (a component over the file system's name limit, a
    component that is a file) fails here rather than at the first write, hours later."""
    try:
        os.stat(os.path.expanduser(value))
    except FileNotFoundError:
        pass  # whether it must exist is the key's own business (a run dir is made, weights are not)
    except NotADirectoryError:
        raise ConfigError(
            f"config key '{key}': {show_value(value)} goes through a file as if it were a folder"
        ) from None
    except OSError as e:
        raise ConfigError(
            f"config key '{key}': {show_value(value)} is not a usable path ({e.strerror})"
        ) from None


class ShardSpecs:
    """``data.train``: a shard spec, or a non-empty list of them."""

    def describe(self, unit: str = "") -> str:
        return "a shard spec or a non-empty list of them"

    def check(self, key: str, value: Any, unit: str = "") -> None:
        specs = value if isinstance(value, list) else [value]
        if not specs or not all(isinstance(s, str) and s.strip() for s in specs):
            raise ConfigError(
                f"config key '{key}' must be a shard spec or a list of shard specs, got {show_value(value)}"
            )


class Weights:
    """``data.train_weights``: non-negative numbers with a positive sum (one per source: validate())."""

    def describe(self, unit: str = "") -> str:
        return "non-negative numbers with a positive sum"

    def check(self, key: str, value: Any, unit: str = "") -> None:
        if not (
            isinstance(value, list) and value and all(Span(0).holds(v) for v in value) and sum(value) > 0
        ):
            raise ConfigError(
                f"config key '{key}' must be non-negative numbers with a positive sum, "
                f"got {show_value(value)}"
            )


class Entries:
    """A list of mappings, each one entry of the dataclass ``cls`` (built by
    :mod:`mmalign.config.load`, which refuses unknown and missing keys): every entry's keys
    checked against their own knobs, as top-level keys are, and named ``KEY[i].FIELD``."""

    def __init__(self, cls: type, what: str):
        self.cls, self.what = cls, what

    def describe(self, unit: str = "") -> str:
        return self.what

    def check(self, key: str, value: Any, unit: str = "") -> None:
        if not isinstance(value, list) or not all(isinstance(e, self.cls) for e in value):
            raise ConfigError(f"config key '{key}' must be {self.what}, got {show_value(value)}")
        for i, entry in enumerate(value):
            for sub, v, f in fields_of(entry, f"{key}[{i}]."):
                check_key(sub, v, f)


# The domains most keys share.
COUNT, POSITIVE = Span(0), Span(1)
PROB, OPEN_PROB = Span(0, 1), Span(0, 1, hi_open=True)
RATE = Span(0, lo_open=True)  # a learning rate, a temperature, a budget: > 0
PATH = Text(what="a non-empty path", path=True)
BOUNDED_PAIR = "[lo, hi] with 0.001 <= lo <= hi <= 1000"
NAME = r"\S(?:.*\S)?"  # no surrounding blanks: " label" would never match the field "label"

# A model named instead of a path (mmalign.models.hub resolves it): open_clip's ``hf-hub:ORG/NAME``,
# its ``ARCH/TAG``, or a transformers ``ORG/NAME`` (huggingface_hub's rule for repository ids).
HF_HUB_PREFIX = "hf-hub:"
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96}")


def model_name_form(value: str) -> bool:
    """``value`` is spelled as a model name rather than a path: ``hf-hub:ORG/NAME`` or one
    ``A/B`` of repository-id characters whose ``A`` is no local folder (``runs/x`` with a
    ``runs/`` here stays a path). Existence is checked by whoever reads it."""
    value = str(value)
    body = value[len(HF_HUB_PREFIX) :] if value.startswith(HF_HUB_PREFIX) else value
    if not _REPO_ID.fullmatch(body) or "--" in body or ".." in body:
        return False
    return value.startswith(HF_HUB_PREFIX) or not os.path.isdir(body.split("/")[0])


def knob(default: Any = dataclasses.MISSING, *, doc: str, rule: Any = None, unit: str = "") -> Any:
    """A config field whose metadata declares it: ``doc`` (one sentence, docs/configuration.md's table),
    ``rule`` (its domain; None: the annotation is the whole domain, as for bools, ``Literal``
    modes and free mappings) and ``unit`` (named in the table and in the error).  A list or
    mapping default is copied per instance."""
    meta = {"doc": doc, "rule": rule, "unit": unit}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def leaves(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """``(dotted key, value)`` for every non-dataclass field of ``cfg``, in declaration order."""
    for key, value, _ in fields_of(cfg, prefix):
        yield key, value


def fields_of(cfg: Any, prefix: str = "") -> Iterator[tuple[str, Any, dataclasses.Field[Any]]]:
    """``(dotted key, value, field)`` for every leaf of ``cfg`` (an instance, or a class: then
    the value is the field's default)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name) if not isinstance(cfg, type) else _default(f)
        if dataclasses.is_dataclass(value):
            yield from fields_of(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, value, f


def _default(f: dataclasses.Field[Any]) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def domains(cls: Any) -> dict[str, Any]:
    """Every key of the config class ``cls`` that declares a rule -> that rule."""
    return {key: f.metadata["rule"] for key, _, f in fields_of(cls) if f.metadata.get("rule") is not None}


def _check_tree(key: str, value: Any) -> None:
    """A list / mapping value: finite (no self-reference, bounded size), and every number and
    string in it as usable as a top-level one."""
    seen, stack, count = set(), [(value, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH or count > MAX_NODES:
            raise ConfigError(
                f"config key '{key}' is nested deeper than {MAX_DEPTH} levels or holds more than "
                f"{MAX_NODES} entries (a YAML anchor that refers to itself?)"
            )
        if isinstance(node, (list, dict)):
            if id(node) in seen:
                raise ConfigError(f"config key '{key}' refers to itself (a YAML anchor inside its own value)")
            seen.add(id(node))
            children = list(node.values()) + list(node.keys()) if isinstance(node, dict) else node
            stack.extend((child, depth + 1) for child in children)
        else:
            _check_scalar(key, node)


def _check_scalar(key: str, value: Any) -> None:
    if isinstance(value, bool) or value is None:
        return
    if isinstance(value, int) and abs(value) > INT64_MAX:
        raise ConfigError(f"config key '{key}': {show_value(value)} does not fit a 64-bit integer")
    if isinstance(value, float) and not (math.isfinite(value) and abs(value) <= FLOAT32_MAX):
        raise ConfigError(f"config key '{key}': {show_value(value)} is not a finite float32 number")
    if isinstance(value, str) and "\0" in value:
        raise ConfigError(f"config key '{key}' holds a NUL character: {show_value(value)}")


def check_key(key: str, value: Any, f: dataclasses.Field[Any], cfg: Any = None) -> None:
    """One key within its own domain: the value's limits, then the rule in its metadata (a
    bound that is another key's value is read from ``cfg``, the whole config)."""
    if value is None:
        return  # an Optional key left unset: its type allowed it
    if isinstance(value, (list, dict)):
        _check_tree(key, value)
    else:
        _check_scalar(key, value)
    rule = f.metadata.get("rule")
    if isinstance(rule, Span) and cfg is not None:
        rule = rule.within(cfg)
    if rule is not None:
        rule.check(key, value, f.metadata.get("unit", ""))


def within_domain(cfg: Any, dotted: str) -> bool:
    """Whether one key of ``cfg`` is within its domain (what resolve() derives from must be)."""
    for key, value, f in fields_of(cfg):
        if key == dotted:
            try:
                check_key(key, value, f, cfg)
            except ConfigError:
                return False
            return True
    raise KeyError(dotted)


def check_domains(cfg: Any) -> None:
    """Every key of ``cfg`` (a :class:`mmalign.config.Config`) within its own domain; the
    first that is not is one ConfigError line naming it.  The one generic validator."""
    for key, value, f in fields_of(cfg):
        check_key(key, value, f, cfg)


__all__ = [
    "Span",
    "Seq",
    "Text",
    "ShardSpecs",
    "Weights",
    "Entries",
    "knob",
    "model_name_form",
    "check_domains",
    "check_key",
    "domains",
    "fields_of",
    "leaves",
    "show_value",
    "within_domain",
]
