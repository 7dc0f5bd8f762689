"""Run an evaluation suite from ``eval/`` on a model and write clip_benchmark-style JSON.

The suites of ``eval/`` ship with the package (:mod:`mmalign.resources`) and are named by
their file stem; any other suite is a YAML path.  Each file is checked against
:mod:`mmalign.evaluation.suite_schema` (an unknown key, a wrong type, a missing required
key: one line naming the file and the key) before anything is embedded.

A suite YAML names a dataset (see :mod:`mmalign.evaluation.datasets`: shards, the
sklearn digits, an image folder) and a list of tasks, each of a kind registered in
:mod:`mmalign.evaluation.tasks` (its ``type:``; one module per kind):

- ``zeroshot``: ``label_field``, ``classnames``, ``templates``; optional ``slices``
  (metadata fields to break the accuracy down by) and ``classes`` (only the images of
  these classes, scored among them: :mod:`mmalign.evaluation.subset`);
- ``retrieval``: ``ks``;
- ``probe``: ``label_field``, ``classnames``, ``features`` (``joint`` or
  ``pre_projection``) and the options of :func:`mmalign.evaluation.probes.run_probes`;
- ``diagnostics``: embedding geometry (:mod:`mmalign.evaluation.diagnostics`);
- ``counterfactual``: ``edits`` (hflip, crop, rerender), ``tasks`` (zeroshot task
  names, default all), ``limit`` images (default 256).

``extends: NAME`` starts from another suite's dataset and tasks and appends its own.

``cb:DIR`` names no file: it is the clip_benchmark WebDataset dataset in folder DIR
(:mod:`mmalign.evaluation.cb_wds` builds its suite in memory: one zeroshot task whose
labels are class indices, ``label_index: true``, or one retrieval task; either names its
record with ``record_dataset``, ``wds/NAME`` as clip_benchmark does).

Embeddings are computed once per suite and shared by its tasks; the dataset's captions
are embedded only when a retrieval or diagnostics task reads them (zero-shot embeds its
class prompts, never the dataset's captions).  ``template_captions: true`` says that the
dataset's captions are class templates (cifar10's shards); the digits and image-folder
datasets caption from templates by construction.  Retrieval on such captions measures
only chance within a class, and the report says so.  Each task gives one
record ``{"dataset", "model", "pretrained", "task", "metrics", "language", ...}``
with clip_benchmark's metric names where clip_benchmark has the metric.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import yaml

from mmalign import resources
from mmalign.config import ConfigError
from mmalign.data.shards import check_urls, expand_urls
from mmalign.errors import UsageError
from mmalign.evaluation.datasets import dataset_spec, iter_dataset
from mmalign.evaluation.features import embed_dataset, text_encoder
from mmalign.evaluation.suite_schema import parse_suite
from mmalign.evaluation.tasks import Row, TaskContext, TaskKind, ZeroShotTask, record_kind, task_of
from mmalign.progress import track


def load_suite(name_or_path: str, cb_split: str = "test") -> dict:
    """A suite (a YAML path, else the name of a shipped suite) checked against
    :mod:`~mmalign.evaluation.suite_schema`, as the mapping :func:`run_suite` reads; ``cb:DIR``
    is the clip_benchmark dataset in DIR, its split folder ``cb_split``."""
    from mmalign.evaluation.cb_wds import PREFIX, cb_suite, is_cb

    if is_cb(name_or_path):
        return cb_suite(name_or_path[len(PREFIX) :], cb_split)
    path = Path(name_or_path)
    shipped = not path.is_file()
    if shipped:
        found = resources.shipped(resources.SUITES, str(name_or_path))
        if found is None:
            known = resources.names(resources.SUITES)
            raise ConfigError(
                f"config key 'eval.suite': unknown suite {name_or_path!r} (known: {', '.join(known)})"
            )
        path = found
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"suite {path}: not valid YAML: {str(e).splitlines()[0]}") from None
    suite = parse_suite(raw, str(path)).to_dict()
    if "dataset" in suite:
        suite["dataset"] = _resolve_dataset(suite["dataset"], _roots(path, shipped))
    if suite.get("extends"):  # the base suite's dataset and tasks, then this suite's tasks
        # a sibling file of that name, else a path, else a shipped suite's name
        sibling = path.parent / f"{suite['extends']}.yaml"
        base = load_suite(str(sibling) if sibling.is_file() else suite["extends"])
        suite = {**base, **suite, "tasks": base.get("tasks", []) + suite.get("tasks", [])}
    _check_task_order(suite, path)
    return suite


def _roots(path: Path, shipped: bool) -> tuple[Path, ...]:
    """Where a suite's relative data paths may lie: its own folder, then the working directory.
    A shipped suite's paths are written relative to the repository's ``eval/``; installed,
    that folder is inside the package, so they also resolve against ``./eval`` (the
    working directory as a checkout root: ``../data/x`` is ``./data/x``)."""
    own = path.resolve().parent
    return (own, Path.cwd() / "eval", Path.cwd()) if shipped else (own, Path.cwd())


def _check_task_order(suite: dict, path: Path) -> None:
    """Each task's checks against those listed before it (after ``extends``: the base's first)."""
    before: list[TaskKind] = []
    for entry in suite["tasks"]:
        task = task_of(entry)
        task.check_order(before, f"suite {path}")
        before.append(task)


def label_field(suite: dict) -> str:
    """The suite's first zero-shot label field (what its accuracy is over; samples are drawn stratified by it)."""
    return next((t["label_field"] for t in suite.get("tasks", []) if t["type"] == ZeroShotTask.kind), "label")


