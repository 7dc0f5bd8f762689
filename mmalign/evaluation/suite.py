"""Run an evaluation suite from ``eval/`` on a model and write clip_benchmark-style JSON.

The suites of ``eval/`` ship with the package (:mod:`mmalign.resources`) and are named by
their file stem; any other suite is a YAML path.  Each file is checked against
:mod:`mmalign.evaluation.suite_schema` (an unknown key, a wrong type, a missing required
key: one line naming the file and the key) before anything is embedded.

A suite YAML names a dataset (see :mod:`mmalign.evaluation.datasets`: shards, the
sklearn digits, an image folder) and a list of tasks:

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

import torch
import yaml

from mmalign import resources
from mmalign.config import ConfigError
from mmalign.data.shards import check_urls, expand_urls
from mmalign.errors import UsageError
from mmalign.evaluation import counterfactual, diagnostics, probes
from mmalign.evaluation.caveats import looks_templated
from mmalign.evaluation.datasets import dataset_spec, iter_dataset
from mmalign.evaluation.features import FEATURE_KINDS, embed_dataset, text_encoder
from mmalign.evaluation.retrieval import recall_at_k
from mmalign.evaluation.slices import slice_metrics
from mmalign.evaluation.subset import class_subset
from mmalign.evaluation.suite_schema import parse_suite
from mmalign.evaluation.zeroshot import build_classifier, zero_shot_metrics
from mmalign.progress import track

CAPTION_TASKS = ("retrieval", "diagnostics")  # the tasks that read the dataset's own captions
TASK_KINDS = {
    "zeroshot": "zeroshot_classification",
    "retrieval": "zeroshot_retrieval",
    "probe": "linear_probe",
    "diagnostics": "embedding_diagnostics",
    "counterfactual": "counterfactual",
}


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
        path = resources.shipped(resources.SUITES, str(name_or_path))
    if path is None:
        known = resources.names(resources.SUITES)
        raise ConfigError(
            f"config key 'eval.suite': unknown suite {name_or_path!r} (known: {', '.join(known)})"
        )
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
    _check_counterfactual_tasks(suite, path)
    return suite


def _roots(path: Path, shipped: bool) -> tuple[Path, ...]:
    """Where a suite's relative data paths may lie: its own folder, then the working directory.
    A shipped suite's paths are written relative to the repository's ``eval/``; installed,
    that folder is inside the package, so they also resolve against ``./eval`` (the
    working directory as a checkout root: ``../data/x`` is ``./data/x``)."""
    own = path.resolve().parent
    return (own, Path.cwd() / "eval", Path.cwd()) if shipped else (own, Path.cwd())


def _check_counterfactual_tasks(suite: dict, path: Path) -> None:
    seen: list[str] = []  # zeroshot tasks so far (a counterfactual task scores their classifiers)
    for task in suite["tasks"]:
        if task["type"] == "counterfactual":
            missing = [n for n in task.get("tasks", []) if n not in seen]
            if missing:
                raise UsageError(
                    f"suite {path}: task {task['name']!r}: key 'tasks' names {missing}, "
                    f"which are not zeroshot tasks listed before it"
                )
        elif task["type"] == "zeroshot":
            seen.append(task["name"])


def captions_are_templates(suite: dict) -> bool:
    """Whether the suite's dataset captions are class-name templates (retrieval on them is not meaningful)."""
    dataset = suite.get("dataset")
    kind = dataset.get("type") if isinstance(dataset, dict) else "shards"
    return bool(suite.get("template_captions")) or kind in ("digits", "imagefolder")


def label_field(suite: dict) -> str:
    """The suite's first zero-shot label field (what its accuracy is over; samples are drawn stratified by it)."""
    return next((t["label_field"] for t in suite.get("tasks", []) if t["type"] == "zeroshot"), "label")


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


def _labels(metas: list[dict], task: dict) -> torch.Tensor:
    field, names = task["label_field"], task["classnames"]
    if task.get("label_index"):  # the field holds the class's index in classnames (clip_benchmark's .cls)
        bad = [
            m.get(field) for m in metas if not isinstance(m.get(field), int) or not 0 <= m[field] < len(names)
        ]
        if bad:
            raise UsageError(
                f"task {task['name']!r}: label {bad[0]!r} is not a class index "
                f"(0..{len(names) - 1}: {len(names)} class names)"
            )
        return torch.tensor([m[field] for m in metas], dtype=torch.long)
    index = {n: i for i, n in enumerate(names)}
    unknown = {str(m.get(field)) for m in metas if m.get(field) not in index}
    if unknown:
        raise ConfigError(
            f"task {task['name']!r}: {field!r} values {sorted(unknown)[:3]} are not in its classnames"
        )
    return torch.tensor([index[m[field]] for m in metas])


