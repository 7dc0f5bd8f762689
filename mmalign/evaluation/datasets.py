"""Evaluation datasets: where a suite's images, captions and metadata come from.

A suite's ``dataset`` is either a WebDataset shard spec (a string: the synthetic
shapes val split, or any img2dataset-layout shard set) or a mapping with a ``type``:

- ``shards``: ``{type: shards, urls: "data/x/{00000..00003}.tar"}``;
- ``digits``: scikit-learn's bundled handwritten digits (1,797 real 8x8 scans, no
  files needed), upscaled to ``size`` pixels (default 32) as RGB;
- ``imagefolder``: class-named folders as a directory or a tar
  (``../shared/data/cifar10/test.tar`` holds ``./cat/0001.jpg``, ...).

Every source yields ``{"key", "image" (PIL), "captions" (list[str]), "json" (dict)}``,
the shape of :func:`mmalign.data.shards.read_samples`.  Class datasets store
``{"label": int, "classname": str}`` in ``json`` and caption each image with
``caption_templates`` (default: one neutral template), so retrieval and diagnostics
run on them too.  ``limit`` keeps the first N samples in the source's order;
``per_class`` keeps the first N of each class (CIFAR's tar is grouped by class, so a
balanced subset needs ``per_class``, not ``limit``).
"""

from __future__ import annotations

import io
from collections.abc import Iterator

from PIL import Image

from mmalign.config import ConfigError
from mmalign.data.shards import check_urls, expand_urls, open_image, read_samples

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DEFAULT_CAPTION_TEMPLATES = ["a photo of a {c}."]


def dataset_spec(suite: dict, data: str | None = None) -> dict:
    """The suite's dataset as a mapping; ``data`` (a shard spec) replaces a shards dataset's urls.

    ``data`` is how the trainer and ``mmalign eval --data`` point a suite at the run's
    own validation shards; it does not apply to the file-less digits or to image folders.
    """
    spec = suite.get("dataset")
    if spec is None or isinstance(spec, str):
        spec = {"type": "shards", "urls": spec}
    spec = dict(spec)
    kind = spec.get("type")
    if kind not in ("shards", "digits", "imagefolder"):
        raise ConfigError(f"suite {suite.get('name')!r}: dataset type {kind!r} is not shards, digits or imagefolder")
    if kind == "shards" and data is not None:
        spec["urls"] = data
    if kind == "shards" and not spec.get("urls"):
        raise ConfigError(f"suite {suite.get('name')!r} names no shards: give them with --data")
    return spec


def iter_dataset(spec: dict) -> Iterator[dict]:
    """Samples of a dataset mapping (see :func:`dataset_spec`), at most ``spec['limit']``."""
    limit, per_class = spec.get("limit"), spec.get("per_class")
    source = {"shards": _shards, "digits": _digits, "imagefolder": _imagefolder}[spec["type"]](spec)
    seen: dict = {}
    kept = 0
    for sample in source:
        if limit is not None and kept >= int(limit):
            return
        if per_class is not None:
            label = sample["json"].get("label")
            if seen.get(label, 0) >= int(per_class):
                continue
            seen[label] = seen.get(label, 0) + 1
        kept += 1
        yield sample


def _shards(spec: dict) -> Iterator[dict]:
    urls = expand_urls(spec["urls"])
    check_urls(urls, "data.val")
    yield from read_samples(urls)


def _captions(spec: dict, classname: str) -> list[str]:
    return [t.format(c=classname) for t in spec.get("caption_templates", DEFAULT_CAPTION_TEMPLATES)]


def _digits(spec: dict) -> Iterator[dict]:
    from sklearn.datasets import load_digits

    size = int(spec.get("size", 32))
    digits = load_digits()  # images (1797, 8, 8) in 0..16, targets (1797,)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        # ink is white-on-black in the scans; draw dark ink on white like the paper digits were
        grey = Image.fromarray((255 - pixels * (255 / 16)).astype("uint8"), mode="L")
        image = grey.resize((size, size), Image.Resampling.BILINEAR).convert("RGB")
        name = DIGIT_NAMES[int(label)]
        yield {"key": f"digits_{i:04d}", "image": image, "captions": _captions(spec, name),
               "json": {"label": int(label), "classname": name}}


def _imagefolder(spec: dict) -> Iterator[dict]:
    # The shard builder's enumeration (directory or tar, class order) is reused, not repeated.
    from data_pipelines.sources import Captioner, image_folder

    templates = spec.get("caption_templates", DEFAULT_CAPTION_TEMPLATES)
    names, items = image_folder(spec["path"], Captioner(templates), spec.get("classnames"))
    for i, item in enumerate(items):
        raw = item.image
        image = open_image(raw) if isinstance(raw, bytes) else Image.open(io.BytesIO(open(raw, "rb").read()))
        yield {"key": f"{item.meta['classname']}_{i:06d}", "image": image.convert("RGB"),
               "captions": item.captions, "json": dict(item.meta)}
