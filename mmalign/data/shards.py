"""Reading img2dataset-layout tar shards: ``KEY.jpg`` + ``KEY.txt`` + ``KEY.json``.

Shard specs expand with braces (``data/{00000..00099}.tar``); ``::`` joins specs.
Decoding a sample either returns it or raises :class:`BadSample` with a short
reason (the loader counts skips by reason, it never crashes on data).
"""

from __future__ import annotations

import io
import json
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

from braceexpand import braceexpand
from PIL import Image

from mmalign.config import MAX_MEMBER_BYTES
from mmalign.data.tario import CorruptTar, TruncatedTar, iter_samples, open_shard

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")

# The skip reasons, in the order a sample is checked.
REASONS = (
    "unreadable_shard",  # missing file, not a tar, bad header checksum
    "truncated_tar",  # the shard ends inside a member (counted once per shard read)
    "member_too_large",  # a member over data.max_member_bytes (never read into memory)
    "missing_image",
    "corrupt_image",
    "decompression_bomb",  # more pixels than data.max_image_pixels
    "bad_json",
    "caption_not_utf8",
    "missing_caption",  # no .txt and no caption list in .json
    "empty_caption",
    "missing_id",  # data.id_field absent from .json
    "bad_hard_negatives",  # data.hard_negatives > 0 and .json "hard_negatives" is not a list of captions
)


class BadSample(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


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


def open_image(data: bytes, max_pixels: int | None = None) -> Image.Image:
    """Bytes -> a loaded PIL image, or BadSample (corrupt_image / decompression_bomb).

    The pixel count is checked from the header before any pixel is decoded, so a
    bomb costs nothing; PIL's own limit (``Image.MAX_IMAGE_PIXELS``, set by the
    loader from ``data.max_image_pixels``) is the backstop.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise BadSample("decompression_bomb", f"{image.width}x{image.height} > {max_pixels} pixels")
            image.load()
    except BadSample:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise BadSample("decompression_bomb", str(e).split(".")[0]) from None
    except Exception as e:  # PIL raises many types for broken files
        raise BadSample("corrupt_image", f"{type(e).__name__}: {e}") from None
    return image


def parse_captions(members: dict[str, bytes], meta: dict) -> list[str]:
    """Every non-empty caption: the lines of ``.txt``, else ``.json``'s ``captions`` list."""
    captions: list[str] = []
    if "txt" in members:
        try:
            text = members["txt"].decode("utf-8")
        except UnicodeDecodeError:
            raise BadSample("caption_not_utf8") from None
        captions = [line.strip() for line in text.splitlines() if line.strip()]
        if not captions:
            raise BadSample("empty_caption")
        return captions
    listed = meta.get("captions")
    if isinstance(listed, list):
        captions = [str(c).strip() for c in listed if str(c).strip()]
        if not captions:
            raise BadSample("empty_caption")
        return captions
    if isinstance(meta.get("caption"), str):  # img2dataset copies the caption into .json
        caption = meta["caption"].strip()
        if not caption:
            raise BadSample("empty_caption")
        return [caption]
    raise BadSample("missing_caption")


def parse_meta(members: dict[str, bytes]) -> dict:
    if "json" not in members:
        return {}
    try:
        meta = json.loads(members["json"].decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise BadSample("bad_json", str(e)) from None
    return meta if isinstance(meta, dict) else {}


def decode_sample(raw: dict, max_pixels: int | None = None) -> dict:
    """Raw member bytes -> ``{"key", "image" (PIL), "captions" (list[str]), "json"}``."""
    if raw.get("__oversized__"):
        raise BadSample("member_too_large", ", ".join(f".{e} {n} bytes" for e, n in raw["__oversized__"].items()))
    image_bytes = next((raw[e] for e in IMAGE_EXTS if e in raw), None)
    if image_bytes is None:
        raise BadSample("missing_image")
    meta = parse_meta(raw)
    captions = parse_captions(raw, meta)
    image = open_image(image_bytes, max_pixels)
    return {"key": Path(raw["__key__"]).name, "image": image, "captions": captions, "json": meta}


def iter_tar_groups(path: str, max_member: int = MAX_MEMBER_BYTES) -> Iterator[dict]:
    """Yield ``{"__key__", "__url__", "__offset__", ext: bytes, ...}`` for each sample of one tar
    (``__offset__``: the byte offset of the sample's first header, for re-reading it later).

    Members over ``max_member`` bytes are not read: they are listed (ext -> size) under
    ``"__oversized__"``, which :func:`decode_sample` turns into a ``member_too_large`` skip.
    Raises TruncatedTar / CorruptTar / OSError after the readable samples.
    """
    with open_shard(path) as f:
        for sample in iter_samples(f, max_member=max_member):
            extra = {"__oversized__": sample.oversized} if sample.oversized else {}
            yield {"__key__": sample.key, "__url__": path, "__offset__": sample.offset, **sample.members, **extra}


def read_samples(urls: list[str], max_member: int = MAX_MEMBER_BYTES, keep: set | None = None,
                 locate: bool = False) -> Iterator[dict]:
    """Every decodable sample of ``urls`` in order (evaluation sets); bad ones are logged and skipped.
    With ``keep``, only the samples whose (url, key) it holds are decoded.  With ``locate``,
    each sample also carries ``shard`` (its url) and ``offset`` (its first header's byte offset)."""
    for url in urls:
        try:
            for raw in iter_tar_groups(url, max_member):
                if keep is not None and (url, raw["__key__"]) not in keep:
                    continue
                try:
                    sample = decode_sample(raw)
                except BadSample as e:
                    log.warning("skipping sample %s in %s: %s", raw["__key__"], url, e)
                    continue
                if locate:
                    sample.update(shard=url, offset=raw["__offset__"])
                yield sample
        except (TruncatedTar, CorruptTar, OSError) as e:
            log.warning("shard %s ended early: %s", url, e)