def _clean(value):
    """NaN -> None (JSON has no NaN), recursively."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return value


def embedding_needs(tasks: list[dict]) -> tuple[bool, bool]:
    """(pre-projection features, the dataset's captions): what the suite's tasks read."""
    return (
        any(t["type"] == "probe" and t.get("features") == "pre_projection" for t in tasks),
        any(t["type"] in CAPTION_TASKS for t in tasks),
    )


def embedding_total(spec: dict) -> int | None:
    """How many samples the embedding pass over ``spec`` reads, where known before reading, for
    the progress counter's total and ETA: shards listed in their folders' ``sizes.json``
    (written by the shard builders), capped by ``limit``; else the ``limit``; else None."""
    from mmalign.data.shards import shard_total

    limit = int(spec["limit"]) if spec.get("limit") else None
    known = None
    if spec.get("type") == "shards" and spec.get("per_class") is None:  # per_class drops an unknown share
        counts = [shard_total(url) for url in expand_urls(spec["urls"])]
        known = sum(counts) if counts and None not in counts else None
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
        encode = text_encoder(model, device)  # (B, L) -> (B, D), in cache-sized pieces on a CPU
        classifiers = {}  # zeroshot task name -> what counterfactuals need
        records = []
        for task in tasks:
            say(f"task {task['name']} ({task['type']})")
            extra: dict = {}
            if task["type"] == "zeroshot":
                labels = _labels(emb["metas"], task)
                weights = (built or {}).get(task["name"])  # (D, C)
                if weights is None:
                    weights = build_classifier(encode, tokenizer, task["classnames"], task["templates"])
                classifiers[task["name"]] = {
                    "weights": weights,
                    "label_field": task["label_field"],
                    "classnames": task["classnames"],
                }
                feats, metas = emb["image_features"], emb["metas"]
                if task.get("classes"):  # held-out classes: their images, their columns
                    rows, cols, labels = class_subset(
                        labels, task["classnames"], task["classes"], task["name"]
                    )
                    feats, metas, weights = feats[rows], [metas[i] for i in rows], weights[:, cols]
                    extra["n_images"] = len(rows)
                metrics = zero_shot_metrics(feats, weights, labels)
                metrics["chance_acc1"] = 1.0 / weights.shape[1]
                if task.get("slices"):
                    logits = 100.0 * feats @ weights
                    extra["slices"] = {f: slice_metrics(logits, labels, metas, f) for f in task["slices"]}
            elif task["type"] == "retrieval":
                if len(emb["text_to_image"]) == 0:
                    raise ConfigError(f"task {task['name']!r}: the dataset has no captions to retrieve")
                metrics = recall_at_k(
                    emb["image_features"],
                    emb["text_features"],
                    emb["text_to_image"],
                    ks=task.get("ks", [1, 5, 10]),
                )
                if captions_are_templates(suite) or looks_templated(
                    emb.get("captions", []), len(emb["keys"])
                ):
                    extra["template_captions"] = True  # printed with TEMPLATE_CAVEAT wherever R@k is
            elif task["type"] == "probe":
                kind = task.get("features", "joint")
                feats = emb["image_pre_projection"] if kind == "pre_projection" else emb["image_features"]
                metrics = probes.run_probes(
                    feats, _labels(emb["metas"], task), len(task["classnames"]), task, say=say
                )
                metrics["chance_acc1"] = 1.0 / len(task["classnames"])
                extra["features"] = kind
                extra["features_description"] = FEATURE_KINDS[kind]
            elif task["type"] == "diagnostics":
                metrics = diagnostics.embedding_diagnostics(
                    emb["image_features"],
                    emb["text_features"],
                    emb["text_to_image"],
                    seed=int(task.get("seed", 0)),
                )
            else:
                metrics, extra["expected"] = _counterfactuals(
                    model, preprocess, spec, task, classifiers, batch_size, device
                )
            records.append(
                {
                    # a cb:DIR suite's task names its record as clip_benchmark does (wds/NAME)
                    "dataset": task.get("record_dataset") or f"{suite['name']}/{task['name']}",
                    "model": model_name,
                    "pretrained": None,
                    "task": TASK_KINDS[task["type"]],
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


def _counterfactuals(
    model, preprocess, spec: dict, task: dict, classifiers: dict, batch_size: int, device: str
) -> tuple[dict, dict]:
    names = task.get("tasks", list(classifiers))
    missing = [n for n in names if n not in classifiers]
    if missing:
        raise ConfigError(
            f"task {task['name']!r}: counterfactual tasks {missing} must be zeroshot tasks listed before it"
        )
    limit = int(task.get("limit", 256))
    samples = list(iter_dataset(dict(spec, limit=min(limit, int(spec.get("limit") or limit)))))
    return counterfactual.run_counterfactuals(
        model,
        preprocess,
        samples,
        task["edits"],
        {n: classifiers[n] for n in names},
        batch_size,
        device,
        int(task.get("seed", 0)),
    )


def write_results(records: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(records, indent=2))
    return path


def summary_rows(records: list[dict]) -> list[tuple[str, str, float]]:
    """(task, metric, value) rows for the headline numbers."""
    rows = []
    for r in records:
        m, name = r["metrics"], r["dataset"]
        if r["task"] == "zeroshot_classification":
            rows.append((name, "acc1", m["acc1"]))
            rows.append((name, "chance", m["chance_acc1"]))
        elif r["task"] == "zeroshot_retrieval":
            for k in (1, 5):
                rows.append((name, f"text->image R@{k}", m.get(f"image_retrieval_recall@{k}")))
                rows.append((name, f"image->text R@{k}", m.get(f"text_retrieval_recall@{k}")))
            rows.append((name, "chance R@5", 5 / r["n_images"]))
        elif r["task"] == "linear_probe":  # linear, kNN, few-shot and chance top-1
            rows += [(f"{name} ({r['features']})", k, v) for k, v in m.items() if k.endswith("_acc1")]
        elif r["task"] == "embedding_diagnostics":
            for k in (
                "alignment",
                "uniformity_image",
                "effective_rank_image",
                "modality_gap",
                "nn_diversity_image",
                "positive_negative_auc",
            ):
                rows.append((name, k, m.get(k)))
        else:
            rows += [(name, k, v) for k, v in m.items() if k.endswith(("_cosine_mean", "_flip_rate"))]
    return rows
