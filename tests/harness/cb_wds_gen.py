"""Small datasets in clip_benchmark's WebDataset layout (what ``build_wds_dataset`` reads), for tests.

``write_wds(DIR, ...)`` writes ``DIR/classnames.txt`` + ``zeroshot_classification_templates.txt``
(classification) or ``DIR/dataset_type.txt`` = ``retrieval``, and ``DIR/SPLIT/nshards.txt`` +
``0.tar .. N-1.tar`` holding synthetic shape scenes (:mod:`data_pipelines.shapes`): each sample
an image and ``.cls`` (the shape's index) or ``.txt`` (distinct captions, one a line), and,
with ``groups``, a ``.npy`` vector whose first entry is a group id (as DataComp's WILDS and
fairness sets carry).  It returns what it wrote, for references computed without mmalign's reader.
"""

from __future__ import annotations

import io
import random
import tarfile
from pathlib import Path

import numpy as np

from data_pipelines import shapes

CLASSNAMES = list(shapes.SHAPES)  # 6 classes: acc5 is defined
TEMPLATES = ["a photo of a {c}.", "a drawing of a {c}."]


def _member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _encode(image, ext: str) -> bytes:
    out = io.BytesIO()
    image.save(out, {"jpg": "JPEG", "jpeg": "JPEG"}.get(ext, ext.upper()))
    return out.getvalue()


def write_wds(
    root: Path,
    task: str = "classification",
    n: int = 40,
    seed: int = 1,
    shards: int = 1,
    split: str = "test",
    image_ext: str = "png",
    groups: int = 0,
    type_file: bool = True,
    size: int = 32,
) -> list[dict]:
    """Write a dataset to ``root``; returns one dict per sample, in order: ``{"key", "label" or
    "captions", "group" (with ``groups``)}``.  ``type_file=False`` leaves out dataset_type.txt
    (clip_benchmark then assumes classification; mmalign looks at the samples)."""
    root = Path(root)
    (root / split).mkdir(parents=True, exist_ok=True)
    rng, truth = random.Random(seed), []
    per_shard = -(-n // shards)
    for s in range(shards):
        with tarfile.open(root / split / f"{s}.tar", "w") as tar:
            for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
                attrs = shapes.sample_attributes(rng)
                key = f"s{i:05d}"
                item: dict = {"key": key}
                _member(tar, f"{key}.{image_ext}", _encode(shapes.draw(attrs, size), image_ext))
                if task == "classification":
                    item["label"] = CLASSNAMES.index(attrs["shape"])
                    _member(tar, f"{key}.cls", str(item["label"]).encode())
                else:  # a per-sample suffix: no wrong caption exactly ties a right one
                    item["captions"] = [
                        f"{c} ({i})" for c in shapes.captions_for(attrs, rng, n=rng.randint(1, 3))
                    ]
                    _member(tar, f"{key}.txt", "\n".join(item["captions"]).encode())
                if groups:
                    item["group"] = rng.randrange(groups)
                    vec = io.BytesIO()
                    np.save(
                        vec, np.array([item["group"], rng.randrange(5), item.get("label", 0)], dtype=np.int64)
                    )
                    _member(tar, f"{key}.npy", vec.getvalue())
                truth.append(item)
    (root / split / "nshards.txt").write_text(str(shards))
    if task == "retrieval":
        if type_file:
            (root / "dataset_type.txt").write_text("retrieval\n")
    else:
        (root / "classnames.txt").write_text("\n".join(CLASSNAMES) + "\n")
        (root / "zeroshot_classification_templates.txt").write_text("\n".join(TEMPLATES) + "\n")
    return truth
