"""clip_benchmark's WebDataset layout (its ``wds_*`` datasets), read natively.

A local copy of a clip_benchmark WebDataset dataset (``huggingface.co/datasets/clip-benchmark/wds_NAME``,
or what ``clip_benchmark_export_wds`` writes) is a folder::

    DIR/classnames.txt                          one class name per line, in label order
    DIR/zeroshot_classification_templates.txt   one prompt per line, with {c}
    DIR/dataset_type.txt                        optional; "retrieval" (absent: classification)
    DIR/SPLIT/nshards.txt                       N, the number of shards (SPLIT is usually test)
    DIR/SPLIT/0.tar .. DIR/SPLIT/{N-1}.tar      samples: an image (.webp, .png, .jpg or .jpeg) and
                                                .cls (the label index as text) or .txt (captions, one a line)

:func:`cb_suite` inspects such a folder and builds the suite :func:`~mmalign.evaluation.suite.run_suite`
reads, in memory: a dataset of type ``cb_wds`` (its samples come from :func:`iter_samples`)
and one ``zeroshot`` task (class names and templates from the two files, labels as class
indices) or one ``retrieval`` task at clip_benchmark's default ``--recall_k 1 5 10``.  So
``mmalign eval --cb-dataset DIR``, ``--suite cb:DIR`` and a run's ``eval.suite: cb:DIR`` all
go through the zero-shot and retrieval code every other suite uses.  :func:`cb_record` turns
the task's record into the record clip_benchmark's CLI writes for the same dataset.

What it mirrors of clip_benchmark 1.6.2 (``datasets/builder.py::build_wds_dataset``):
the task is ``dataset_type.txt``'s when the file exists ("retrieval", else classification);
without it, the task is what the first sample carries (``.cls`` or ``.txt``).  A sample's
image is its first of webp, png, jpg, jpeg, in RGB; class names and templates are the files'
lines, stripped.  Captions are the ``.txt``'s non-empty lines, stripped (clip_benchmark keeps
a blank line as an empty caption).  A missing file, a sample without an image or label, or
an image that does not decode is a one-line :class:`~mmalign.errors.UsageError`, not a skip:
skipping would change the numbers without saying so.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mmalign.data.shards import BadSample, CorruptTar, TruncatedTar, iter_tar_groups, open_image
from mmalign.data.templates import check_templates
from mmalign.errors import UsageError

PREFIX = "cb:"  # a suite named cb:DIR is the clip_benchmark dataset in DIR
IMAGE_EXTS = ("webp", "png", "jpg", "jpeg")  # clip_benchmark's order of preference
RECALL_K = [1, 5, 10]  # clip_benchmark's CLI default --recall_k
CLASSNAMES = "classnames.txt"
TEMPLATES = "zeroshot_classification_templates.txt"
TYPE_FILE = "dataset_type.txt"
CB_TASKS = {"classification": "zeroshot_classification", "retrieval": "zeroshot_retrieval"}


@dataclass
class Layout:
    """What a clip_benchmark dataset folder holds."""

    root: Path
    split: str
    task: str  # "classification" or "retrieval"
    urls: list[str]  # SPLIT/0.tar .. SPLIT/{N-1}.tar
    classnames: list[str] | None
    templates: list[str] | None


def is_cb(name) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def dataset_name(root: str | Path) -> str:
    """clip_benchmark's dataset name for a folder: ``wds/`` + the folder name without ``wds_``."""
    name = Path(root).resolve().name
    return "wds/" + (name[len("wds_") :] if name.startswith("wds_") else name)


def _lines(path: Path) -> list[str]:
    return [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]


def _first_sample(url: str, where: str) -> dict:
    try:
        for raw in iter_tar_groups(url):
            return raw
    except (TruncatedTar, CorruptTar, OSError) as e:
        raise UsageError(f"{where}: shard {url} is not readable: {e}") from None
    raise UsageError(f"{where}: shard {url} holds no samples")


