"""The eval task contract and its registry.

A task kind is one typed class (a dataclass of the keys its suite YAML entry may hold) that
says what the suite's embedding pass must compute for it (:meth:`TaskKind.needs`), scores
one task (:meth:`TaskKind.run`) and picks the headline rows of its record
(:meth:`TaskKind.summary`).  Kinds register themselves with :func:`register_task` under
their ``type:``; the suite schema (:mod:`mmalign.evaluation.suite_schema`) parses a task
entry into the registered class, and :func:`mmalign.evaluation.suite.run_suite` runs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from mmalign.errors import UsageError

# a field an in-memory suite (``cb:DIR``) sets and a suite file may not: the schema skips it
INTERNAL = {"internal": True}

# what a task reads, besides the images' joint embeddings (always computed)
NEEDS = ("captions", "pre_projection", "labels")

Row = tuple[str, str, Any]  # (task, metric, value) of the printed results table


class TaskOutput(NamedTuple):
    """A task's metrics (the record's ``metrics``) and any keys added to its record."""

    metrics: dict
    extra: dict


@dataclass
class TaskContext:
    """What one suite run shares with its tasks."""

    model: Any
    preprocess: Any
    tokenizer: Any
    suite: dict  # the suite mapping (load_suite's)
    spec: dict  # its resolved dataset (datasets.dataset_spec's)
    emb: dict  # the dataset's embeddings (features.embed_dataset's)
    encode: Callable  # tokens (B, L) -> (B, D), in cache-sized pieces on a CPU
    batch_size: int
    device: str
    say: Callable[[str], None]  # a progress line (printed only with progress on)
    built: dict  # zero-shot task name -> its classifier W (D, C) when already built
    classifiers: dict = field(default_factory=dict)  # zero-shot task name -> what later tasks score


@dataclass
class TaskKind:
    """Base of every kind: ``name`` plus the kind's typed keys; optional keys default to
    ``None`` ("not given": the reader owns the default, so a suite's mapping round-trips)."""

    kind: ClassVar[str] = ""  # the suite's ``type:`` (set by register_task)
    record_task: ClassVar[str] = ""  # the record's ``task`` (clip_benchmark's name where it has one)

    name: str
    # the record's ``dataset`` instead of SUITE/NAME (a cb:DIR suite's wds/NAME, as clip_benchmark)
    record_dataset: str | None = field(default=None, kw_only=True, metadata=INTERNAL)

    @classmethod
    def yaml_keys(cls) -> dict[str, dataclasses.Field]:
        """The keys a suite file may write (``type`` aside), in declaration order."""
        return {f.name: f for f in dataclasses.fields(cls) if not f.metadata.get("internal")}

    @classmethod
    def from_dict(cls, data: dict) -> TaskKind:
        """The task of a suite mapping already checked (``type`` and unknown keys dropped)."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    def check(self, where: str) -> None:
        """Checks beyond the keys' types (one UsageError line starting with ``where``)."""

    def check_order(self, before: list[TaskKind], where: str) -> None:
        """Checks against the tasks listed before this one in its suite."""

    def needs(self) -> frozenset[str]:
        """What the suite must provide beyond the images' embeddings (names in :data:`NEEDS`)."""
        return frozenset()

    def run(self, ctx: TaskContext) -> TaskOutput:
        raise NotImplementedError(f"task kind {self.kind!r} has no run()")

    @classmethod
    def summary(cls, record: dict) -> list[Row]:
        """The record's rows in the printed results table (default: every metric)."""
        return [(record["dataset"], k, v) for k, v in record["metrics"].items()]


def given(obj: Any) -> dict:
    """The fields of a dataclass that were given (not None), nested dataclasses as mappings:
    a task as the mapping its suite file wrote."""

    def plain(v: Any) -> Any:
        if dataclasses.is_dataclass(v):
            return given(v)
        return [plain(x) for x in v] if isinstance(v, list) else v

    return {
        f.name: plain(getattr(obj, f.name))
        for f in dataclasses.fields(obj)
        if getattr(obj, f.name) is not None
    }


_KINDS: dict[str, type[TaskKind]] = {}


def register_task(kind: str):
    """Class decorator: register a :class:`TaskKind` dataclass as the suite ``type:`` ``kind``."""

    def add(cls: type[TaskKind]) -> type[TaskKind]:
        if not (isinstance(cls, type) and issubclass(cls, TaskKind) and dataclasses.is_dataclass(cls)):
            raise ValueError(f"task kind {kind!r}: {cls!r} is not a TaskKind dataclass")
        if not cls.record_task:
            raise ValueError(f"task kind {kind!r}: {cls.__name__} sets no record_task")
        if kind in _KINDS and _KINDS[kind] is not cls:
            raise ValueError(f"task kind {kind!r} is already registered ({_KINDS[kind].__name__})")
        cls.kind = kind
        _KINDS[kind] = cls
        return cls

    return add


def unregister_task(kind: str) -> None:
    _KINDS.pop(kind, None)


def registered_tasks() -> list[str]:
    """Registered kinds, in registration order."""
    return list(_KINDS)


def task_class(kind: Any, where: str = "task") -> type[TaskKind]:
    """The class registered as ``kind``; else one UsageError line naming the registered kinds."""
    if kind not in _KINDS:
        raise UsageError(f"{where}: key 'type' must be one of {', '.join(_KINDS)}, got {kind!r}")
    return _KINDS[kind]


def task_of(data: dict) -> TaskKind:
    """The typed task of one entry of a loaded suite's ``tasks``."""
    return task_class(data.get("type"), f"task {data.get('name')!r}").from_dict(data)


def record_kind(record: dict) -> type[TaskKind]:
    """The kind that wrote ``record`` (the base for a record no registered kind writes)."""
    return next((c for c in _KINDS.values() if c.record_task == record.get("task")), TaskKind)
