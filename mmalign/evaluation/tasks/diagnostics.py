"""``diagnostics``: the geometry of the paired embeddings (:mod:`~mmalign.evaluation.diagnostics`)."""

from __future__ import annotations

from dataclasses import dataclass

from mmalign.evaluation.diagnostics import embedding_diagnostics
from mmalign.evaluation.tasks.base import Row, TaskContext, TaskKind, TaskOutput, register_task

HEADLINE = (
    "alignment",
    "uniformity_image",
    "effective_rank_image",
    "modality_gap",
    "nn_diversity_image",
    "positive_negative_auc",
)


@register_task("diagnostics")
@dataclass
class DiagnosticsTask(TaskKind):
    record_task = "embedding_diagnostics"

    seed: int | None = None  # default 0

    def needs(self) -> frozenset[str]:
        return frozenset({"captions"})

    def run(self, ctx: TaskContext) -> TaskOutput:
        emb = ctx.emb
        metrics = embedding_diagnostics(
            emb["image_features"], emb["text_features"], emb["text_to_image"], seed=int(self.seed or 0)
        )
        return TaskOutput(metrics, {})

    @classmethod
    def summary(cls, record: dict) -> list[Row]:
        return [(record["dataset"], k, record["metrics"].get(k)) for k in HEADLINE]
