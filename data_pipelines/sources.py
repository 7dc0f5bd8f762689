"""Where shard samples come from: class folders, tables, Hugging Face datasets on disk.

Every source yields :class:`Item` objects: the image as encoded bytes or as a file
path (read later, in an encoder process), one or more captions, and metadata for
``.json``.  Sources only enumerate; decoding, resizing and writing happen in
:mod:`data_pipelines.build`.  A user mistake (a missing file, an unknown column)
raises ``ConfigError`` with one line.
"""

from __future__ import annotations

import random
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from mmalign.config import ConfigError

# package data (pyproject.toml): found the same way in a checkout and in an installed wheel
TEMPLATE_DIR = Path(str(resources.files("data_pipelines") / "templates"))
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass
class Item:
    image: bytes | str  # encoded bytes, or a path the encoder reads
    captions: list[str]
    meta: dict = field(default_factory=dict)


def load_templates(name_or_path: str) -> dict:
    """A template set: ``templates`` (with ``{c}``) and optionally ``classnames``."""
    path = Path(name_or_path)
    if not path.is_file():
        path = TEMPLATE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TEMPLATE_DIR.glob("*.yaml")))
        raise ConfigError(f"unknown template set {name_or_path!r} (known: {known}, or a YAML path)")
    data = yaml.safe_load(path.read_text()) or {}
    templates = data.get("templates")
    if not isinstance(templates, list) or not templates or not all("{c}" in str(t) for t in templates):
        raise ConfigError(f"template set {path}: 'templates' must be a non-empty list of strings containing {{c}}")
    return data


class Captioner:
    """Class name -> captions from templates: all of them (``per_image`` 0), or ``per_image`` drawn with a seed.

    The command line draws one template per image by default: every template in every
    ``.txt`` multiplies what evaluation, ``embed`` and ``report`` embed (18x for CIFAR).
    """

    def __init__(self, templates: list[str], per_image: int = 0, seed: int = 0):
        self.templates = templates
        self.per_image = per_image
        self.rng = random.Random(seed)

    def __call__(self, classname: str) -> list[str]:
        chosen = self.templates
        if 0 < self.per_image < len(self.templates):
            chosen = self.rng.sample(self.templates, self.per_image)
        return [t.format(c=classname.replace("_", " ")) for t in chosen]


def _class_items(pairs: Iterator[tuple[str, str, bytes | str]], classnames: list[str],
                 captioner: Captioner) -> Iterator[Item]:
    index = {c: i for i, c in enumerate(classnames)}
    for name, relpath, image in pairs:
        # source_path: where the sample came from inside the folder or tar, so a hit can be traced back
        yield Item(image, captioner(name), {"label": index[name], "classname": name, "source_path": relpath})


def _relpath(name: str) -> str:
    """``./cat/0001.jpg`` -> ``cat/0001.jpg`` (the class folder and the file)."""
    return "/".join(Path(name).parts[-2:])


def image_folder(path: str | Path, captioner: Captioner, classnames: list[str] | None = None,
                 shuffle_seed: int | None = None) -> tuple[list[str], Iterator[Item]]:
    """``root/CLASS/*.jpg`` as a directory or a tar (``./cat/0001.jpg``).

    Class ids follow ``classnames`` when a template set gives them (CIFAR-10's label
    order), else the sorted folder names.  Items come in folder order, or, with
    ``shuffle_seed``, in a seeded random order: class folders are sorted, so shards
    written in folder order hold one class each and every "first N" reader sees one
    class.  Returns (class names, items).
    """
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"image folder not found: {path}")
    if path.is_dir():
        folders = sorted(p.name for p in path.iterdir() if p.is_dir())
        files = [(d, f) for d in folders for f in sorted((path / d).iterdir()) if f.suffix.lower() in IMAGE_SUFFIXES]
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(files)
        pairs = ((d, f"{d}/{f.name}", str(f)) for d, f in files)
        found = folders
    else:
        try:
            with tarfile.open(path) as tar:
                names = [m.name for m in tar.getmembers() if m.isfile()]
        except (tarfile.TarError, OSError) as e:
            raise ConfigError(f"image folder {path}: not a directory or a readable tar ({e})") from None
        files = [n for n in names if Path(n).suffix.lower() in IMAGE_SUFFIXES and len(Path(n).parts) >= 2]
        found = sorted({Path(n).parts[-2] for n in files})
        if shuffle_seed is None:
            pairs = _tar_pairs(path, files)
        else:
            random.Random(shuffle_seed).shuffle(files)
            pairs = _tar_pairs_in_order(path, files)
    if not found:
        raise ConfigError(f"image folder {path}: no class subfolders with images")
    names = list(classnames) if classnames else found
    unknown = sorted(set(found) - set(names))
    if unknown:
        raise ConfigError(f"image folder {path}: folders {unknown[:3]} are not in the template set's classnames")
    return names, _class_items(pairs, names, captioner)


def _tar_pairs(path: Path, files: list[str]) -> Iterator[tuple[str, str, bytes]]:
    """One sequential pass in archive order (deterministic, nothing held in memory)."""
    wanted = set(files)
    with tarfile.open(path, "r|*") as tar:
        for member in tar:
            if member.isfile() and member.name in wanted:
                yield Path(member.name).parts[-2], _relpath(member.name), tar.extractfile(member).read()


