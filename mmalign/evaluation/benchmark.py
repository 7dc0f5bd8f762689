"""Benchmarks: many evaluation tasks run together, one main metric each, and their average.

A benchmark is a list of tasks, each a suite (``cb:DIR``, a shipped suite's name, a suite
YAML) and the main metric to report for it:

- ``datacomp``: DataComp's tasks (:mod:`mmalign.evaluation.datacomp`), each present when its
  clip_benchmark dataset lies under ``--root``; the absent ones are listed, and the average
  over the present ones is marked partial.
- a YAML file holding a list whose items are a suite (a string) or a mapping
  ``{suite: S, main_metric: M}``.  A ``cb:DIR`` whose folder does not exist is absent (a
  relative DIR is looked up under ``--root``, the YAML's folder, then the working
  directory); a suite that cannot be loaded is an error.  Each record of a suite is a row;
  its main metric defaults to ``acc1`` for zero-shot classification and ``mean_recall@1``
  (DataComp's: the mean of text->image and image->text Recall@1) for retrieval, and other
  tasks (probes, diagnostics) are written but not scored.

:func:`run_benchmark` embeds each dataset once (:func:`~mmalign.evaluation.features.embed_dataset`),
runs the suite's tasks on those embeddings through :func:`~mmalign.evaluation.suite.run_suite`
and, for the main metrics that need predictions (:data:`~mmalign.evaluation.datacomp.PREDICTION_METRICS`),
scores the same logits the zero-shot task scored.  :func:`summary` is what ``summary.json`` holds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from mmalign.errors import UsageError
from mmalign.evaluation import datacomp
from mmalign.evaluation.cb_wds import PREFIX, cb_suite, is_cb
from mmalign.evaluation.suite import load_suite

SHIPPED = {
    "datacomp": "DataComp's 40 evaluation tasks (38 scored), from clip_benchmark datasets under --root"
}
DEFAULT_MAIN = {"zeroshot_classification": "acc1", "zeroshot_retrieval": "mean_recall@1"}


@dataclass
class Task:
    """One benchmark entry; ``status`` is present, absent, unsupported or not_scored."""

    key: str  # DataComp's task key, or the YAML entry as written
    name: str  # for the table
    main_metric: str | None  # None: the record kind's default (DEFAULT_MAIN)
    status: str
    suite: dict | None = None  # the loaded suite, when present
    kind: str | None = None  # the cb task the benchmark expects (classification / retrieval), if any
    note: str = ""  # what differs from the benchmark's own definition
    folder: str | None = None
    rows: list[dict] = field(default_factory=list)  # filled by run_benchmark

    def loaded(self) -> dict:
        """The suite of a present task (load_benchmark loads every present one)."""
        if self.suite is None:
            raise ValueError(f"benchmark task {self.key} is {self.status}: it has no suite")
        return self.suite


def load_benchmark(name_or_path: str, root: str | None, split: str = "test") -> tuple[str, list[Task]]:
    """(benchmark name, tasks) with every present task's suite loaded (one-line errors before any embedding)."""
    if name_or_path in SHIPPED:
        if not root:
            raise UsageError(
                f"--benchmark {name_or_path} needs --root DIR, the folder holding its "
                f"clip_benchmark datasets (wds_NAME/)"
            )
        if not Path(root).is_dir():
            raise UsageError(f"--root: no such folder: {root}")
        return name_or_path, _datacomp_tasks(Path(root), split)
    path = Path(name_or_path)
    if not path.is_file():
        raise UsageError(
            f"--benchmark: {name_or_path!r} is neither a shipped benchmark "
            f"({', '.join(SHIPPED)}) nor a YAML file"
        )
    if root and not Path(root).is_dir():
        raise UsageError(f"--root: no such folder: {root}")
    return path.stem, _yaml_tasks(path, Path(root) if root else None, split)


