"""Evaluation datasets: where a suite's images, captions and metadata come from.

A suite's ``dataset`` is either a WebDataset shard spec (a string: the synthetic
shapes val split, or any img2dataset-layout shard set) or a mapping with a ``type``:

- ``shards``: ``{type: shards, urls: "data/x/{00000..00003}.tar"}``;
- ``digits``: scikit-learn's bundled handwritten digits (1,797 real 8x8 scans, no
  files needed), upscaled to ``size`` pixels (default 32) as RGB;
- ``imagefolder``: class-named folders as a directory or a tar
  (``../shared/data/cifar10/test.tar`` holds ``./cat/0001.jpg``, ...);
- ``cb_wds``: a clip_benchmark WebDataset dataset (``.cls`` labels or ``.txt`` captions),
  never written in a suite file: :func:`mmalign.evaluation.cb_wds.cb_suite` builds it
  from the dataset's folder (``cb:DIR``).

Every source yields ``{"key", "image" (PIL), "captions" (list[str]), "json" (dict)}``,
the shape of :func:`mmalign.data.shards.read_samples`.  Class datasets store
``{"label": int, "classname": str}`` in ``json`` and caption each image with
``caption_templates`` (default: one neutral template), so retrieval and diagnostics
run on them too.  ``per_class`` keeps the first N of each class.

``limit`` draws N samples at random (seeded by ``seed``, default 0), stratified by the
``stratify`` field of ``.json`` (default ``label``) where the samples have it: each
value keeps its share of N (largest remainders), so a class-sorted source (CIFAR's tar,
shards built with ``--no-shuffle``) does not yield one class as a first-N cut would.
The draw costs a first pass over keys and labels only (no image is decoded); the
chosen samples then come in the source's order.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator

from PIL import Image

from mmalign.config import ConfigError
from mmalign.data.shards import (
    BadSample,
    CorruptTar,
    TruncatedTar,
    check_urls,
    expand_urls,
    iter_tar_groups,
    open_image,
    parse_meta,
    read_samples,
)
from mmalign.errors import UsageError
from mmalign.extras import extra

log = logging.getLogger(__name__)
DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]
DEFAULT_CAPTION_TEMPLATES = ["a photo of a {c}."]


def dataset_spec(suite: dict, data: str | None = None, *, user_data: str | None = None) -> dict:
    """The suite's dataset as a mapping, pointed elsewhere by ``data`` or ``user_data``.

    ``data`` (a shard spec) is how the trainer points a shards suite at the run's own
    validation shards (``data.val``); it leaves image folders and the file-less digits as
    the suite names them.  ``user_data`` is ``--data`` on the command line: it replaces a
    shards dataset's urls *or* an image folder's ``path`` (a directory or a tar of
    class-named folders), and wins over ``data``.
    """
    spec = suite.get("dataset")
    if spec is None or isinstance(spec, str):
        spec = {"type": "shards", "urls": spec}
    spec = dict(spec)
    kind = spec.get("type")
    if kind not in ("shards", "digits", "imagefolder", "cb_wds"):
        raise ConfigError(
            f"suite {suite.get('name')!r}: dataset type {kind!r} is not shards, digits or imagefolder"
        )
    if kind == "cb_wds":  # its folder names its shards; the run's data.val is not it
        if user_data is not None:
            raise UsageError(
                "--data: a clip_benchmark dataset reads its own shards; give its folder "
                "with --cb-dataset DIR (or --suite cb:DIR) and drop --data"
            )
        return spec
    if user_data is not None:
        if kind == "digits":
            raise UsageError(
                f"--data: suite {suite.get('name')!r} reads sklearn's digits, not files; "
                f"drop --data or pick a shards / imagefolder suite"
            )
        spec["path" if kind == "imagefolder" else "urls"] = user_data
    elif kind == "shards" and data is not None:
        spec["urls"] = data
    if kind == "shards" and not spec.get("urls"):
        raise UsageError(f"suite {suite.get('name')!r} names no shards: give them with --data")
    return spec


def iter_dataset(spec: dict) -> Iterator[dict]:
    """Samples of a dataset mapping (see :func:`dataset_spec`), at most ``spec['limit']`` (a seeded draw)."""
    limit, per_class = spec.get("limit"), spec.get("per_class")
    keep = None
    if limit is not None:
        if int(limit) < 1:
            raise UsageError(f"dataset limit must be >= 1, got {limit}")
        keys = list(_keys_strata_labels(spec))
        if per_class is not None:  # the draw is from what per_class leaves
            keys = _first_per_class(keys, int(per_class))
        keep = draw_stratified([(k, s) for k, s, _ in keys], int(limit), int(spec.get("seed", 0)))
    source = {"shards": _shards, "digits": _digits, "imagefolder": _imagefolder, "cb_wds": _cb_wds}[
        spec["type"]
    ](spec, keep)
    seen: dict = {}
    for sample in source:
        if per_class is not None and keep is None:
            label = sample["json"].get("label")
            if seen.get(label, 0) >= int(per_class):
                continue
            seen[label] = seen.get(label, 0) + 1
        yield sample


def draw_stratified(keys: list[tuple], n: int, seed: int = 0) -> set:
    """A seeded random ``n`` of ``(key, stratum)`` pairs, each stratum keeping its share of ``n``.

    Shares are ``n * count / total`` rounded by largest remainder (ties to the larger
    stratum, then the first seen), so the draw's class mix is the source's to within one
    sample per class.  Returns the chosen keys.
    """
    if n >= len(keys):
        return {k for k, _ in keys}
    strata: dict = {}
    for key, stratum in keys:
        strata.setdefault(stratum, []).append(key)
    quotas = {s: n * len(ks) / len(keys) for s, ks in strata.items()}
    counts = {s: int(q) for s, q in quotas.items()}
    order = sorted(strata, key=lambda s: (-(quotas[s] - counts[s]), -len(strata[s])))
    for s in order[: n - sum(counts.values())]:
        counts[s] += 1
    rng = random.Random(seed)
    return {k for s, ks in strata.items() for k in rng.sample(ks, counts[s])}


def _first_per_class(keys: list[tuple], per_class: int) -> list[tuple]:
    """What ``per_class`` keeps of ``(key, stratum, label)``: the first N of each ``label``."""
    seen: dict = {}
    out = []
    for key, stratum, label in keys:
        if seen.get(label, 0) < per_class:
            seen[label] = seen.get(label, 0) + 1
            out.append((key, stratum, label))
    return out


def _stratum(meta: dict, field: str):
    value = meta.get(field)
    return value if isinstance(value, (str, int, float, bool)) else None


def _keys_strata_labels(spec: dict) -> Iterator[tuple]:
    """``(key, stratum, label)`` of every sample, without decoding an image; keys as the sources give them."""
    field = spec.get("stratify", "label")
    if spec["type"] == "shards":
        for url in _urls(spec):
            try:
                for raw in iter_tar_groups(url):
                    try:
                        meta = parse_meta(raw)
                    except BadSample:
                        meta = {}  # the sample pass skips it
                    yield (url, raw["__key__"]), _stratum(meta, field), meta.get("label")
            except (TruncatedTar, CorruptTar, OSError):
                continue  # the sample pass logs it
    elif spec["type"] == "cb_wds":
        from mmalign.evaluation.cb_wds import keys_and_labels

        yield from keys_and_labels(spec, field)
    elif spec["type"] == "digits":
        with extra("report", "the digits suite"):
            from sklearn.datasets import load_digits

        for i, label in enumerate(load_digits().target):
            meta = {"label": int(label), "classname": DIGIT_NAMES[int(label)]}
            yield f"digits_{i:04d}", _stratum(meta, field), meta["label"]
    else:
        for i, item in enumerate(_folder_items(spec)):
            yield f"{item.meta['classname']}_{i:06d}", _stratum(item.meta, field), item.meta["label"]


def _urls(spec: dict) -> list[str]:
    urls = expand_urls(spec["urls"])
    check_urls(urls, "data.val")
    return urls


def _shards(spec: dict, keep: set | None = None) -> Iterator[dict]:
    """Every decodable sample in order (bad ones logged and skipped); with ``keep``, only those (url, key)."""
    yield from read_samples(_urls(spec), keep=keep)


def _cb_wds(spec: dict, keep: set | None = None) -> Iterator[dict]:
    from mmalign.evaluation.cb_wds import iter_samples

    yield from iter_samples(spec, keep)


def _captions(spec: dict, classname: str) -> list[str]:
    return [t.format(c=classname) for t in spec.get("caption_templates", DEFAULT_CAPTION_TEMPLATES)]


def _digits(spec: dict, keep: set | None = None) -> Iterator[dict]:
    with extra("report", "the digits suite"):
        from sklearn.datasets import load_digits

    size = int(spec.get("size", 32))
    digits = load_digits()  # images (1797, 8, 8) in 0..16, targets (1797,)
    for i, (pixels, label) in enumerate(zip(digits.images, digits.target)):
        if keep is not None and f"digits_{i:04d}" not in keep:
            continue
        # ink is white-on-black in the scans; draw dark ink on white like the paper digits were
        grey = Image.fromarray((255 - pixels * (255 / 16)).astype("uint8"), mode="L")
        image = grey.resize((size, size), Image.Resampling.BILINEAR).convert("RGB")
        name = DIGIT_NAMES[int(label)]
        yield {
            "key": f"digits_{i:04d}",
            "image": image,
            "captions": _captions(spec, name),
            "json": {"label": int(label), "classname": name},
        }


def _folder_items(spec: dict):
    # The shard builder's enumeration (directory or tar, class order) is reused, not repeated.
    from mmalign.data.imagefolder import Captioner, image_folder

    templates = spec.get("caption_templates", DEFAULT_CAPTION_TEMPLATES)
    return image_folder(spec["path"], Captioner(templates), spec.get("classnames"))[1]


def _imagefolder(spec: dict, keep: set | None = None) -> Iterator[dict]:
    for i, item in enumerate(_folder_items(spec)):
        if keep is not None and f"{item.meta['classname']}_{i:06d}" not in keep:
            continue
        raw = item.image
        try:  # pixels and shape checked from the header, before decoding
            image = open_image(raw if isinstance(raw, bytes) else open(raw, "rb").read())
        except BadSample as e:
            log.warning("skipping image %d of %s: %s", i, spec["path"], e)
            continue
        yield {
            "key": f"{item.meta['classname']}_{i:06d}",
            "image": image.convert("RGB"),
            "captions": item.captions,
            "json": dict(item.meta),
        }
