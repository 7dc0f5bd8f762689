"""``retrieval``: text->image and image->text Recall@k over the dataset's captions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mmalign.errors import ConfigError
from mmalign.evaluation.caveats import captions_are_templates, looks_templated
from mmalign.evaluation.retrieval import recall_at_k
from mmalign.evaluation.tasks.base import Row, TaskContext, TaskKind, TaskOutput, register_task


@register_task("retrieval")
@dataclass
class RetrievalTask(TaskKind):
    record_task = "zeroshot_retrieval"

    ks: list[int] | None = None  # default [1, 5, 10]

    def needs(self) -> frozenset[str]:
        return frozenset({"captions"})

    def run(self, ctx: TaskContext) -> TaskOutput:
        emb, extra = ctx.emb, dict[str, Any]()
        if len(emb["text_to_image"]) == 0:
            raise ConfigError(f"task {self.name!r}: the dataset has no captions to retrieve")
        metrics = recall_at_k(
            emb["image_features"],
            emb["text_features"],
            emb["text_to_image"],
            ks=[1, 5, 10] if self.ks is None else self.ks,
        )
        if captions_are_templates(ctx.suite) or looks_templated(emb.get("captions", []), len(emb["keys"])):
            extra["template_captions"] = True  # printed with TEMPLATE_CAVEAT wherever R@k is
        return TaskOutput(metrics, extra)

    @classmethod
    def summary(cls, record: dict) -> list[Row]:
        m, name, rows = record["metrics"], record["dataset"], []
        for k in (1, 5):
            rows.append((name, f"text->image R@{k}", m.get(f"image_retrieval_recall@{k}")))
            rows.append((name, f"image->text R@{k}", m.get(f"text_retrieval_recall@{k}")))
        rows.append((name, "chance R@5", 5 / record["n_images"]))
        return rows
