"""What ``mmalign embed`` reads: ``--data`` as a list of work units, each a stream of samples.

A unit is one tar shard, or one slice of ``FOLDER_UNIT`` images of an image folder (sorted by
path). Units are what the ranks split (rank r takes units r, r + W, ...) and what a resumed run
skips when finished, so their list depends on ``--data`` alone, never on the number of ranks.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mmalign.errors import UsageError

log = logging.getLogger("mmalign.search.embed")

FOLDER_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
FOLDER_UNIT = 10_000  # images of an image folder per unit of work


@dataclass
class Units:
    """``--data`` split into units: ``names`` (a shard's url, or ``FOLDER[i:j]``) name them in
    the resume stamp and in lines; ``samples(u)`` streams unit ``u``'s samples in order."""

    names: list[str]
    with_text: bool
    shards: list[str] | None = None  # the tar urls (None for an image folder)
    root: Path | None = None  # an image folder
    images: list[Path] | None = None  # its images, sorted

    def samples(self, u: int) -> Iterator[dict]:
        from mmalign.data.shards import read_samples

        if self.shards is not None:
            return _located(read_samples([self.shards[u]], locate=True))
        assert self.root is not None and self.images is not None
        return _folder_samples(
            self.root, self.images[u * FOLDER_UNIT : (u + 1) * FOLDER_UNIT], self.with_text
        )

    def total(self, u: int) -> int | None:
        """Unit ``u``'s sample count when known (an image slice, a shard listed in ``sizes.json``)."""
        from mmalign.data.shards import shard_total

        if self.shards is None:
            assert self.images is not None
            return len(self.images[u * FOLDER_UNIT : (u + 1) * FOLDER_UNIT])
        url = self.shards[u]
        return None if "://" in url or url.startswith("pipe:") else shard_total(url)


def plan_units(data: str | Path) -> Units:
    """``--data`` -> its units: a shard spec (``dir/{00000..00009}.tar``), a directory of ``.tar``
    shards, or a folder of images with optional ``.txt`` captions and ``.json`` metadata."""
    from mmalign.data.shards import check_urls, expand_urls

    path = Path(str(data))
    if path.is_dir():
        tars = sorted(str(p) for p in path.glob("*.tar"))
        if tars:
            return Units(names=tars, with_text=True, shards=tars)
        images = sorted(p for p in path.rglob("*") if p.suffix.lower() in FOLDER_IMAGE_EXTS)
        if not images:
            raise UsageError(f"--data: {path} holds no .tar shards and no images")
        with_text = any(p.with_suffix(".txt").is_file() for p in images)
        n = -(-len(images) // FOLDER_UNIT)
        names = [f"{path}[{i * FOLDER_UNIT}:{min((i + 1) * FOLDER_UNIT, len(images))}]" for i in range(n)]
        return Units(names=names, with_text=with_text, root=path, images=images)
    urls = expand_urls(str(data))
    check_urls(urls, "--data")
    return Units(names=list(urls), with_text=True, shards=list(urls))


def open_data(data: str | Path) -> tuple[Iterator[dict], bool]:
    """``--data`` -> (every sample in order, has_text)."""
    units = plan_units(data)
    return (s for u in range(len(units.names)) for s in units.samples(u)), units.with_text


def _folder_samples(root: Path, images: list[Path], with_text: bool) -> Iterator[dict]:
    """``images`` (under ``root``), each with its sibling ``.txt`` captions and ``.json``."""
    from PIL import Image

    from mmalign.data.image_shape import shape_problem

    for path in images:
        key = path.relative_to(root).with_suffix("").as_posix()
        captions = [""]
        if with_text:
            txt = path.with_suffix(".txt")
            if not txt.is_file():
                raise UsageError(f"--data: {path} has no caption file {txt.name} (other images in {root} do)")
            captions = [line.strip() for line in txt.read_text(encoding="utf-8").splitlines() if line.strip()]
            if not captions:
                raise UsageError(f"--data: caption file {txt} is empty")
        meta_file = path.with_suffix(".json")
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
        try:
            image = Image.open(path)
            thin = shape_problem(*image.size)  # from the header: a 1 x N strip is never decoded or resized
            if thin is not None:
                raise ValueError(thin)
            image.load()
        except Exception as e:  # PIL raises many types for broken files
            log.warning("skipping unreadable image %s: %s", path, e)
            continue
        source = meta.get("source_path") if isinstance(meta, dict) else None
        yield {
            "key": key,
            "image": image,
            "captions": captions,
            "json": meta if isinstance(meta, dict) else {},
            "source_path": source if isinstance(source, str) else path.relative_to(root).as_posix(),
            "file": str(path.resolve()),
            "offset": -1,
        }


def _located(samples: Iterator[dict]) -> Iterator[dict]:
    """Shard samples -> with ``source_path`` (from their ``.json``) and ``file`` (the shard: a
    local one's absolute path, a remote one's URL)."""
    for s in samples:
        shard, source = s.pop("shard"), s["json"].get("source_path")
        remote = "://" in shard or shard.startswith("pipe:")
        yield {
            **s,
            "source_path": source if isinstance(source, str) else None,
            "file": shard if remote else str(Path(shard).resolve()),
        }
