"""``probe``: linear, kNN and few-shot probes on frozen image features (:mod:`~mmalign.evaluation.probes`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from mmalign.evaluation import probes
from mmalign.evaluation.features import FEATURE_KINDS
from mmalign.evaluation.tasks.base import (
    INTERNAL,
    Row,
    TaskContext,
    TaskKind,
    TaskOutput,
    given,
    register_task,
)
from mmalign.evaluation.tasks.labels import class_labels

FEATURES = Literal["joint", "pre_projection"]  # = mmalign.evaluation.features.FEATURE_KINDS
PROBE_METHODS = Literal["linear", "knn", "fewshot"]


@register_task("probe")
@dataclass
class ProbeTask(TaskKind):
    """Options as :func:`mmalign.evaluation.probes.run_probes` reads them (its defaults)."""

    record_task = "linear_probe"

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
    label_index: bool | None = field(default=None, kw_only=True, metadata=INTERNAL)  # as zeroshot's

    def needs(self) -> frozenset[str]:
        return frozenset({"labels", "pre_projection"} if self.features == "pre_projection" else {"labels"})

    def run(self, ctx: TaskContext) -> TaskOutput:
        kind = self.features or "joint"
        emb = ctx.emb
        feats = emb["image_pre_projection"] if kind == "pre_projection" else emb["image_features"]
        labels = class_labels(emb["metas"], self.name, self.label_field, self.classnames, self.label_index)
        metrics = probes.run_probes(feats, labels, len(self.classnames), given(self), say=ctx.say)
        metrics["chance_acc1"] = 1.0 / len(self.classnames)
        return TaskOutput(metrics, {"features": kind, "features_description": FEATURE_KINDS[kind]})

    @classmethod
    def summary(cls, record: dict) -> list[Row]:  # linear, kNN, few-shot and chance top-1
        name = f"{record['dataset']} ({record['features']})"
        return [(name, k, v) for k, v in record["metrics"].items() if k.endswith("_acc1")]
