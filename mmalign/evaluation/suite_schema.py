"""The typed form of a suite YAML: one dataclass per task kind, per dataset kind, per edit.

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

FEATURES = Literal["joint", "pre_projection"]  # = mmalign.evaluation.features.FEATURE_KINDS
PROBE_METHODS = Literal["linear", "knn", "fewshot"]


# ------------------------------------------------------------------ tasks


@dataclass
class ZeroShotTask:
    kind: ClassVar[str] = "zeroshot"
    name: str
    label_field: str  # the .json field holding the class name
    classnames: list[str]
    templates: list[str]  # prompts with {c}
    slices: list[str] | None = None  # .json fields to break the accuracy down by (default none)
    # score only the images of these classes, among these classes (held-out classes; default all)
    classes: list[str] | None = None


@dataclass
class RetrievalTask:
    kind: ClassVar[str] = "retrieval"
    name: str
    ks: list[int] | None = None  # default [1, 5, 10]


@dataclass
class ProbeTask:
    """Options as :func:`mmalign.evaluation.probes.run_probes` reads them (its defaults)."""

    kind: ClassVar[str] = "probe"
    name: str
    label_field: str
    classnames: list[str]
    features: FEATURES | None = None  # default joint
    methods: list[PROBE_METHODS] | None = None  # default all three
    Cs: list[float] | None = None  # the linear probe's C grid
    knn_k: list[int] | None = None  # default [1, 5, 20]
    shots: list[int] | None = None  # default [1, 5]
    episodes: int | None = None  # default 5
    seed: int | None = None  # default 0
    test_fraction: float | None = None  # default 0.3
    val_fraction: float | None = None  # default 0.2


@dataclass
class DiagnosticsTask:
    kind: ClassVar[str] = "diagnostics"
    name: str
    seed: int | None = None  # default 0


@dataclass
class Edit:
    """One counterfactual edit (:mod:`mmalign.evaluation.counterfactual`)."""

    name: Literal["hflip", "crop", "rerender"]
    scale: float | None = None  # crop: default 0.9
    field: str | None = None  # rerender: the attribute changed, default colour
    label: str | None = None  # the metric prefix, default the edit's name


@dataclass
class CounterfactualTask:
    kind: ClassVar[str] = "counterfactual"
    name: str
    edits: list[Edit]
    tasks: list[str] | None = None  # zero-shot tasks listed before this one (default all of them)
    limit: int | None = None  # images, default 256
    seed: int | None = None  # default 0


TASKS = {
    cls.kind: cls for cls in (ZeroShotTask, RetrievalTask, ProbeTask, DiagnosticsTask, CounterfactualTask)
}


# --------------------------------------------------------------- datasets
# (defaults: mmalign.evaluation.datasets; ``limit`` and ``stratify`` are set by ``--limit`` too)


@dataclass
class ShardsDataset:
    kind: ClassVar[str] = "shards"
    urls: str | list | None = None  # a shard spec; --data or the run's data.val may give it instead
    limit: int | None = None
    seed: int | None = None
    stratify: str | None = None
    per_class: int | None = None


@dataclass
class DigitsDataset:
    kind: ClassVar[str] = "digits"
    size: int | None = None  # pixels, default 32
    caption_templates: list[str] | None = None
    limit: int | None = None
    seed: int | None = None
    stratify: str | None = None
    per_class: int | None = None


@dataclass
class ImageFolderDataset:
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
        out = _given(self)
        out["tasks"] = [{"type": t.kind, **_given(t)} for t in self.tasks]
        if dataclasses.is_dataclass(self.dataset):
            out["dataset"] = {"type": self.dataset.kind, **_given(self.dataset)}
        return out


def _given(obj) -> dict:
    """The fields of a dataclass that were given (not None), nested dataclasses as mappings."""

    def plain(v):
        if dataclasses.is_dataclass(v):
            return _given(v)
        return [plain(x) for x in v] if isinstance(v, list) else v

    return {
        f.name: plain(getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if getattr(obj, f.name) is not None
    }


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


def _task(data: Any, index: int, where: str):
    if not isinstance(data, dict):
        raise UsageError(f"{where}: task {index + 1} is not a mapping, got {data!r}")
    label = f"{where}: task {data.get('name', index + 1)!r}"
    kind = data.get("type")
    if kind not in TASKS:
        raise UsageError(f"{label}: key 'type' must be one of {', '.join(TASKS)}, got {kind!r}")
    task = _build(TASKS[kind], {k: v for k, v in data.items() if k != "type"}, label, skip=("type",))
    if kind == "zeroshot":
        check_templates(task.templates, f"{label}: key 'templates'")  # {x}, {}, a lone {, a blank one
    if kind == "zeroshot" and task.classes is not None:
        classes = task.classes
        if not classes or len(set(classes)) != len(classes) or not set(classes) <= set(task.classnames):
            raise UsageError(
                f"{label}: key 'classes' must list distinct names of its classnames, got {classes!r}"
            )
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


def _build(cls: type, data: dict, where: str, skip: tuple = ()):
    fields = {f.name: f for f in dataclasses.fields(cls)}
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
        if hints[key] == list[Edit]:  # the one nested schema
            if not isinstance(value, list) or not value:
                raise UsageError(f"{where}: key {key!r} expects a non-empty list of edits, got {value!r}")
            kwargs[key] = [
                _build(Edit, e, f"{where}: edit {i + 1}") if isinstance(e, dict) else _bad(where, key, e)
                for i, e in enumerate(value)
            ]
        elif not _fits(value, hints[key]):
            raise UsageError(f"{where}: key {key!r} expects {_type_name(hints[key])}, got {value!r}")
        else:
            kwargs[key] = value
    return cls(**kwargs)


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