def _resolve_dataset(dataset, roots: tuple[Path, ...]):
    """The dataset entry with its relative paths resolved: against the suite file's folder
    when the files are there, else against the working directory, else left as written
    (``--data`` / ``data.val`` may replace them; a missing one is reported when used)."""
    if isinstance(dataset, (str, list)):
        return _resolve_spec(dataset, roots)
    if isinstance(dataset, dict):
        dataset = dict(dataset)
        for key in ("urls", "path"):
            if isinstance(dataset.get(key), (str, list)):
                dataset[key] = _resolve_spec(dataset[key], roots)
    return dataset


def _resolve_spec(spec, roots: tuple[Path, ...]):
    if isinstance(spec, list):
        return [_resolve_spec(s, roots) for s in spec]
    return "::".join(_resolve_path(part.strip(), roots) for part in str(spec).split("::"))


def _resolve_path(path: str, roots: tuple[Path, ...]) -> str:
    if not path or "://" in path or Path(path).is_absolute():
        return path
    for root in roots:
        candidate = os.path.normpath(root / path)  # braces survive normpath
        urls = expand_urls(candidate)
        if urls and all(Path(u).exists() for u in urls):
            return candidate
    return path


def check_suite_data(suite: dict, data: str | None = None, *, user_data: str | None = None) -> dict:
    """The suite's dataset mapping (``data`` replacing a shards dataset's urls) with its files
    checked: a one-line ConfigError now rather than after a training run."""
    spec = dataset_spec(suite, data, user_data=user_data)
    if spec["type"] == "shards":
        check_urls(expand_urls(spec["urls"]), "--data" if user_data else "data.val" if data else "eval.suite")
    elif spec["type"] == "cb_wds":
        missing = [u for u in spec["urls"] if not Path(u).is_file()]
        if missing:
            raise UsageError(f"clip_benchmark dataset {spec.get('root')}: shard {missing[0]} not found")
    elif spec["type"] == "imagefolder" and not Path(str(spec.get("path", ""))).exists():
        if user_data is not None:
            raise ConfigError(f"--data: image folder {user_data!r} not found")
        raise ConfigError(
            f"config key 'eval.suite': suite {suite.get('name')!r}: image folder "
            f"{spec.get('path')!r} not found (relative paths resolve against the suite file's "
            f"folder, then the working directory; --data replaces it)"
        )
    return spec


