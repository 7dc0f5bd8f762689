"""Reading img2dataset-layout tar shards: ``KEY.jpg`` + ``KEY.txt`` + ``KEY.json``.

Shard specs expand with braces (``data/{00000..00099}.tar``); ``::`` joins specs.  A spec
is a local path, ``pipe:CMD``, an ``http(s)://`` URL or an fsspec URL (:mod:`mmalign.data.remote`).
Decoding a sample either returns it or raises :class:`BadSample` with a short
reason (the loader counts skips by reason, it never crashes on data).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import warnings
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from braceexpand import braceexpand
from PIL import Image

from mmalign.config import MAX_MEMBER_BYTES
from mmalign.data.image_shape import shape_problem
from mmalign.data.remote import RemoteOptions, check_backend, is_gzip_name, kind_of, local_path, probe
from mmalign.data.tario import CorruptTar, TruncatedTar, iter_samples, open_shard

log = logging.getLogger(__name__)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")

# The skip reasons, in the order a sample is checked.
REASONS = (
    "unreadable_shard",  # missing file, not a tar, bad header checksum
    "truncated_tar",  # the shard ends inside a member, or a remote one before its end blocks (once per read)
    "member_too_large",  # a member over data.max_member_bytes (never read into memory)
    "unsafe_name",  # a name extracting would write outside the folder (../x, /x): never read or copied
    "missing_image",
    "corrupt_image",
    "decompression_bomb",  # more pixels than data.max_image_pixels
    "extreme_aspect",  # thinner than image_shape.MAX_ASPECT:1 (a resize would blow it up), from the header
    "bad_json",
    "caption_not_utf8",
    "missing_caption",  # no .txt and no caption list in .json
    "empty_caption",
    "missing_id",  # data.id_field absent from .json
    "bad_hard_negatives",  # data.hard_negatives > 0 and .json "hard_negatives" is not a list of captions
    "missing_teacher",  # loss.distill.teacher: stored and a teacher_*.npy member absent
    "bad_teacher",  # a teacher_*.npy member that is no finite (D,) / (1,) float array
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


REMOTE_SAMPLE = 100  # remote shards probed at start-up (spread over the list): not one request per shard
_checked: set[str] = set()  # digests of shard lists already checked in this process


def _digest(urls: list[str]) -> str:
    return hashlib.sha256("\n".join(urls).encode()).hexdigest()


def _spread(items: list, n: int) -> list:
    """``n`` items evenly spread over ``items`` (first and last included), in order."""
    if len(items) <= n:
        return list(items)
    return [items[round(i * (len(items) - 1) / (n - 1))] for i in range(n)]


# files a user may give where shards belong: `mmalign shards table` turns them into shards
TABLE_EXTS = (".csv", ".tsv", ".parquet", ".jsonl", ".json", ".feather", ".arrow", ".xlsx")


def check_local(urls: list[str], what: str) -> None:
    """The part of :func:`check_urls` that needs no network and no torch: every local shard
    exists and none is a table (``mmalign train`` runs it before importing torch)."""
    from mmalign.config import ConfigError

    if not urls:
        raise ConfigError(f"config key '{what}': no shards given")
    missing = [u for u in urls if kind_of(u) == "local" and not Path(local_path(u)).exists()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ConfigError(f"config key '{what}': shard not found: {missing[0]}{more}")
    table = next((u for u in urls if kind_of(u) == "local" and u.lower().endswith(TABLE_EXTS)), None)
    if table is not None:  # read as a tar it would be "0 samples" after the whole start-up
        raise ConfigError(
            f"config key '{what}': {table} is a table, not WebDataset shards: build shards from it "
            f"with `mmalign shards table --input {table} --image-col COL --caption-col COL "
            f"--out DIR`, then give DIR's .tar files"
        )


def check_urls(urls: list[str], what: str, remote: RemoteOptions | None = None) -> None:
    """A one-line ConfigError naming ``what`` unless every local shard exists and a sample
    of the remote ones (``REMOTE_SAMPLE``, probed in parallel) can be read.  A list that
    passed is not checked again in this process."""
    from mmalign.config import ConfigError

    if _digest(urls) in _checked:
        return
    check_local(urls, what)  # an empty list, a missing local shard, a table
    remote_urls = [u for u in urls if kind_of(u) != "local"]
    schemes = {u.split("://", 1)[0].lower(): u for u in remote_urls if kind_of(u) == "fsspec"}
    for url in schemes.values():
        check_backend(url, what)
    sample = _spread(remote_urls, REMOTE_SAMPLE)
    if sample:
        log.info(
            "%s: probing %d of %d remote shard(s) (each read has data.remote_timeout, then retries)",
            what,
            len(sample),
            len(remote_urls),
        )  # a dead server takes that long: said first
        problems = _probe_all(sample, remote)
        if problems:
            url, why = problems[0]
            raise ConfigError(
                f"config key '{what}': shard not readable: {url} ({why}; "
                f"{len(problems)} of {len(sample)} sampled remote shard(s) failed)"
            )
    _checked.add(_digest(urls))


def _probe_all(urls: list[str], remote: RemoteOptions | None) -> list[tuple[str, str]]:
    """(url, why) of the shards that cannot be read; stops starting probes after the first failure."""
    problems: list[tuple[str, str]] = []
    with ThreadPoolExecutor(max_workers=min(8, len(urls))) as pool:
        futures = {pool.submit(probe, url, remote): url for url in urls}
        for future in as_completed(futures):
            if future.cancelled():
                continue
            why = future.result()
            if why is not None:
                problems.append((futures[future], why))
                for other in futures:
                    other.cancel()
    return sorted(problems, key=lambda p: urls.index(p[0]))


def train_shard_lists(data) -> list[tuple[list[str], str]]:
    """(shards, config key) as the training loader checks them: data.train whole, or one list per
    weighted source."""
    specs = data.train if isinstance(data.train, list) else [data.train]
    if data.train_weights is None:
        return [(expand_urls(specs), "data.train")]
    return [(expand_urls(spec), f"data.train[{i}]") for i, spec in enumerate(specs)]


def check_train_shards(data, rank: int = 0, broadcast=lambda problem: problem) -> None:
    """Rank 0 checks data.train's shards; ``broadcast`` (rank 0's value to every rank) shares the
    outcome, so start-up does not stat every shard once per rank (and again in the loader:
    the lists are marked checked on every rank)."""
    from mmalign.config import ConfigError

    lists = train_shard_lists(data)
    problem = None
    if rank == 0:
        options = RemoteOptions(data.remote_retries, data.remote_backoff, data.remote_timeout)
        try:
            for urls, what in lists:
                check_urls(urls, what, options)
        except ConfigError as e:
            problem = str(e)
    problem = broadcast(problem)
    if problem is not None:
        raise ConfigError(problem)
    for urls, _what in lists:
        _checked.add(_digest(urls))
    gz = next((u for urls, _ in lists for u in urls if is_gzip_name(u)), None)
    if gz is not None and rank == 0:
        log.warning(
            "data.train has gzip shards (%s): a checkpoint cannot resume the data stream inside "
            "them exactly; store shards as plain .tar",
            gz,
        )


def open_image(
    data: bytes, max_pixels: int | None = None, prepare: Callable[[Image.Image], object] | None = None
) -> Image.Image:
    """Bytes -> a loaded PIL image, or BadSample (corrupt_image / decompression_bomb / extreme_aspect).

    The pixel count and the aspect ratio are checked from the header before any pixel is
    decoded, so a bomb or a 1 x N strip costs nothing; PIL's own limit (``Image.MAX_IMAGE_PIXELS``, set by the
    loader from ``data.max_image_pixels``) is the backstop.  ``prepare`` sees the image
    after its header is read and before it is decoded (a JPEG draft).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            if max_pixels is not None and image.width * image.height > max_pixels:
                raise BadSample("decompression_bomb", f"{image.width}x{image.height} > {max_pixels} pixels")
            thin = shape_problem(image.width, image.height)
            if thin is not None:
                raise BadSample("extreme_aspect", thin)
            if prepare is not None:
                prepare(image)
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
    if raw.get("__unsafe__"):
        raise BadSample("unsafe_name", f"{raw['__key__']!r} would extract outside its folder")
    if raw.get("__oversized__"):
        raise BadSample(
            "member_too_large", ", ".join(f".{e} {n} bytes" for e, n in raw["__oversized__"].items())
        )
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
            extra: dict[str, Any] = {"__oversized__": sample.oversized} if sample.oversized else {}
            if sample.unsafe:
                extra["__unsafe__"] = True  # decode_sample's unsafe_name skip
            yield {
                "__key__": sample.key,
                "__url__": path,
                "__offset__": sample.offset,
                **sample.members,
                **extra,
            }


def read_samples(
    urls: list[str], max_member: int = MAX_MEMBER_BYTES, keep: set | None = None, locate: bool = False
) -> Iterator[dict]:
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


def shard_total(data: str | Path) -> int | None:
    """The number of samples in ``data``'s shards from their folders' ``sizes.json`` (written
    by the shard builders), None when a shard is not listed or ``data`` is not shards."""
    path = Path(str(data))
    urls = sorted(str(p) for p in path.glob("*.tar")) if path.is_dir() else expand_urls(str(data))
    total, listings = 0, {}
    for url in urls:
        folder = Path(url).parent
        if folder not in listings:
            try:
                listings[folder] = json.loads((folder / "sizes.json").read_text())
            except (OSError, ValueError):
                return None
        count = listings[folder].get(Path(url).name) if isinstance(listings[folder], dict) else None
        if not isinstance(count, int):
            return None
        total += count
    return total or None
