"""``zeroshot``: a classifier from class-name prompts, scored on the dataset's images."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mmalign.data.templates import check_templates
from mmalign.errors import UsageError
from mmalign.evaluation.slices import slice_metrics
from mmalign.evaluation.subset import class_subset
from mmalign.evaluation.tasks.base import INTERNAL, Row, TaskContext, TaskKind, TaskOutput, register_task
from mmalign.evaluation.tasks.labels import class_labels
from mmalign.evaluation.zeroshot import build_classifier, zero_shot_metrics


@register_task("zeroshot")
@dataclass
class ZeroShotTask(TaskKind):
    record_task = "zeroshot_classification"

    label_field: str  # the .json field holding the class name
    classnames: list[str]
    templates: list[str]  # prompts with {c}
    slices: list[str] | None = None  # .json fields to break the accuracy down by (default none)
    # score only the images of these classes, among these classes (held-out classes; default all)
    classes: list[str] | None = None
    # the field holds the class's index in classnames (a cb:DIR suite: clip_benchmark's .cls)
    label_index: bool | None = field(default=None, kw_only=True, metadata=INTERNAL)

    def check(self, where: str) -> None:
        check_templates(self.templates, f"{where}: key 'templates'")  # {x}, {}, a lone {, a blank one
        classes = self.classes
        if classes is not None and (
            not classes or len(set(classes)) != len(classes) or not set(classes) <= set(self.classnames)
        ):
            raise UsageError(
                f"{where}: key 'classes' must list distinct names of its classnames, got {classes!r}"
            )

    def needs(self) -> frozenset[str]:
        return frozenset({"labels"})

    def run(self, ctx: TaskContext) -> TaskOutput:
        emb, extra = ctx.emb, dict[str, Any]()
        labels = class_labels(emb["metas"], self.name, self.label_field, self.classnames, self.label_index)
        weights = ctx.built.get(self.name)  # (D, C)
        if weights is None:
            weights = build_classifier(ctx.encode, ctx.tokenizer, self.classnames, self.templates)
        ctx.classifiers[self.name] = {
            "weights": weights,
            "label_field": self.label_field,
            "classnames": self.classnames,
        }
        feats, metas = emb["image_features"], emb["metas"]
        if self.classes:  # held-out classes: their images, their columns
            rows, cols, labels = class_subset(labels, self.classnames, self.classes, self.name)
            feats, metas, weights = feats[rows], [metas[i] for i in rows], weights[:, cols]
            extra["n_images"] = len(rows)
        metrics = zero_shot_metrics(feats, weights, labels)
        metrics["chance_acc1"] = 1.0 / weights.shape[1]
        if self.slices:
            logits = 100.0 * feats @ weights  # (N, C)
            extra["slices"] = {f: slice_metrics(logits, labels, metas, f) for f in self.slices}
        return TaskOutput(metrics, extra)

    @classmethod
    def summary(cls, record: dict) -> list[Row]:
        m, name = record["metrics"], record["dataset"]
        return [(name, "acc1", m["acc1"]), (name, "chance", m["chance_acc1"])]