def _datacomp_tasks(root: Path, split: str) -> list[Task]:
    tasks = []
    for key, name, metric in datacomp.TASKS:
        found = next((root / f for f in datacomp.folders(key) if (root / f).is_dir()), None)
        if key in datacomp.UNSUPPORTED:
            tasks.append(Task(key, name, metric, "unsupported", note=datacomp.UNSUPPORTED[key]))
            continue
        if key in datacomp.NOT_SCORED:  # present or not, it never counts: not run
            tasks.append(
                Task(
                    key,
                    name,
                    None,
                    "not_scored",
                    folder=str(found) if found else None,
                    note="DataComp scores no main metric for it (group accuracies only)",
                )
            )
            continue
        if found is None:
            tasks.append(
                Task(key, name, metric, "absent", note=f"looked for {', '.join(datacomp.folders(key))}")
            )
            continue
        kind = "retrieval" if key in datacomp.RETRIEVAL else "classification"
        suite = cb_suite(found, split, name=f"wds/{datacomp.cb_name(key)}")
        if suite["dataset"]["task"] != kind:
            raise UsageError(
                f"--benchmark datacomp: {found} holds a {suite['dataset']['task']} dataset; "
                f"DataComp's {key} is {kind}"
            )
        tasks.append(Task(key, name, metric, "present", suite, kind, datacomp.source_note(key), str(found)))
    return tasks


def _yaml_tasks(path: Path, root: Path | None, split: str) -> list[Task]:
    try:
        items = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"benchmark {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(items, list) or not items:
        raise UsageError(
            f"benchmark {path}: must be a non-empty YAML list of suites (cb:DIR, a suite name or YAML)"
        )
    tasks = []
    for i, item in enumerate(items):
        if isinstance(item, dict):
            unknown = set(item) - {"suite", "main_metric"}
            if unknown or not isinstance(item.get("suite"), str):
                raise UsageError(
                    f"benchmark {path}: item {i}: a mapping needs 'suite' (a string) and may give "
                    f"'main_metric'{f'; unknown keys {sorted(unknown)}' if unknown else ''}"
                )
            entry, metric = item["suite"], item.get("main_metric")
        elif isinstance(item, str):
            entry, metric = item, None
        else:
            raise UsageError(
                f"benchmark {path}: item {i} is {item!r}: give a suite name, a YAML path or cb:DIR"
            )
        if metric is not None and not isinstance(metric, str):
            raise UsageError(f"benchmark {path}: item {i}: main_metric must be a metric name")
        if is_cb(entry):
            folder = _cb_folder(entry[len(PREFIX) :], path.parent, root)
            if folder is None:
                tasks.append(Task(entry, entry, metric, "absent", note="no such folder"))
                continue
            tasks.append(Task(entry, entry, metric, "present", cb_suite(folder, split), folder=str(folder)))
        else:
            sibling = path.parent / entry
            suite = load_suite(str(sibling) if sibling.is_file() else entry)  # beside the YAML, else anywhere
            tasks.append(Task(entry, entry, metric, "present", suite))
    return tasks


def _cb_folder(spec: str, here: Path, root: Path | None) -> Path | None:
    given = Path(spec)
    if given.is_absolute():
        return given if given.is_dir() else None
    for base in ([root] if root else []) + [here, Path.cwd()]:
        if (base / given).is_dir():
            return base / given
    return None


def _main_value(record: dict, metric: str | None) -> tuple[str | None, float | None, str]:
    """(metric, value, note) of a record's main metric that the record itself holds (or mean_recall@1)."""
    metric = metric or DEFAULT_MAIN.get(record["task"])
    if metric is None:
        return None, None, f"{record['task']}: no main metric"
    m = record["metrics"]
    if metric == "mean_recall@1" and "text_retrieval_recall@1" in m:
        return metric, 0.5 * (m["text_retrieval_recall@1"] + m["image_retrieval_recall@1"]), ""
    value = m.get(metric)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return metric, None, f"{metric} is not defined here" if metric in m else f"the record has no {metric}"
    return metric, float(value), ""


