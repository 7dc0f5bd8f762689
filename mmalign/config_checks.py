"""The domain of every typed config key, checked one key at a time before anything runs.

:mod:`mmalign.config` checks a value's *type* while building the dataclasses, and the
combinations of keys (warmup within the steps, a loss term and the data it needs) in
``validate()``.  This module holds the third part: what values one key may take on its own
(a count >= 0, a probability in [0, 1], betas in [0, 1), a non-empty path, ...).
:data:`DOMAINS` names every key that is not a bool, an enum (``Literal``) or a free mapping;
``tests/test_config_domains.py`` keeps it complete as keys are added.

On top of each key's own domain, every value must survive the code that uses it: an int fits
int64 (torch's seeds, counters and tensor sizes), a float fits float32 (the dtype of the
weights it scales), a string holds no NUL byte (the OS refuses it in a path), a path can be
asked about (a name too long for the file system is refused here, not at first use), and a
list or mapping is a finite tree (YAML anchors can make one that holds itself).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Optional

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
    """A number in [lo, hi]; either end may be open.  ``note`` explains the special values."""

    lo: float = -math.inf
    hi: float = math.inf
    lo_open: bool = False
    hi_open: bool = False
    note: str = ""

    def holds(self, v: Any) -> bool:
        if not _number(v) or not math.isfinite(v):
            return False
        above = v > self.lo if self.lo_open else v >= self.lo
        below = v < self.hi if self.hi_open else v <= self.hi
        return above and below

    def describe(self) -> str:
        if self.hi == math.inf:
            text = "any finite number" if self.lo == -math.inf else f"{'>' if self.lo_open else '>='} {self.lo:g}"
        else:
            text = f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"
        return text + (f" ({self.note})" if self.note else "")

    def check(self, key: str, value: Any) -> None:
        if not self.holds(value):
            raise ConfigError(f"config key '{key}' must be {self.describe()}, got {show_value(value)}")


@dataclass(frozen=True)
class Seq:
    """A list of numbers: exactly ``len(items)`` of them, the i-th in ``items[i]`` (``each``
    instead: any positive count, all in it); ``ordered``: non-decreasing ([lo, hi] ranges)."""

    items: tuple = ()
    each: Optional[Span] = None
    ordered: bool = False
    what: str = ""

    def check(self, key: str, value: Any) -> None:
        spans = self.items if self.each is None else (self.each,) * (len(value) if isinstance(value, list) else 0)
        ok = (isinstance(value, list) and len(value) == len(spans) and len(spans) > 0
              and all(s.holds(v) for s, v in zip(spans, value))
              and (not self.ordered or all(a <= b for a, b in zip(value, value[1:]))))
        if not ok:
            raise ConfigError(f"config key '{key}' must be {self.what}, got {show_value(value)}")


@dataclass(frozen=True)
class Text:
    """A string: non-empty unless ``empty_ok``; ``pattern`` (a full match) for names and
    enum-like strings; ``path``: the file system can be asked about it."""

    empty_ok: bool = False
    pattern: Optional[str] = None
    what: str = "a non-empty string"
    path: bool = False

    def check(self, key: str, value: Any) -> None:
        if value == "" and self.empty_ok:
            return
        named = isinstance(value, str) and value.strip()
        if not named or (self.pattern is not None and not re.fullmatch(self.pattern, value)):
            raise ConfigError(f"config key '{key}' must be {self.what}, got {show_value(value)}")
        if self.path:
            _probe_path(key, value)


def _probe_path(key: str, value: str) -> None:
    """A path the OS cannot even look up (a component over the file system's name limit, a
    component that is a file) fails here rather than at the first write, hours later."""
    try:
        os.stat(os.path.expanduser(value))
    except FileNotFoundError:
        pass  # whether it must exist is the key's own business (a run dir is made, weights are not)
    except NotADirectoryError:
        raise ConfigError(f"config key '{key}': {show_value(value)} goes through a file as if it were a "
                          f"folder") from None
    except OSError as e:
        raise ConfigError(f"config key '{key}': {show_value(value)} is not a usable path ({e.strerror})") from None


class ShardSpecs:
    """``data.train``: a shard spec, or a non-empty list of them."""

    def check(self, key: str, value: Any) -> None:
        specs = value if isinstance(value, list) else [value]
        if not specs or not all(isinstance(s, str) and s.strip() for s in specs):
            raise ConfigError(f"config key '{key}' must be a shard spec or a list of shard specs, "
                              f"got {show_value(value)}")


class Weights:
    """``data.train_weights``: non-negative numbers with a positive sum (one per source: validate())."""

    def check(self, key: str, value: Any) -> None:
        if not (isinstance(value, list) and value and all(Span(0).holds(v) for v in value) and sum(value) > 0):
            raise ConfigError(f"config key '{key}' must be non-negative numbers with a positive sum, "
                              f"got {show_value(value)}")


COUNT, POSITIVE = Span(0), Span(1)
PROB, OPEN_PROB = Span(0, 1), Span(0, 1, hi_open=True)
RATE = Span(0, lo_open=True)  # a learning rate, a temperature, a budget: > 0
PATH = Text(what="a non-empty path", path=True)
BOUNDED_PAIR = "[lo, hi] with 0.001 <= lo <= hi <= 1000"
NAME = r"\S(?:.*\S)?"  # no surrounding blanks: " label" would never match the field "label"

DOMAINS: dict[str, Any] = {
    "seed": COUNT,
    "output": PATH,
    "model.preset": Text(pattern=NAME, what="an architecture name (`mmalign models` lists them) or null"),
    "model.embed_dim": POSITIVE,
    "model.image_size": POSITIVE,
    "model.init_logit_scale": Span(0, LOG_FLOAT32_MAX, note="the log of the logit scale; exp() must fit float32"),
    "model.max_logit_scale": Span(1),
    "model.init_logit_bias": Span(note="SigLIP uses -10"),
    "model.tokenizer": PATH,
    "model.lock_image_unlocked_groups": Span(0, note="0 = the whole tower locked"),
    "model.lock_text_unlocked_layers": Span(0, note="0 = the whole tower locked"),
    "model.pretrained": PATH,
    "model.pretrained_image": PATH,
    "model.pretrained_text": PATH,
    "model.timm_weights": PATH,
    "model.patch_dropout": Span(0, 1, hi_open=True, note="0 = off"),
    "data.train": ShardSpecs(),
    "data.train_weights": Weights(),
    "data.val": Text(empty_ok=True, what="a shard spec ('' = none)"),
    "data.workers": Span(0, MAX_LOCAL, note="0 = in the main process"),
    "data.worker_batch_size": Span(0, note="0 = automatic"),
    "data.shuffle_buffer": Span(1, note="1 = no shuffling"),
    "data.views": Span(1, 2),
    "data.id_field": Text(pattern=NAME, what="a .json field name or null"),
    "data.hard_negatives": Span(0, note="0 = off"),
    "data.max_image_pixels": POSITIVE,
    "data.max_consecutive_skips": POSITIVE,
    "data.max_member_bytes": POSITIVE,
    "data.remote_retries": COUNT,
    "data.remote_backoff": Span(0, 3600, note="seconds"),
    "data.remote_timeout": Span(1e-3, 86400, note="seconds"),
    "data.augment.crop_scale": Seq((Span(0, 1, lo_open=True),) * 2, ordered=True,
                                   what="[lo, hi] with 0 < lo <= hi <= 1"),
    "data.augment.crop_ratio": Seq((Span(1e-3, 1e3),) * 2, ordered=True, what=BOUNDED_PAIR),
    "data.augment.color_jitter": Seq((Span(0),) * 3 + (Span(0, 0.5),),
                                     what="[brightness, contrast, saturation, hue] >= 0 with hue <= 0.5"),
    "data.augment.color_jitter_prob": PROB,
    "data.augment.grayscale_prob": PROB,
    "data.augment.blur_prob": PROB,
    "data.augment.blur_sigma": Seq((Span(1e-3, 1e3),) * 2, ordered=True, what=BOUNDED_PAIR),
    "train.steps": POSITIVE,
    "train.global_batch_size": POSITIVE,
    "train.lr": RATE,
    "train.warmup_steps": COUNT,
    "train.weight_decay": Span(0),
    "train.betas": Seq((OPEN_PROB,) * 2, what="[beta1, beta2], each in [0, 1)"),
    "train.eps": Span(0, 1, lo_open=True),
    "train.momentum": OPEN_PROB,
    "train.grad_clip": Span(0, note="0 = off"),
    "train.grad_cache_chunk_size": Span(0, note="0 = off; or auto"),
    "train.memory_budget_gb": Span(0, note="0 = measured"),
    "train.device": Text(pattern=r"auto|cpu|cuda(:\d+)?", what="auto, cpu, cuda or cuda:N"),
    "train.log_every": POSITIVE,
    "train.eval_every": Span(0, note="0 = only at the end"),
    "train.checkpoint_every": Span(0, note="0 = none"),
    "train.keep_checkpoints": COUNT,
    "train.max_consecutive_skips": POSITIVE,
    "train.threads": Span(0, MAX_LOCAL, note="0 = torch's default"),
    "train.lr_image": Span(0, lo_open=True, note="or null for train.lr"),
    "train.lr_text": Span(0, lo_open=True, note="or null for train.lr"),
    "train.layer_decay": Span(0, 1, lo_open=True, note="1 = off"),
    "train.unmasked_steps": COUNT,
    "train.compile_backend": Text(pattern=r"[A-Za-z_][\w.-]*",
                                  what="a torch.compile backend name (inductor, eager, ...)"),
    "loss.tile_size": Span(0, note="0 = untiled; or auto"),
    "loss.tile_budget_mb": RATE,
    "loss.false_negative_ids": Text(pattern=NAME, what="none, caption or a .json id field name"),
    "loss.hard_negative_beta": Span(0),
    "loss.debias_prior": OPEN_PROB,
    "loss.positive_mask": Text(pattern="none|attribute_subset", what="none or attribute_subset"),
    "loss.queue_size": Span(0, note="0 = off"),
    "loss.momentum": OPEN_PROB,
    "loss.image_image_weight": Span(0),
    "loss.image_image_temperature": RATE,
    "deepspeed.zero_stage": Span(0, 3),
    "eval.suite": Text(empty_ok=True, what="a suite name, a suite YAML or none"),
    "eval.batch_size": POSITIVE,
    "monitor.probe_size": Span(0, note="0 = off"),
    "monitor.min_dim_std": Span(0, 1, note="0 = no alarm"),
    "monitor.min_effective_rank_frac": Span(0, 1, note="0 = no alarm"),
    "monitor.peak_tflops": Span(0, note="0 = known GPUs only"),
    "dist.timeout_s": Span(0, 86400, note="seconds; 0 = 600 s on GPU, 120 s on CPU"),
}


def leaves(cfg: Any, prefix: str = ""):
    """``(dotted key, value)`` for every non-dataclass field of ``cfg``, in declaration order."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            yield from leaves(value, prefix + f.name + ".")
        else:
            yield prefix + f.name, value


def _check_tree(key: str, value: Any) -> None:
    """A list / mapping value: finite (no self-reference, bounded size), and every number and
    string in it as usable as a top-level one."""
    seen, stack, count = set(), [(value, 0)], 0
    while stack:
        node, depth = stack.pop()
        count += 1
        if depth > MAX_DEPTH or count > MAX_NODES:
            raise ConfigError(f"config key '{key}' is nested deeper than {MAX_DEPTH} levels or holds more than "
                              f"{MAX_NODES} entries (a YAML anchor that refers to itself?)")
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


def check_domains(cfg: Any) -> None:
    """Every key of ``cfg`` (a :class:`mmalign.config.Config`) within its own domain; the
    first that is not is one ConfigError line naming it."""
    for key, value in leaves(cfg):
        if value is None:
            continue  # an Optional key left unset: its type allowed it
        if isinstance(value, (list, dict)):
            _check_tree(key, value)
        else:
            _check_scalar(key, value)
        rule = DOMAINS.get(key)
        if rule is not None and not (value == "auto" and isinstance(rule, Span)):  # int-or-auto keys
            rule.check(key, value)


__all__ = ["DOMAINS", "check_domains", "leaves", "show_value"]
