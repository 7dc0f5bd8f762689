"""Class folders (``root/CLASS/*.jpg``, as a directory or a tar) as captioned items.

The shard builder (``mmalign shards imagefolder``) and the imagefolder eval suites
enumerate a folder the same way (class order, sample order, keys), so it lives in
the library and the builder imports it. A :class:`Item` holds the image as encoded
bytes or as a file path (read later, in an encoder process), one or more captions,
and metadata for ``.json``. A folder that cannot be read is a one-line
:class:`~mmalign.errors.UsageError`.
"""

from __future__ import annotations

import random
import sys
import tarfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from mmalign.errors import UsageError
from mmalign.progress import Counted

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclass
class Item:
    image: bytes | str  # encoded bytes, or a path the encoder reads
    captions: list[str]
    meta: dict = field(default_factory=dict)


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


def _class_items(
    pairs: Iterator[tuple[str, str, bytes | str]], classnames: list[str], captioner: Captioner
) -> Iterator[Item]:
    index = {c: i for i, c in enumerate(classnames)}
    for name, relpath, image in pairs:
        # source_path: where the sample came from inside the folder or tar, so a hit can be traced back
        yield Item(image, captioner(name), {"label": index[name], "classname": name, "source_path": relpath})


def _relpath(name: str) -> str:
    """``./cat/0001.jpg`` -> ``cat/0001.jpg`` (the class folder and the file)."""
    return "/".join(Path(name).parts[-2:])


def image_folder(
    path: str | Path,
    captioner: Captioner,
    classnames: list[str] | None = None,
    shuffle_seed: int | None = None,
    only: list[str] | None = None,
    limit: int | None = None,
) -> tuple[list[str], Counted]:
    """``root/CLASS/*.jpg`` as a directory or a tar (``./cat/0001.jpg``).

    Class ids follow ``classnames`` when a template set gives them (CIFAR-10's label
    order), else the sorted folder names.  Items come in folder order, or, with
    ``shuffle_seed``, in a seeded random order: class folders are sorted, so shards
    written in folder order hold one class each and every "first N" reader sees one
    class.  ``only``: the images of these classes alone (their ids stay those of the full
    class list, so a model trained on a subset is scored with the same labels; the other
    images are never read).  ``limit``: the first N images of each class, in folder order (a
    directory's sorted file names, a tar's member order), before any shuffle.  Returns (class
    names, items).
    """
    path = Path(path)
    if not path.exists():
        raise UsageError(f"image folder not found: {path}")
    files: list  # a directory's (class folder, file) pairs; a tar's member names
    pairs: Iterator[tuple[str, str, str | bytes]]  # (class folder, relative name, file path or image bytes)
    if path.is_dir():
        folders = sorted(p.name for p in path.iterdir() if p.is_dir())
        _check_only(path, only, folders)
        files = [
            (d, f)
            for d in folders
            if only is None or d in only
            for f in sorted((path / d).iterdir())
            if f.suffix.lower() in IMAGE_SUFFIXES
        ]
        files = _first_per_class(files, lambda df: df[0], limit)
        if shuffle_seed is not None:
            random.Random(shuffle_seed).shuffle(files)
        pairs = ((d, f"{d}/{f.name}", str(f)) for d, f in files)
        found = folders
    else:
        try:
            with tarfile.open(path) as tar:
                names = [m.name for m in tar.getmembers() if m.isfile()]
        except (tarfile.TarError, OSError) as e:
            raise UsageError(f"image folder {path}: not a directory or a readable tar ({e})") from None
        names = _safe_names(path, names)
        files = [n for n in names if Path(n).suffix.lower() in IMAGE_SUFFIXES and len(Path(n).parts) >= 2]
        found = sorted({Path(n).parts[-2] for n in files})
        _check_only(path, only, found)
        files = [n for n in files if only is None or Path(n).parts[-2] in only]
        files = _first_per_class(files, lambda n: Path(n).parts[-2], limit)
        if shuffle_seed is None:
            pairs = _tar_pairs(path, files)
        else:
            random.Random(shuffle_seed).shuffle(files)
            pairs = _tar_pairs_in_order(path, files)
    if not found:
        raise UsageError(f"image folder {path}: no class subfolders with images")
    names = list(classnames) if classnames else found
    unknown = sorted(set(found) - set(names))
    if unknown:
        raise UsageError(
            f"image folder {path}: folders {unknown[:3]} are not in the template set's classnames"
        )
    return names, Counted(_class_items(pairs, names, captioner), len(files))  # one item per image file


def _first_per_class(files: list, class_of, limit: int | None) -> list:
    """The first ``limit`` of ``files`` per class (all of them when ``limit`` is None), in order."""
    if limit is None:
        return files
    seen: dict[str, int] = {}
    kept = []
    for f in files:
        c = class_of(f)
        if seen.get(c, 0) < limit:
            seen[c] = seen.get(c, 0) + 1
            kept.append(f)
    return kept


def _safe_names(path: Path, names: list[str]) -> list[str]:
    """The member names that stay inside the folder; the others (``../x.jpg``, ``/x.jpg``) are
    skipped, counted on one line (never read: their class would be "..")."""
    from mmalign.data.tario import unsafe_name

    unsafe = [n for n in names if unsafe_name(n)]
    if unsafe:
        print(
            f"mmalign: image folder {path}: skipped {len(unsafe)} member(s) with an unsafe name (outside the "
            f"folder, e.g. {unsafe[0]!r})",
            file=sys.stderr,
            flush=True,
        )
    return [n for n in names if not unsafe_name(n)]


def _check_only(path: Path, only: list[str] | None, found: list[str]) -> None:
    missing = sorted(set(only or ()) - set(found))
    if missing:
        raise UsageError(f"image folder {path}: no class folders {missing[:3]} (found: {', '.join(found)})")


def _member_bytes(tar: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    f = tar.extractfile(member)
    assert f is not None  # a regular file: the callers listed files only
    return f.read()


def _tar_pairs(path: Path, files: list[str]) -> Iterator[tuple[str, str, bytes]]:
    """One sequential pass in archive order (deterministic, nothing held in memory)."""
    wanted = set(files)
    with tarfile.open(path, "r|*") as tar:
        for member in tar:
            if member.isfile() and member.name in wanted:
                yield Path(member.name).parts[-2], _relpath(member.name), _member_bytes(tar, member)


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
                    held[member.name] = _member_bytes(stream, member)
        for name in files:
            yield Path(name).parts[-2], _relpath(name), held.pop(name)
        return
    with tar:
        members = {m.name: m for m in tar.getmembers()}  # tar.getmember(name) is a linear search
        for name in files:
            yield Path(name).parts[-2], _relpath(name), _member_bytes(tar, members[name])