def _clean(value):
    """NaN -> None (JSON has no NaN), recursively."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def embedding_needs(tasks: list[dict]) -> tuple[bool, bool]:
    """(pre-projection features, the dataset's captions): what the suite's tasks read."""
    needs = frozenset().union(*(task_of(t).needs() for t in tasks))
    return "pre_projection" in needs, "captions" in needs


def embedding_total(spec: dict) -> int | None:
    """How many samples the embedding pass over ``spec`` reads, where known before reading, for
    the progress counter's total and ETA: shards listed in their folders' ``sizes.json``
    (written by the shard builders), capped by ``limit``; else the ``limit``; else None."""
    from mmalign.data.shards import shard_total

    limit = int(spec["limit"]) if spec.get("limit") else None
    known = None
    if spec.get("type") == "shards" and spec.get("per_class") is None:  # per_class drops an unknown share
        counts = [shard_total(url) for url in expand_urls(spec["urls"])]
        listed = [c for c in counts if c is not None]
        known = sum(listed) if counts and len(listed) == len(counts) else None
    if known is None:
        return limit
    return known if limit is None else min(known, limit)


def embed_suite(
    model,
    preprocess,
    tokenizer,
    suite: dict,
    spec: dict,
    *,
    batch_size: int = 256,
    device: str = "cpu",
    progress: bool = False,
    label: str | None = None,
) -> dict:
    """The embeddings of ``spec`` (the suite's resolved dataset) that the suite's tasks read
    (:func:`embedding_needs`), the pass shown as ``label`` (default ``eval NAME``)."""
    pre_projection, captions = embedding_needs(suite["tasks"])
    samples = track(
        iter_dataset(spec),
        f"{label or 'eval ' + suite['name']}: embedding",
        unit="images",
        total=embedding_total(spec),
        enabled=progress,
    )
    return embed_dataset(
        model, preprocess, tokenizer, samples, batch_size, device, pre_projection, captions=captions
    )


def run_suite(
    model,
    preprocess,
    tokenizer,
    suite: dict,
    data: str | None = None,
    *,
    batch_size: int = 256,
    device: str = "cpu",
    model_name: str = "mmalign",
    progress: bool = False,
    user_data: str | None = None,
    embedded: dict | None = None,
    built: dict | None = None,
) -> list[dict]:
    """Evaluate every task of ``suite``; one clip_benchmark-style record per task.

    ``data`` (a shard spec) replaces the suite's shard dataset, e.g. the run's data.val;
    ``user_data`` (``--data``) replaces its shards or its image folder (see ``dataset_spec``).
    ``progress``: show the embedding pass and each task (a bar on a terminal, else lines).
    ``embedded``: the dataset's embeddings (:func:`embed_dataset`'s result) when already
    computed, e.g. sharded over ranks (:mod:`mmalign.evaluation.sharded`); ``built``:
    zero-shot task name -> its classifier W (D, C) when already built (the same module).
    """
    spec = dataset_spec(suite, data, user_data=user_data)
    tasks = suite["tasks"]

    def say(line: str) -> None:
        if progress:
            print(f"mmalign: eval {suite['name']}: {line}", flush=True)

    was_training = model.training
    model.eval()
    try:
        emb = (
            embedded
            if embedded is not None
            else embed_suite(
                model,
                preprocess,
                tokenizer,
                suite,
                spec,
                batch_size=batch_size,
                device=device,
                progress=progress,
            )
        )
        ctx = TaskContext(
            model=model,
            preprocess=preprocess,
            tokenizer=tokenizer,
            suite=suite,
            spec=spec,
            emb=emb,
            encode=text_encoder(model, device),  # (B, L) -> (B, D), in cache-sized pieces on a CPU
            batch_size=batch_size,
            device=device,
            say=say,
            built=built or {},
        )
        records = []
        for entry in tasks:
            say(f"task {entry['name']} ({entry['type']})")
            task = task_of(entry)
            metrics, extra = task.run(ctx)
            records.append(
                {
                    # a cb:DIR suite's task names its record as clip_benchmark does (wds/NAME)
                    "dataset": task.record_dataset or f"{suite['name']}/{task.name}",
                    "model": model_name,
                    "pretrained": None,
                    "task": task.record_task,
                    "metrics": _clean(metrics),
                    "language": "en",
                    "n_images": len(emb["keys"]),
                    "n_captions": len(emb["text_to_image"]),
                    **_clean(extra),
                }
            )
        return records
    finally:
        model.train(was_training)


def write_results(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2))
    return path


def summary_rows(records: list[dict]) -> list[Row]:
    """(task, metric, value) rows for the headline numbers: each record's kind picks its own."""
    return [row for r in records for row in record_kind(r).summary(r)]
