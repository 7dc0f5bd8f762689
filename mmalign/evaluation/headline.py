"""A run's headline results: zero-shot top-1 / top-5 and Recall@k, read from its evaluation
records (``eval.json``, clip_benchmark's metric names).

The end of ``mmalign train`` states them (:func:`announce`, with the path of ``eval.json``
so the full records are one step away) and ``mmalign report`` puts the same rows at the
top of its page (:func:`rows`). Only zero-shot classification and retrieval make the
headline; probes, diagnostics and counterfactuals stay in ``eval.json`` and the report.
"""

from __future__ import annotations

import re
from pathlib import Path

from mmalign.evaluation.caveats import note_lines

# clip_benchmark's names: image_retrieval_recall@k retrieves images for a caption (text->image)
_RECALL = re.compile(r"(image|text)_retrieval_recall@(\d+)")
_DIRECTION = {"image": "text->image", "text": "image->text"}


def rows(records: list[dict]) -> list[tuple[str, str, float | None]]:
    """(task, metric, value) headline rows, in the records' order: per zero-shot task its top-1,
    top-5 and chance top-1; per retrieval task R@k for each k it measured, text->image first."""
    out = []
    for r in records:
        metrics, name = r.get("metrics") or {}, r.get("dataset", "?")
        if r.get("task") == "zeroshot_classification":
            labels = (
                ("acc1", "zero-shot top-1"),
                ("acc5", "zero-shot top-5"),
                ("chance_acc1", "chance top-1"),
            )
            out += [(name, label, metrics[key]) for key, label in labels if key in metrics]
        elif r.get("task") == "zeroshot_retrieval":
            found = sorted(
                (m.group(1) != "image", int(m.group(2)), m.group(1), key)
                for key in metrics
                if (m := _RECALL.fullmatch(key))
            )  # text->image first, then by k
            out += [(name, f"{_DIRECTION[side]} R@{k}", metrics[key]) for _, k, side, key in found]
    return out


def percent(value: float | None) -> str:
    """``43.1%``; ``n/a`` for a metric the evaluation could not compute (NaN is stored as null)."""
    return "n/a" if value is None else f"{100 * value:.1f}%"


def lines(records: list[dict], path: str | Path) -> list[str]:
    """The headline as text lines: a title naming ``path``, then one line per task."""
    found = rows(records)
    if not found:
        return [f"results: no zero-shot or retrieval task in this suite; every metric is in {path}"]
    by_task: dict[str, list[tuple[str, str]]] = {}  # task -> [(group, "top-1 43.1%")]
    for task, metric, value in found:
        group, name = metric.rsplit(" ", 1)  # "zero-shot top-1" -> "zero-shot", "top-1"
        by_task.setdefault(task, []).append((group, f"{name} {percent(value)}"))
    out = [f"results ({path}):"]
    for task, parts in by_task.items():
        groups: dict[str, list[str]] = {}
        for group, text in parts:
            groups.setdefault(group, []).append(text)
        out.append(f"  {task}: " + "; ".join(f"{g} {', '.join(texts)}" for g, texts in groups.items()))
    return out + ["  " + line for line in note_lines(records)]


def announce(records: list[dict], path: str | Path, say) -> None:
    """Rank 0, at the end of a run: each headline line through ``say`` (the loop's printer:
    stdout and train.log)."""
    for line in lines(records, path):
        say(line)