def inspect(root: str | Path, split: str = "test") -> Layout:
    """The layout of the clip_benchmark dataset in ``root``; a one-line UsageError naming what is missing."""
    root = Path(root)
    where = f"clip_benchmark dataset {root}"
    if not root.is_dir():
        raise UsageError(f"{where}: no such folder")
    split_dir = root / split
    if not split_dir.is_dir():
        found = sorted(p.name for p in root.iterdir() if (p / "nshards.txt").is_file())
        raise UsageError(
            f"{where}: split folder {split}/ not found "
            f"(splits here: {', '.join(found) or 'none'}; choose one with --cb-split)"
        )
    count_file = split_dir / "nshards.txt"
    if not count_file.is_file():
        raise UsageError(f"{where}: {split}/nshards.txt not found (it holds the number of shards)")
    try:
        with open(count_file, "rb") as f:
            nshards = int(f.read(64).decode("ascii").strip())  # a number: 64 bytes are plenty
    except (ValueError, UnicodeDecodeError):
        raise UsageError(f"{where}: {split}/nshards.txt does not hold a number of shards") from None
    if nshards < 1:
        raise UsageError(f"{where}: {split}/nshards.txt says {nshards} shards")
    # the folder's listing first: a count far beyond it is refused at once, not after N stats
    with os.scandir(split_dir) as entries:
        present = {e.name for e in entries if e.name.endswith(".tar") and e.is_file()}
    names = [f"{i}.tar" for i in range(min(nshards, len(present) + 1))]
    missing = next((name for name in names if name not in present), None)
    if missing is not None:
        numbered = (n[:-4] for n in present)
        lacking = nshards - sum(1 for n in numbered if n.isdigit() and n == str(int(n)) and int(n) < nshards)
        more = f" (and {lacking - 1} more of {nshards})" if lacking > 1 else ""
        raise UsageError(f"{where}: shard {split}/{missing} not found{more}")
    urls = [str(split_dir / name) for name in names]
    type_file = root / TYPE_FILE
    if type_file.is_file():
        declared = type_file.read_text().strip().lower()
        if declared not in ("retrieval", "classification"):
            raise UsageError(
                f"{where}: {TYPE_FILE} says {declared!r}; only retrieval and classification "
                f"datasets are supported"
            )
        task = declared
    else:  # clip_benchmark assumes classification; we look at what the samples carry
        first = _first_sample(urls[0], where)
        carried = "classification" if "cls" in first else "retrieval" if "txt" in first else None
        if carried is None:
            raise UsageError(
                f"{where}: sample {first['__key__']!r} of {split}/0.tar has neither .cls (a label) "
                f"nor .txt (captions), and there is no {TYPE_FILE}: unknown layout"
            )
        task = carried
    classnames = templates = None
    if task == "classification":
        for name in (CLASSNAMES, TEMPLATES):
            if not (root / name).is_file():
                raise UsageError(
                    f"{where}: {name} not found (a classification dataset needs {CLASSNAMES} and {TEMPLATES})"
                )
        classnames, templates = _lines(root / CLASSNAMES), _lines(root / TEMPLATES)
        if not classnames or not any(templates):
            raise UsageError(f"{where}: {CLASSNAMES if not classnames else TEMPLATES} is empty")
        check_templates(templates, f"{where}: {TEMPLATES}", unit="line")  # blank lines, {x}, a lone {
    return Layout(root, split, task, urls, classnames, templates)


def cb_suite(root: str | Path, split: str = "test", name: str | None = None) -> dict:
    """The in-memory suite that evaluates the clip_benchmark dataset in ``root`` (module docstring).

    ``name``: the record's ``dataset`` (default :func:`dataset_name`, e.g. ``wds/cifar10``),
    which the task carries as ``record_dataset`` so that :func:`run_suite`'s record is named
    as clip_benchmark names it.  The suite is called ``wds_`` + the rest with ``/`` as ``-``
    (``wds_cifar10``: one name per dataset, for logs), its task ``zeroshot`` or ``retrieval``.
    """
    layout = inspect(root, split)
    name = name or dataset_name(root)
    suite_name = "wds_" + name.split("/", 1)[-1].replace("/", "-")
    dataset = {"type": "cb_wds", "urls": layout.urls, "task": layout.task, "root": str(layout.root)}
    if layout.task == "classification":
        task = {
            "type": "zeroshot",
            "name": "zeroshot",
            "record_dataset": name,
            "label_field": "label",
            "label_index": True,
            "classnames": layout.classnames,
            "templates": layout.templates,
        }
    else:
        task = {"type": "retrieval", "name": "retrieval", "record_dataset": name, "ks": list(RECALL_K)}
    return {
        "name": suite_name,
        "dataset": dataset,
        "tasks": [task],
        "cb": {"dataset": name, "task": CB_TASKS[layout.task], "split": split},
    }


def _label(raw: dict, url: str) -> int:
    text = raw["cls"].decode("utf-8", "replace").strip()
    try:
        return int(text)
    except ValueError:
        raise UsageError(
            f"shard {url}: sample {raw['__key__']!r}: .cls holds {text[:20]!r}, not a label index"
        ) from None


