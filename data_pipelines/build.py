"""Items -> img2dataset-layout shards: encode in a process pool, de-duplicate, write, report.

Encoders (one per process) read the image, optionally resize it, re-encode it as
JPEG (an RGB JPEG that needs no resize is stored as-is, byte for byte: re-encoding
would only lose quality) and hash the *source* bytes; the writer (this process) drops exact duplicates
by that sha256 and records every failure (unreadable or undecodable image, no
caption) in the shard's parquet and ``_stats.json``.  Output order is input order,
whatever the number of processes, so a build is reproducible.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import multiprocessing as mp
import operator
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from data_pipelines.sources import Item
from data_pipelines.writer import ShardWriter
from mmalign.data.image_shape import shape_problem
from mmalign.progress import track

log = logging.getLogger("mmalign.shards")

RESIZE_MODES = ("keep_ratio", "center_crop")


@dataclass(frozen=True)
class EncodeOptions:
    resize: int = 0  # 0 = keep the size; else the shorter side becomes this
    resize_mode: str = "keep_ratio"  # keep_ratio | center_crop (then square)
    quality: int = 92
    max_pixels: int = 89_478_485  # larger source images are failures, not decompression bombs


def encode(item: Item, opts: EncodeOptions) -> dict:
    """One item -> {"jpg", "width", "height", "source_sha256"} or {"error"} (runs in a pool)."""
    try:
        data = item.image
        if isinstance(data, str):
            with open(data, "rb") as f:
                data = f.read()
        sha = hashlib.sha256(data).hexdigest()
        if not item.captions:
            return {"error": "no caption", "source_sha256": sha}
        image: Image.Image = Image.open(io.BytesIO(data))
        if image.width * image.height > opts.max_pixels:
            return {"error": f"image too large ({image.width}x{image.height})", "source_sha256": sha}
        thin = shape_problem(image.width, image.height)  # a resize would blow a 1 x N strip up
        if thin is not None:
            return {"error": f"image too thin ({thin})", "source_sha256": sha}
        if image.format == "JPEG" and image.mode == "RGB" and not _needs_resize(image.size, opts):
            image.load()  # a truncated file is a failure here, as it would be when re-encoding
            return {"jpg": data, "width": image.width, "height": image.height, "source_sha256": sha}
        image = image.convert("RGB")
        if _needs_resize(image.size, opts):
            image = _resize(image, opts.resize, opts.resize_mode)
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=opts.quality)
        return {"jpg": buf.getvalue(), "width": image.width, "height": image.height, "source_sha256": sha}
    except Exception as e:  # a bad source image is a counted failure, never the end of a build
        return {"error": f"{type(e).__name__}: {e}"}


def _needs_resize(size: tuple[int, int], opts: EncodeOptions) -> bool:
    w, h = size
    if not opts.resize:
        return False
    return min(w, h) != opts.resize or (opts.resize_mode == "center_crop" and w != h)


def _resize(image: Image.Image, size: int, mode: str) -> Image.Image:
    w, h = image.size
    scale = size / min(w, h)
    image = image.resize((max(1, round(w * scale)), max(1, round(h * scale))), Image.Resampling.BICUBIC)
    if mode == "center_crop":
        w, h = image.size
        left, top = (w - size) // 2, (h - size) // 2
        image = image.crop((left, top, left + size, top + size))
    return image


def _encode_one(args: tuple[Item, EncodeOptions]) -> tuple[list[str], dict, dict, dict]:
    """Pool task: hand back only what the writer needs (not the source bytes)."""
    item, opts = args
    return item.captions, item.meta, _source_ref(item), encode(item, opts)


def build_shards(
    items: Iterable[Item],
    out_dir: str | Path,
    *,
    per_shard: int = 1000,
    opts: EncodeOptions = EncodeOptions(),
    dedupe: bool = True,
    processes: int = 1,
    total: int | None = None,
    progress: bool = True,
    source: str = "",
) -> dict:
    """Write all ``items``; returns the summary also saved as ``out_dir/build.json``.

    The progress shows a total and an ETA when the count is known: ``total``, else the
    length of ``items`` when it has one (a list, or a source that states its length)."""
    out = Path(out_dir)
    if total is None:
        total = operator.length_hint(items) or None  # a generator: 0, unknown
    start = time.time()
    written = duplicates = failures = 0
    seen: set[str] = set()
    writer = ShardWriter(out, samples_per_shard=per_shard, jpeg_quality=opts.quality)
    work = ((item, opts) for item in items)
    pool = mp.get_context("fork").Pool(processes) if processes > 1 else None
    results = pool.imap(_encode_one, work, chunksize=16) if pool else map(_encode_one, work)
    # a bar on a terminal, a readable line every 10 s elsewhere (not tqdm's carriage returns)
    tracked = track(results, f"shards -> {out}", total=total, unit="images", enabled=progress)
    try:
        for captions, item_meta, ref, result in tracked:
            caption = "\n".join(captions)
            if "error" in result:
                failures += 1
                writer.fail(result["error"], {"caption": caption or None, **ref})
                continue
            sha = result["source_sha256"]
            if dedupe:
                if sha in seen:
                    duplicates += 1
                    continue
                seen.add(sha)
            meta = {**item_meta, **ref, "source_sha256": sha}
            writer.write_encoded(result["jpg"], caption, meta, width=result["width"], height=result["height"])
            written += 1
    finally:
        tracked.close()
        if pool:
            pool.close()
            pool.join()
        sizes = writer.close()
    summary = {
        "source": source,
        "written": written,
        "failures": failures,
        "duplicates_removed": duplicates,
        "shards": len(sizes),
        "per_shard": per_shard,
        "resize": opts.resize,
        "resize_mode": opts.resize_mode,
        "dedupe": dedupe,
        "seconds": round(time.time() - start, 2),
    }
    (out / "build.json").write_text(json.dumps(summary, indent=2))
    log.info("built %s: %s", out, summary)
    return summary


def _source_ref(item: Item) -> dict:
    """The source's own path for the sample (``cat/0001.jpg`` from class folders), else the file read."""
    if "source_path" in item.meta:
        return {"source_path": item.meta["source_path"]}
    return {"source_path": item.image} if isinstance(item.image, str) else {}