def run_benchmark(
    model,
    preprocess,
    tokenizer,
    tasks: list[Task],
    *,
    batch_size: int = 256,
    device: str = "cpu",
    pretrained: str | None = None,
    progress: bool = False,
) -> None:
    """Evaluate every present task; fills each task's ``rows``: one per record, ``{"record" (clip_benchmark's
    for a cb suite, else run_suite's), "kind", "dataset", "main_metric", "value", "note"}``."""
    import torch

    from mmalign.evaluation.cb_wds import cb_record
    from mmalign.evaluation.datasets import dataset_spec
    from mmalign.evaluation.features import text_encoder
    from mmalign.evaluation.suite import embed_suite, run_suite
    from mmalign.evaluation.zeroshot import build_classifier

    was_training = model.training
    model.eval()
    try:
        for task in (t for t in tasks if t.status == "present"):
            suite = task.loaded()
            emb = embed_suite(
                model,
                preprocess,
                tokenizer,
                suite,
                dataset_spec(suite),
                batch_size=batch_size,
                device=device,
                progress=progress,
                label=f"benchmark {task.key}",
            )
            encode = text_encoder(model, device)  # (B, L) -> (B, D), in cache-sized pieces on a CPU
            built = {
                t["name"]: build_classifier(encode, tokenizer, t["classnames"], t["templates"])  # (D, C)
                for t in suite["tasks"]
                if t["type"] == "zeroshot"
            }  # once: the tasks and the metrics share it
            records = run_suite(
                model,
                preprocess,
                tokenizer,
                suite,
                batch_size=batch_size,
                device=device,
                model_name="mmalign",
                embedded=emb,
                built=built,
            )
            for spec_task, record in zip(suite["tasks"], records):
                metric, value, note = _main_value(record, task.main_metric)
                if (
                    metric in datacomp.PREDICTION_METRICS
                    and spec_task["type"] == "zeroshot"
                    and "cb" in suite
                ):
                    # the logits the zero-shot task scored: same classifier, same embeddings
                    logits = 100.0 * emb["image_features"] @ built[spec_task["name"]]  # (N, C)
                    labels = torch.tensor([m["label"] for m in emb["metas"]])  # (N,)
                    metric, value, note = datacomp.prediction_metric(metric, logits, labels, emb["metas"])
                row_note = "; ".join(n for n in (task.note, note) if n)
                out = cb_record(record, suite, pretrained=pretrained) if "cb" in suite else record
                task.rows.append(
                    {
                        "record": out,
                        "kind": record["task"],
                        "dataset": record["dataset"],
                        "main_metric": metric,
                        "value": value,
                        "note": row_note,
                    }
                )
    finally:
        model.train(was_training)


def summary(name: str, tasks: list[Task], **extra) -> dict:
    """The benchmark's summary: rows, the average of the main metrics over the rows that have
    one, the task lists by status and ``partial`` (some task of the benchmark did not count)."""
    rows = [
        {"task": t.key, "name": t.name, "folder": t.folder, **{k: v for k, v in r.items() if k != "record"}}
        for t in tasks
        for r in t.rows
    ]
    scored = [r["value"] for r in rows if r["value"] is not None]
    by_status = {
        s: [t.key for t in tasks if t.status == s] for s in ("present", "absent", "unsupported", "not_scored")
    }
    # a row whose main metric has no value here (acc5 under 5 classes) is missing from the
    # average as an absent task is; a row without a main metric (a probe) never counted
    undefined = [r["dataset"] for r in rows if r["main_metric"] is not None and r["value"] is None]
    partial = bool(by_status["absent"] or by_status["unsupported"] or undefined)
    return {
        "benchmark": name,
        **extra,
        "tasks": rows,
        "average": sum(scored) / len(scored) if scored else None,
        "average_over": len(scored),
        **by_status,
        "undefined": undefined,
        "partial": partial,
        "notes": {t.key: t.note for t in tasks if t.note and t.status != "present"},
    }
