"""Eval task kinds: the registry (:mod:`~mmalign.evaluation.tasks.base`) and the built-in kinds.

Importing this package registers, in this order, ``zeroshot``, ``retrieval``, ``probe``,
``diagnostics`` and ``counterfactual``; a new kind is one :func:`register_task` class
(docs/architecture.md, "Adding an eval task").
"""

from mmalign.evaluation.tasks.base import (
    NEEDS,
    Row,
    TaskContext,
    TaskKind,
    TaskOutput,
    record_kind,
    register_task,
    registered_tasks,
    task_class,
    task_of,
    unregister_task,
)

# the import order is the registration order: the order in which the kinds are listed
# isort: off
from mmalign.evaluation.tasks.zeroshot import ZeroShotTask
from mmalign.evaluation.tasks.retrieval import RetrievalTask
from mmalign.evaluation.tasks.probe import ProbeTask
from mmalign.evaluation.tasks.diagnostics import DiagnosticsTask
from mmalign.evaluation.tasks.counterfactual import CounterfactualTask, Edit
# isort: on

__all__ = [
    "NEEDS",
    "CounterfactualTask",
    "DiagnosticsTask",
    "Edit",
    "ProbeTask",
    "RetrievalTask",
    "Row",
    "TaskContext",
    "TaskKind",
    "TaskOutput",
    "ZeroShotTask",
    "record_kind",
    "register_task",
    "registered_tasks",
    "task_class",
    "task_of",
    "unregister_task",
]
