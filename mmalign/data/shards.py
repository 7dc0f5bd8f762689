"""Reading img2dataset-layout tar shards: ``KEY.jpg`` + ``KEY.txt`` + ``KEY.json``.

A sample is the group of consecutive tar members that share a key (the basename up
to its first dot), as WebDataset defines it.
"""

from __future__ import annotations

import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

from braceexpand import braceexpand
from PIL import Image

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def expand_urls(spec: str | list[str]) -> list[str]:
    """``data/{00000..00009}.tar`` or a list of such specs -> shard paths, in order."""
    specs = [spec] if isinstance(spec, str) else list(spec)
    urls: list[str] = []
    for item in specs:
        for part in str(item).split("::"):
            urls.extend(braceexpand(part.strip()))
    return [u for u in urls if u]


def check_urls(urls: list[str], what: str) -> None:
    from mmalign.config import ConfigError

    if not urls:
        raise ConfigError(f"config key '{what}': no shards given")
    missing = [u for u in urls if "://" not in u and not Path(u).exists()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"config key '{what}': shard not found: {missing[0]}{more}")


def iter_tar_groups(path: str) -> Iterator[dict]:
    """Yield ``{"__key__", "__url__", ext: bytes, ...}`` for each sample of one tar."""
    current: dict | None = None
    with tarfile.open(path, "r|*") as tar:
        for member in tar:
            if not member.isfile():
                continue
            base = Path(member.name).name
            if "." not in base:
                continue
            prefix = str(Path(member.name).parent / base.split(".", 1)[0])
            ext = base.split(".", 1)[1].lower()
            data = tar.extractfile(member).read()
            if current is None or current["__key__"] != prefix:
                if current is not None:
                    yield current
                current = {"__key__": prefix, "__url__": path}
            current[ext] = data
    if current is not None:
        yield current


def decode_sample(raw: dict) -> dict:
    """Raw member bytes -> ``{"key", "image" (PIL), "captions" (list[str]), "json"}``."""
    image_bytes = next((raw[e] for e in IMAGE_EXTS if e in raw), None)
    if image_bytes is None:
        raise ValueError("no image member")
    image = Image.open(io.BytesIO(image_bytes))
    image.load()
    meta = json.loads(raw["json"].decode("utf-8")) if "json" in raw else {}
    captions: list[str] = []
    if "txt" in raw:
        captions = [line.strip() for line in raw["txt"].decode("utf-8").splitlines() if line.strip()]
    if not captions and isinstance(meta.get("captions"), list):
        captions = [str(c).strip() for c in meta["captions"] if str(c).strip()]
    if not captions:
        raise ValueError("no caption")
    return {"key": Path(raw["__key__"]).name, "image": image, "captions": captions, "json": meta}


def read_samples(urls: list[str]) -> Iterator[dict]:
    """Every decodable sample of ``urls`` in order (evaluation sets)."""
    for url in urls:
        for raw in iter_tar_groups(url):
            yield decode_sample(raw)
