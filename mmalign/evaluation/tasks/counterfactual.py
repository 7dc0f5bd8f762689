"""``counterfactual``: edited images scored by the zero-shot classifiers listed before it
(:mod:`~mmalign.evaluation.counterfactual`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from mmalign.errors import ConfigError, UsageError
from mmalign.evaluation.counterfactual import run_counterfactuals
from mmalign.evaluation.datasets import iter_dataset
from mmalign.evaluation.tasks.base import Row, TaskContext, TaskKind, TaskOutput, given, register_task
from mmalign.evaluation.tasks.zeroshot import ZeroShotTask


@dataclass
class Edit:
    """One counterfactual edit."""

    name: Literal["hflip", "crop", "rerender"]
    scale: float | None = None  # crop: default 0.9
    field: str | None = None  # rerender: the attribute changed, default colour
    label: str | None = None  # the metric prefix, default the edit's name


@register_task("counterfactual")
@dataclass
class CounterfactualTask(TaskKind):
    record_task = "counterfactual"

    edits: list[Edit]
    tasks: list[str] | None = None  # zero-shot tasks listed before this one (default all of them)
    limit: int | None = None  # images, default 256
    seed: int | None = None  # default 0

    @classmethod
    def from_dict(cls, data: dict) -> CounterfactualTask:
        task = super().from_dict(data)
        assert isinstance(task, CounterfactualTask)
        task.edits = [e if isinstance(e, Edit) else Edit(**e) for e in task.edits]
        return task

    def check_order(self, before: list[TaskKind], where: str) -> None:
        seen = [t.name for t in before if isinstance(t, ZeroShotTask)]  # their classifiers are scored
        missing = [n for n in self.tasks or [] if n not in seen]
        if missing:
            raise UsageError(
                f"{where}: task {self.name!r}: key 'tasks' names {missing}, "
                f"which are not zeroshot tasks listed before it"
            )

    def run(self, ctx: TaskContext) -> TaskOutput:
        classifiers, spec = ctx.classifiers, ctx.spec
        names = list(classifiers) if self.tasks is None else self.tasks
        missing = [n for n in names if n not in classifiers]
        if missing:
            raise ConfigError(
                f"task {self.name!r}: counterfactual tasks {missing} must be zeroshot tasks listed before it"
            )
        limit = 256 if self.limit is None else int(self.limit)
        samples = list(iter_dataset(dict(spec, limit=min(limit, int(spec.get("limit") or limit)))))
        metrics, expected = run_counterfactuals(
            ctx.model,
            ctx.preprocess,
            samples,
            [given(e) for e in self.edits],
            {n: classifiers[n] for n in names},
            ctx.batch_size,
            ctx.device,
            int(self.seed or 0),
        )
        return TaskOutput(metrics, {"expected": expected})

    @classmethod
    def summary(cls, record: dict) -> list[Row]:
        m = record["metrics"]
        return [(record["dataset"], k, v) for k, v in m.items() if k.endswith(("_cosine_mean", "_flip_rate"))]