def _group_metadata(raw: dict, url: str) -> list | None:
    """The ``.npy`` vector some datasets carry (DataComp's WILDS and fairness sets: group ids), as a list."""
    if "npy" not in raw:
        return None
    import numpy as np

    try:
        return np.load(io.BytesIO(raw["npy"]), allow_pickle=False).reshape(-1).tolist()
    except (ValueError, OSError) as e:
        raise UsageError(f"shard {url}: sample {raw['__key__']!r}: .npy does not load: {e}") from None


def _raw_samples(spec: dict) -> Iterator[tuple[str, dict]]:
    for url in spec["urls"]:
        try:
            for raw in iter_tar_groups(url):
                yield url, raw
        except (TruncatedTar, CorruptTar, OSError) as e:
            raise UsageError(f"shard {url} is not readable: {e}") from None


def _check_members(raw: dict, url: str, task: str) -> None:
    if raw.get("__oversized__"):
        raise UsageError(f"shard {url}: sample {raw['__key__']!r}: a member is over data.max_member_bytes")
    if not any(e in raw for e in IMAGE_EXTS):
        raise UsageError(f"shard {url}: sample {raw['__key__']!r} has no image (.webp, .png, .jpg or .jpeg)")
    need = "cls" if task == "classification" else "txt"
    if need not in raw:
        what = "a label (.cls)" if need == "cls" else "captions (.txt)"
        raise UsageError(f"shard {url}: sample {raw['__key__']!r} of a {task} dataset has no {what}")


def keys_and_labels(spec: dict, field: str = "label") -> Iterator[tuple]:
    """``((url, key), stratum, label)`` of every sample without decoding an image (for ``limit``'s draw)."""
    for url, raw in _raw_samples(spec):
        _check_members(raw, url, spec["task"])
        label = _label(raw, url) if spec["task"] == "classification" else None
        yield (url, raw["__key__"]), (label if field == "label" else None), label


def iter_samples(spec: dict, keep: set | None = None) -> Iterator[dict]:
    """``{"key", "image" (PIL, RGB), "captions", "json"}`` of every sample (``keep``: only those (url, key)).

    Classification samples have no captions and ``json = {"label": int}``; retrieval
    samples have their captions and ``json = {}``; a ``.npy`` vector is kept as ``json["npy"]``.
    """
    from mmalign.data.shards import parse_captions

    for url, raw in _raw_samples(spec):
        if keep is not None and (url, raw["__key__"]) not in keep:
            continue
        _check_members(raw, url, spec["task"])
        meta: dict = {}
        captions: list[str] = []
        if spec["task"] == "classification":
            meta["label"] = _label(raw, url)
        else:
            try:
                captions = parse_captions({"txt": raw["txt"]}, {})
            except BadSample as e:
                raise UsageError(f"shard {url}: sample {raw['__key__']!r}: {e}") from None
        group = _group_metadata(raw, url)
        if group is not None:
            meta["npy"] = group
        data = next(raw[e] for e in IMAGE_EXTS if e in raw)
        try:
            image = open_image(data)
        except BadSample as e:
            raise UsageError(f"shard {url}: sample {raw['__key__']!r}: image does not decode ({e})") from None
        yield {
            "key": Path(raw["__key__"]).name,
            "image": image.convert("RGB"),
            "captions": captions,
            "json": meta,
        }


def cb_record(record: dict, suite: dict, model: str = "mmalign", pretrained: str | None = None) -> dict:
    """clip_benchmark's record (``cli.py``'s dump) for :func:`run_suite`'s record of a cb suite.

    The keys and their order are clip_benchmark's; metrics are only those clip_benchmark
    computes, in its order: ``acc1, acc5, mean_per_class_recall`` (acc5 NaN under five
    classes, which ``json`` writes as ``NaN`` as clip_benchmark's file has it), or
    ``image_retrieval_recall@k, text_retrieval_recall@k`` for each k in turn.
    """
    got = record["metrics"]
    if record["task"] == "zeroshot_classification":
        metrics = {
            k: math.nan if got.get(k) is None else got[k] for k in ("acc1", "acc5", "mean_per_class_recall")
        }
    else:
        metrics = {}
        for k in suite["tasks"][0].get("ks", RECALL_K):
            for side in ("image", "text"):
                metrics[f"{side}_retrieval_recall@{k}"] = got[f"{side}_retrieval_recall@{k}"]
    return {
        "dataset": suite["cb"]["dataset"],
        "model": model,
        "pretrained": pretrained,
        "task": record["task"],
        "metrics": metrics,
        "language": "en",
    }