def _tar_pairs_in_order(path: Path, files: list[str]) -> Iterator[tuple[str, str, bytes]]:
    """The members ``files`` in that order.

    An uncompressed tar is read by seeking to each member (nothing held in memory); a
    compressed one cannot seek cheaply, so its images are read in one pass and held.
    """
    try:
        tar = tarfile.open(path, "r:")
    except tarfile.ReadError:  # compressed
        wanted, held = set(files), {}
        with tarfile.open(path, "r|*") as stream:
            for member in stream:
                if member.isfile() and member.name in wanted:
                    held[member.name] = stream.extractfile(member).read()
        for name in files:
            yield Path(name).parts[-2], _relpath(name), held.pop(name)
        return
    with tar:
        members = {m.name: m for m in tar.getmembers()}  # tar.getmember(name) is a linear search
        for name in files:
            yield Path(name).parts[-2], _relpath(name), tar.extractfile(members[name]).read()


def _columns(available: list[str], wanted: dict[str, str | None], what: str) -> None:
    for role, column in wanted.items():
        if column is not None and column not in available:
            raise ConfigError(f"{what}: no column {column!r} for the {role} (columns: {', '.join(available)})")


def table(path: str | Path, image_col: str = "image", caption_col: str = "caption", root: str | None = None) -> Iterator[Item]:
    """CSV/TSV/parquet rows of (image path, caption, other columns -> .json).

    Relative image paths resolve against ``root`` (default: the table's folder); a
    caption cell may hold several captions, one per line.
    """
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"table not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif suffix in (".csv", ".tsv", ".txt"):
        frame = pd.read_csv(path, sep="\t" if suffix != ".csv" else ",", dtype=str, keep_default_na=False)
    else:
        raise ConfigError(f"table {path}: expected .csv, .tsv or .parquet")
    _columns(list(frame.columns), {"image path": image_col, "caption": caption_col}, f"table {path}")
    base = Path(root) if root else path.parent
    extra = [c for c in frame.columns if c not in (image_col, caption_col)]
    for row in frame.itertuples(index=False):
        record = dict(zip(frame.columns, row))
        image_path = Path(str(record[image_col]))
        caption = record[caption_col]
        captions = [line.strip() for line in str(caption).splitlines() if line.strip()] if caption is not None else []
        meta = {c: _plain(record[c]) for c in extra}
        yield Item(str(image_path if image_path.is_absolute() else base / image_path), captions, meta)


def _plain(value):
    """A JSON-able scalar (numpy scalars -> Python)."""
    if hasattr(value, "item"):
        return value.item()
    return value


def hf_dataset(path: str | Path, fmt: str = "disk", image_col: str = "image", caption_col: str | None = "caption",
               label_col: str | None = None, captioner: Captioner | None = None, split: str = "train") -> Iterator[Item]:
    """A Hugging Face dataset from local files, no network.

    ``fmt``: ``disk`` (``save_to_disk`` output), ``parquet`` (a file or folder of
    parquet) or ``imagefolder`` (class folders).  Captions come from ``caption_col``
    or, with ``label_col`` (a ClassLabel), from templates over the class name.
    """
    import os

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import datasets

    path = Path(path)
    if not path.exists():
        raise ConfigError(f"dataset not found: {path}")
    try:
        if fmt == "disk":
            ds = datasets.load_from_disk(str(path))
        elif fmt == "parquet":
            files = [str(p) for p in sorted(path.glob("*.parquet"))] if path.is_dir() else [str(path)]
            ds = datasets.load_dataset("parquet", data_files=files)
        elif fmt == "imagefolder":
            ds = datasets.load_dataset("imagefolder", data_dir=str(path))
        else:
            raise ConfigError(f"unknown dataset format {fmt!r} (disk, parquet, imagefolder)")
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"dataset {path}: {str(e).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ConfigError(f"dataset {path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    if label_col is None and caption_col is not None and caption_col not in ds.column_names and "label" in ds.column_names:
        label_col, caption_col = "label", None  # imagefolder: captions from the folder names
    _columns(ds.column_names, {"image": image_col, "caption": caption_col, "label": label_col}, f"dataset {path}")
    if caption_col is None and label_col is None:
        raise ConfigError(f"dataset {path}: give a caption column or a label column")
    if isinstance(ds.features.get(image_col), datasets.Image):
        ds = ds.cast_column(image_col, datasets.Image(decode=False))  # keep the encoded bytes
    names = getattr(ds.features.get(label_col), "names", None) if label_col else None
    captioner = captioner or Captioner(load_templates("generic")["templates"], per_image=1)
    skip = {image_col}
    for row in ds:
        image = row[image_col]
        if isinstance(image, dict):
            image = image.get("bytes") or image.get("path")
        meta = {k: _plain(v) for k, v in row.items() if k not in skip and isinstance(_plain(v), (str, int, float, bool))}
        if label_col is not None:
            label = int(row[label_col])
            classname = names[label] if names else str(label)
            meta.update({"label": label, "classname": classname})
            captions = captioner(classname) if caption_col is None else []
        if caption_col is not None:
            captions = [line.strip() for line in str(row[caption_col] or "").splitlines() if line.strip()]
        yield Item(image, captions, meta)
