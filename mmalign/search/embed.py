"""``mmalign embed``: a dataset -> embeddings in clip-retrieval's layout, streamed.

Output (``N`` = part number)::

    OUT/img_emb/img_emb_N.npy         (rows, D) float16, L2-normalised
    OUT/text_emb/text_emb_N.npy       (rows, D) float16, L2-normalised (absent for image-only folders)
    OUT/metadata/metadata_N.parquet   key, caption, caption_index, json, source_path, file, offset
                                      (row-aligned with both)
    OUT/embed.json                    model, dim, rows, images, parts, layout

``source_path`` is where the sample came from (``cat/0001.jpg``: the ``.json``'s
``source_path``, which ``mmalign shards`` writes, or the image's path in an image
folder), null when unknown.  ``file`` and ``offset`` locate the image for a later
look (the search page's thumbnails): the tar shard and the byte offset of the sample's
first header, or an image folder's file itself with offset -1.  clip-retrieval reads the
first four columns and ignores the rest.

One row per (image, caption) pair, so an image with two captions fills two rows that
share its image embedding; ``caption_index == 0`` marks an image's first row (the
index builder indexes each image once).  This keeps the three files row-aligned, as
clip-retrieval expects, without dropping captions that retrieval metrics count.

Memory is bounded: a part is written every ``part_size`` rows and only one batch of
images is decoded at a time, so a run holds O(part_size x D) floats however large
the dataset.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mmalign.data.shards import shard_total  # noqa: F401 (re-exported: its old home)
from mmalign.errors import UsageError
from mmalign.progress import track

log = logging.getLogger("mmalign.search.embed")

EMBED_INFO = "embed.json"
FOLDER_IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
METADATA_COLUMNS = ["key", "caption", "caption_index", "json", "source_path", "file", "offset"]


# ------------------------------------------------------------------ inputs


def _folder_samples(root: Path, with_text: bool) -> Iterator[dict]:
    """Images under ``root`` (sorted), each with its sibling ``.txt`` captions and ``.json``."""
    from PIL import Image

    from mmalign.data.image_shape import shape_problem

    for path in sorted(p for p in root.rglob("*") if p.suffix.lower() in FOLDER_IMAGE_EXTS):
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
        source = meta.get("source_path")
        yield {
            "key": key,
            "image": image,
            "captions": captions,
            "json": meta,
            "source_path": source if isinstance(source, str) else path.relative_to(root).as_posix(),
            "file": str(path.resolve()),
            "offset": -1,
        }


def open_data(data: str | Path) -> tuple[Iterator[dict], bool]:
    """``--data`` -> (samples, has_text).  A shard spec (``dir/{00000..00009}.tar``), a
    directory of ``.tar`` shards, or a folder of images with optional ``.txt`` captions."""
    from mmalign.data.shards import check_urls, expand_urls, read_samples

    path = Path(str(data))
    if path.is_dir():
        tars = sorted(str(p) for p in path.glob("*.tar"))
        if tars:
            return _located(read_samples(tars, locate=True)), True
        images = [p for p in path.rglob("*") if p.suffix.lower() in FOLDER_IMAGE_EXTS]
        if not images:
            raise UsageError(f"--data: {path} holds no .tar shards and no images")
        with_text = any(p.with_suffix(".txt").is_file() for p in images)
        return _folder_samples(path, with_text), with_text
    urls = expand_urls(str(data))
    check_urls(urls, "--data")
    return _located(read_samples(urls, locate=True)), True


def _located(samples: Iterator[dict]) -> Iterator[dict]:
    """Shard samples -> with ``source_path`` (from their ``.json``) and ``file`` (the shard, absolute)."""
    for s in samples:
        shard, source = s.pop("shard"), s["json"].get("source_path")
        yield {
            **s,
            "source_path": source if isinstance(source, str) else None,
            "file": str(Path(shard).resolve()),
        }


# ----------------------------------------------------------------- writing


class _PartWriter:
    """Buffers rows and writes ``*_N`` files every ``part_size`` rows."""

    def __init__(self, out: Path, part_size: int, with_text: bool):
        self.out, self.part_size, self.with_text = out, int(part_size), with_text
        self.img: list[np.ndarray] = []
        self.txt: list[np.ndarray] = []
        self.meta: list[dict] = []
        self.parts = 0
        self.rows = 0
        for sub in ("img_emb", "metadata") + (("text_emb",) if with_text else ()):
            (out / sub).mkdir(parents=True, exist_ok=True)

    def add(self, img: np.ndarray, txt: np.ndarray | None, meta: list[dict]) -> None:
        self.img.append(img)
        if txt is not None:
            self.txt.append(txt)
        self.meta.extend(meta)
        while len(self.meta) >= self.part_size:
            self._flush(self.part_size)

    def _flush(self, n: int) -> None:
        import pandas as pd

        img = np.concatenate(self.img)
        np.save(self.out / "img_emb" / f"img_emb_{self.parts}.npy", img[:n])
        self.img = [img[n:]]
        if self.with_text:
            txt = np.concatenate(self.txt)
            np.save(self.out / "text_emb" / f"text_emb_{self.parts}.npy", txt[:n])
            self.txt = [txt[n:]]
        frame = pd.DataFrame(self.meta[:n], columns=METADATA_COLUMNS)
        frame["caption_index"] = frame["caption_index"].astype("int32")
        frame["offset"] = frame["offset"].astype("int64")
        frame.to_parquet(self.out / "metadata" / f"metadata_{self.parts}.parquet", index=False)
        self.meta = self.meta[n:]
        self.parts += 1
        self.rows += n

    def close(self) -> None:
        if self.meta:
            self._flush(len(self.meta))


# --------------------------------------------------------------- embedding


@torch.no_grad()
def _encode_batch(
    model, samples: list[dict], preprocess, tokenizer, with_text: bool, device: str, batch_size: int
):
    images = torch.stack([preprocess(s["image"]) for s in samples]).to(device)  # (b, 3, S, S)
    img = F.normalize(model.encode_image(images).float(), dim=-1).cpu()  # (b, D)
    owner = [i for i, s in enumerate(samples) for _ in s["captions"]]  # row -> sample in batch
    rows_img = img[owner].half().numpy()  # (r, D): one row per caption
    rows_txt = None
    if with_text:
        captions = [c for s in samples for c in s["captions"]]
        chunks = [
            model.encode_text(tokenizer(captions[i : i + batch_size]).to(device)).float()
            for i in range(0, len(captions), batch_size)
        ]
        rows_txt = F.normalize(torch.cat(chunks), dim=-1).cpu().half().numpy()  # (r, D)
    meta = [
        {
            "key": s["key"],
            "caption": c,
            "caption_index": j,
            "json": json.dumps(s["json"], sort_keys=True),
            "source_path": s["source_path"],
            "file": s["file"],
            "offset": s["offset"],
        }
        for s in samples
        for j, c in enumerate(s["captions"])
    ]
    return rows_img, rows_txt, meta


def embed(
    model_dir: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    batch_size: int = 64,
    part_size: int = 100_000,
    device: str = "cpu",
    progress: bool = True,
) -> dict:
    """Embed every sample of ``data`` with the model in ``model_dir``; returns ``embed.json``'s content."""
    from mmalign.models.load import load

    if batch_size <= 0 or part_size <= 0:
        raise UsageError("--batch-size and --part-size must be positive")
    source = load(model_dir, device=device)
    model, preprocess = source.model, source.preprocess
    samples, with_text = open_data(data)
    out = Path(out)
    if (out / EMBED_INFO).exists():
        raise UsageError(f"--out: {out} already holds embeddings; choose an empty directory")
    writer = _PartWriter(out, part_size, with_text)
    images, batch = 0, []
    # a bar on a terminal, else a line every 10 s; the total comes from the shards' sizes.json
    samples = track(samples, "embedding", total=shard_total(data), unit="images", enabled=progress)
    for sample in samples:
        batch.append(sample)
        if len(batch) == batch_size:
            writer.add(
                *_encode_batch(model, batch, preprocess, source.tokenizer, with_text, device, batch_size)
            )
            images += len(batch)
            batch = []
    if batch:
        writer.add(*_encode_batch(model, batch, preprocess, source.tokenizer, with_text, device, batch_size))
        images += len(batch)
    writer.close()
    if images == 0:
        raise UsageError(f"--data: {data} holds no readable samples")
    info = {
        "model": str(model_dir),
        "dim": model.embed_dim,
        "rows": writer.rows,
        "images": images,
        "parts": writer.parts,
        "part_size": int(part_size),
        "dtype": "float16",
        "normalised": True,
        "text": with_text,
        "layout": "one row per (image, caption); caption_index 0 = an image's first row",
    }
    (out / EMBED_INFO).write_text(json.dumps(info, indent=2))
    return info
