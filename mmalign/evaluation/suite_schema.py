"""The typed form of a suite YAML: one dataclass per dataset kind; a task is parsed into the
class registered for its ``type`` (:mod:`mmalign.evaluation.tasks`).

:func:`parse_suite` checks a suite file's mapping against these classes the way the
experiment config is checked: an unknown key, a value of the wrong type and a missing
required key are each one :class:`~mmalign.errors.UsageError` line naming the suite
file, the task and the key.  (A suite's keys are not config keys: only ``eval.suite``,
which names the suite, is.)

Optional fields default to ``None``, meaning "not given": the code that reads the field
owns its default (stated in each field's comment), so :meth:`Suite.to_dict` gives back
exactly the keys the file wrote, and evaluation reads the same mapping it always did.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Union

from mmalign.data.templates import check_templates
from mmalign.errors import UsageError
from mmalign.evaluation.tasks import TaskKind, task_class
from mmalign.evaluation.tasks.base import given

# --------------------------------------------------------------- datasets
# (defaults: mmalign.evaluation.datasets; ``limit`` and ``stratify`` are set by ``--limit`` too)


@dataclass
class DatasetSpec:
    """Base of the dataset kinds."""

    kind: ClassVar[str] = ""


@dataclass
class ShardsDataset(DatasetSpec):
    kind: ClassVar[str] = "shards"
    urls: str | list | None = None  # a shard spec; --data or the run's data.val may give it instead
    limit: int | None = None
    seed: int | None = None
    stratify: str | None = None
    per_class: int | None = None


@dataclass
class DigitsDataset(DatasetSpec):
    kind: ClassVar[str] = "digits"
    size: int | None = None  # pixels, default 32
    caption_templates: list[str] | None = None
    limit: int | None = None
    seed: int | None = None
    stratify: str | None = None
    per_class: int | None = None


@dataclass
class ImageFolderDataset(DatasetSpec):
    kind: ClassVar[str] = "imagefolder"
    path: str | list | None = None  # a directory or a tar of class folders; --data may give it
    classnames: list[str] | None = None
    caption_templates: list[str] | None = None
    per_class: int | None = None
    limit: int | None = None
    seed: int | None = None
    stratify: str | None = None


DATASETS = {cls.kind: cls for cls in (ShardsDataset, DigitsDataset, ImageFolderDataset)}


# ------------------------------------------------------------------ suite


@dataclass
class Suite:
    name: str
    tasks: list = field(default_factory=list)  # task dataclasses, in order
    dataset: Any = None  # a shard spec (str or list) or a dataset dataclass; --data may give it
    template_captions: bool | None = None  # the dataset's captions are class templates (default false)
    extends: str | None = None  # a suite whose dataset and tasks come first

    def to_dict(self) -> dict:
        """The suite as the mapping evaluation reads: the file's keys, each task with its ``type``."""
        out = given(self)
        out["tasks"] = [{"type": t.kind, **given(t)} for t in self.tasks]
        if isinstance(self.dataset, DatasetSpec):  # else a shard spec, as written
            out["dataset"] = {"type": self.dataset.kind, **given(self.dataset)}
        return out


# ---------------------------------------------------------------- parsing


def parse_suite(data: Any, source: str) -> Suite:
    """A suite file's YAML value as a :class:`Suite`; ``source`` names the file in errors."""
    if not isinstance(data, dict):
        raise UsageError(f"suite {source}: not a suite (a YAML mapping), got {type(data).__name__}")
    where = f"suite {source}"
    raw = dict(data)
    tasks = raw.pop("tasks", None)
    dataset = raw.pop("dataset", None)
    suite = _build(Suite, raw, where, skip=("tasks", "dataset"))
    if tasks is not None and not isinstance(tasks, list):
        raise UsageError(f"{where}: key 'tasks' expects a list of tasks, got {tasks!r}")
    suite.tasks = [_task(t, i, where) for i, t in enumerate(tasks or [])]
    suite.dataset = _dataset(dataset, where)
    return suite


def _task(data: Any, index: int, where: str) -> TaskKind:
    if not isinstance(data, dict):
        raise UsageError(f"{where}: task {index + 1} is not a mapping, got {data!r}")
    label = f"{where}: task {data.get('name', index + 1)!r}"
    cls = task_class(data.get("type"), label)
    task = _build(cls, {k: v for k, v in data.items() if k != "type"}, label, skip=("type",))
    task.check(label)
    return task


def _dataset(data: Any, where: str):
    if data is None or isinstance(data, (str, list)):
        if isinstance(data, list) and not all(isinstance(u, str) for u in data):
            raise UsageError(f"{where}: key 'dataset' expects a shard spec or a list of them, got {data!r}")
        return data
    if not isinstance(data, dict):
        raise UsageError(
            f"{where}: key 'dataset' expects a shard spec or a mapping with a type, got {data!r}"
        )
    kind = data.get("type")
    if kind not in DATASETS:
        raise UsageError(f"{where}: dataset key 'type' must be one of {', '.join(DATASETS)}, got {kind!r}")
    dataset = _build(
        DATASETS[kind], {k: v for k, v in data.items() if k != "type"}, f"{where}: dataset", skip=("type",)
    )
    if getattr(dataset, "caption_templates", None) is not None:
        check_templates(dataset.caption_templates, f"{where}: dataset key 'caption_templates'")
    return dataset


def _build(cls: Any, data: dict, where: str, skip: tuple = ()):
    # a task's internal keys (set by in-memory suites) are not a file's
    fields = cls.yaml_keys() if issubclass(cls, TaskKind) else {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    for key in data:
        if key not in fields:
            valid = sorted(set(fields) | set(skip))
            raise UsageError(f"{where}: unknown key {key!r} (valid: {', '.join(valid)})")
    required = [
        n
        for n, f in fields.items()
        if n not in skip and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    ]
    for name in required:
        if name not in data:
            raise UsageError(f"{where}: missing required key {name!r}")
    kwargs = {}
    for key, value in data.items():
        item = _nested(hints[key])
        if item is not None:  # a list of mappings, each its own schema (a counterfactual's edits)
            noun = item.__name__.lower()
            if not isinstance(value, list) or not value:
                raise UsageError(f"{where}: key {key!r} expects a non-empty list of {noun}s, got {value!r}")
            kwargs[key] = [
                _build(item, e, f"{where}: {noun} {i + 1}") if isinstance(e, dict) else _bad(where, key, e)
                for i, e in enumerate(value)
            ]
        elif not _fits(value, hints[key]):
            raise UsageError(f"{where}: key {key!r} expects {_type_name(hints[key])}, got {value!r}")
        else:
            kwargs[key] = value
    return cls(**kwargs)


def _nested(tp: Any) -> Any:
    """The dataclass of a ``list[SomeDataclass]`` annotation (else None)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is list and args and dataclasses.is_dataclass(args[0]):
        return args[0] if isinstance(args[0], type) else None
    return None


def _bad(where: str, key: str, value: Any):
    raise UsageError(f"{where}: key {key!r} expects a list of mappings, got an item {value!r}")


def _fits(value: Any, tp: Any) -> bool:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return any(_fits(value, a) for a in args)
    if tp is type(None):
        return value is None
    if origin is Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and (not args or all(_fits(v, args[0]) for v in value))
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp in (str, list, dict):
        return isinstance(value, tp)
    raise TypeError(f"unsupported annotation {tp!r}")


def _type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        if not args:
            return "a list"
        if typing.get_origin(args[0]) is Literal:
            return "a list of " + ", ".join(map(str, typing.get_args(args[0])))
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}.get(args[0], str(args[0]))
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, str(tp))
