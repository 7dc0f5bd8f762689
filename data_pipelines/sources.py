"""Where shard samples come from: class folders, tables, Hugging Face datasets on disk.

Every source yields :class:`Item` objects: the image as encoded bytes or as a file
path (read later, in an encoder process), one or more captions, and metadata for
``.json``.  Sources only enumerate; decoding, resizing and writing happen in
:mod:`data_pipelines.build`.  A user mistake (a missing file, an unknown column)
raises ``UsageError`` with one line.
"""

from __future__ import annotations

from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import yaml

# Class-folder enumeration is shared with the imagefolder eval suites, so it lives in the library.
from mmalign.data.imagefolder import IMAGE_SUFFIXES, Captioner, Item, image_folder  # noqa: F401 (re-exported)
from mmalign.data.templates import check_templates
from mmalign.errors import UsageError
from mmalign.progress import Counted

# package data (pyproject.toml): found the same way in a checkout and in an installed wheel
TEMPLATE_DIR = Path(str(resources.files("data_pipelines") / "templates"))


def load_templates(name_or_path: str) -> dict:
    """A template set: ``templates`` (with ``{c}``) and optionally ``classnames``."""
    path = Path(name_or_path)
    if not path.is_file():
        path = TEMPLATE_DIR / f"{name_or_path}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in TEMPLATE_DIR.glob("*.yaml")))
        raise UsageError(f"unknown template set {name_or_path!r} (known: {known}, or a YAML path)")
    data = yaml.safe_load(path.read_text()) or {}
    templates = data.get("templates")
    if not isinstance(templates, list) or not templates or not all("{c}" in str(t) for t in templates):
        raise UsageError(
            f"template set {path}: 'templates' must be a non-empty list of strings containing {{c}}"
        )
    check_templates(
        templates, f"template set {path}"
    )  # {x}, {}, a lone {: one line here, not a KeyError later
    return data


def _columns(available: list[str], wanted: dict[str, str | None], what: str) -> None:
    for role, column in wanted.items():
        if column is not None and column not in available:
            raise UsageError(f"{what}: no column {column!r} for the {role} (columns: {', '.join(available)})")


def table(
    path: str | Path, image_col: str = "image", caption_col: str = "caption", root: str | None = None
) -> Counted:
    """CSV/TSV/parquet rows of (image path, caption, other columns -> .json).

    Relative image paths resolve against ``root`` (default: the table's folder); a
    caption cell may hold several captions, one per line.
    """
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"table not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".parquet":
        frame = pd.read_parquet(path)
    elif suffix in (".csv", ".tsv", ".txt"):
        frame = pd.read_csv(path, sep="\t" if suffix != ".csv" else ",", dtype=str, keep_default_na=False)
    else:
        raise UsageError(f"table {path}: expected .csv, .tsv or .parquet")
    _columns(list(frame.columns), {"image path": image_col, "caption": caption_col}, f"table {path}")
    base = Path(root) if root else path.parent
    extra = [c for c in frame.columns if c not in (image_col, caption_col)]
    return Counted(_table_items(frame, image_col, caption_col, base, extra), len(frame))


def _table_items(frame, image_col: str, caption_col: str, base: Path, extra: list[str]) -> Iterator[Item]:
    for row in frame.itertuples(index=False):
        record = dict(zip(frame.columns, row))
        image_path = Path(str(record[image_col]))
        caption = record[caption_col]
        captions = (
            [line.strip() for line in str(caption).splitlines() if line.strip()]
            if caption is not None
            else []
        )
        meta = {c: _plain(record[c]) for c in extra}
        yield Item(str(image_path if image_path.is_absolute() else base / image_path), captions, meta)


def _plain(value):
    """A JSON-able scalar (numpy scalars -> Python)."""
    if hasattr(value, "item"):
        return value.item()
    return value


def hf_dataset(
    path: str | Path,
    fmt: str = "disk",
    image_col: str = "image",
    caption_col: str | None = "caption",
    label_col: str | None = None,
    captioner: Captioner | None = None,
    split: str = "train",
) -> Counted:
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
        raise UsageError(f"dataset not found: {path}")
    try:
        if fmt == "disk":
            ds = datasets.load_from_disk(str(path))
        elif fmt == "parquet":
            files = [str(p) for p in sorted(path.glob("*.parquet"))] if path.is_dir() else [str(path)]
            ds = datasets.load_dataset("parquet", data_files=files)
        elif fmt == "imagefolder":
            ds = datasets.load_dataset("imagefolder", data_dir=str(path))
        else:
            raise UsageError(f"unknown dataset format {fmt!r} (disk, parquet, imagefolder)")
    except (FileNotFoundError, ValueError) as e:
        raise UsageError(f"dataset {path}: {str(e).splitlines()[0]}") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise UsageError(f"dataset {path}: no split {split!r} (splits: {', '.join(ds)})")
        ds = ds[split]
    if (
        label_col is None
        and caption_col is not None
        and caption_col not in ds.column_names
        and "label" in ds.column_names
    ):
        label_col, caption_col = "label", None  # imagefolder: captions from the folder names
    _columns(
        ds.column_names, {"image": image_col, "caption": caption_col, "label": label_col}, f"dataset {path}"
    )
    if caption_col is None and label_col is None:
        raise UsageError(f"dataset {path}: give a caption column or a label column")
    if isinstance(ds.features.get(image_col), datasets.Image):
        ds = ds.cast_column(image_col, datasets.Image(decode=False))  # keep the encoded bytes
    names = getattr(ds.features.get(label_col), "names", None) if label_col else None
    captioner = captioner or Captioner(load_templates("generic")["templates"], per_image=1)
    return Counted(_dataset_items(ds, image_col, caption_col, label_col, names, captioner), len(ds))


def _dataset_items(
    ds,
    image_col: str,
    caption_col: str | None,
    label_col: str | None,
    names: list[str] | None,
    captioner: Captioner,
) -> Iterator[Item]:
    skip = {image_col}
    for row in ds:
        image = row[image_col]
        if isinstance(image, dict):
            image = image.get("bytes") or image.get("path")
        meta = {
            k: _plain(v)
            for k, v in row.items()
            if k not in skip and isinstance(_plain(v), (str, int, float, bool))
        }
        if label_col is not None:
            label = int(row[label_col])
            classname = names[label] if names else str(label)
            meta.update({"label": label, "classname": classname})
            captions = captioner(classname) if caption_col is None else []
        if caption_col is not None:
            captions = [line.strip() for line in str(row[caption_col] or "").splitlines() if line.strip()]
        yield Item(image, captions, meta)
