"""Pass 1 of ``mmalign curate``: each shard's samples embedded once, written per shard.

For input shard number ``u`` (its place in the ``--data`` list) the pass writes, into
``OUT/pool/``::

    u.parquet     one row per readable sample: key (the tar key without folders, as training
                  reports it), tar_key, index (in the shard), offset (of its first header),
                  clip_score, image_emb_id, text_emb_id (its first caption's row), captions,
                  caption (the first), image_sha256
    u.image.npy   (n, D) float16 L2-normalised image embeddings (row = image_emb_id)
    u.text.npy    (r, D) float16 L2-normalised caption embeddings (row = text_emb_id ...)
    u.phash.npy   (n, QUERIES + VIEWS, WORDS) uint64 perceptual hashes of each row's image
                  (:mod:`mmalign.data.phash`: its query hashes, then its index hashes)
    u.json        the shard's counts: samples, readable, skipped by reason, ended_early,
                  the .json field names seen, seconds, ``phash_version``; and ``source``, the
                  input's fingerprint (:mod:`.fingerprint`: size, mtime, sha256) that a rerun checks

Without a model (no policy needs one) the pass hashes only: no embeddings (``dim`` 0, empty
``.npy`` files), clip_score NaN.

The CLIP score of a sample is the cosine of its image with its caption, computed from the
float32 embeddings before they are stored as float16 (a sample with several captions: the
mean over them). ``u.json`` is written last, and every file goes through a temporary name and
a rename: a shard counts as done only when its ``u.json`` exists, so a run killed at any point
re-embeds exactly the shards that have no ``u.json`` (:func:`done_shards`).

Bad samples are skipped and counted by the reason training gives them
(:data:`mmalign.data.shards.REASONS`); a shard that ends early keeps its readable samples.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path

import numpy as np

from data_pipelines.curate.scores import clip_scores
from mmalign.data import phash

HASH_WIDTH = phash.QUERIES + phash.VIEWS  # hashes in a u.phash.npy row: the queries, then the index

log = logging.getLogger("mmalign.curate")

POOL = "pool"
COLUMNS = [
    "key",
    "tar_key",
    "index",
    "offset",
    "clip_score",
    "image_emb_id",
    "text_emb_id",
    "captions",
    "caption",
    "image_sha256",
]


def shard_files(out: Path, u: int) -> dict[str, Path]:
    base = out / POOL / f"{u:05d}"
    return {
        "parquet": base.with_suffix(".parquet"),
        "image": Path(f"{base}.image.npy"),
        "text": Path(f"{base}.text.npy"),
        "stats": base.with_suffix(".json"),
        "phash": Path(f"{base}.phash.npy"),
    }


def done_shards(out: Path, n: int) -> set[int]:
    """The shard numbers whose pass-1 output is complete (their stats file exists)."""
    return {u for u in range(n) if shard_files(out, u)["stats"].is_file()}


def hash_rows(images: list) -> np.ndarray:
    """PIL images -> (n, HASH_WIDTH, WORDS) uint64: each image's ``u.phash.npy`` row."""
    query, index = phash.hash_images(images)  # (n, Q, W), (n, V, W)
    return np.concatenate([query, index], axis=1)


def split_hashes(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(N, HASH_WIDTH, W) ``u.phash.npy`` rows -> the query hashes (N, Q, W) and the index hashes (N, V, W)."""
    return rows[:, : phash.QUERIES], rows[:, phash.QUERIES :]


def _atomic(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    write(tmp)
    os.replace(tmp, path)


def _save(path: Path, array: np.ndarray) -> None:
    with open(path, "wb") as f:  # np.save on a name would append ".npy" to the temporary name
        np.save(f, array)


class ShardEmbedder:
    """Embeds and hashes one shard at a time with a loaded model (:func:`mmalign.models.load.load`);
    ``loaded=None``: hashes only."""

    def __init__(self, loaded, *, batch_size: int = 64, device: str = "cpu", max_pixels: int | None = None):
        self.loaded, self.batch_size, self.device, self.max_pixels = (
            loaded,
            int(batch_size),
            device,
            max_pixels,
        )

    def encode_images(self, images: list) -> np.ndarray:
        """(b, D) float32 L2-normalised embeddings of ``b`` RGB PIL images, one forward."""
        import torch  # here, not at import: `mmalign curate` checks its paths before torch's seconds
        import torch.nn.functional as F

        with torch.inference_mode():
            pixels = torch.stack([self.loaded.preprocess(im) for im in images]).to(
                self.device
            )  # (b, 3, S, S)
            return F.normalize(self.loaded.model.encode_image(pixels).float(), dim=-1).cpu().numpy()

    def _encode(self, images: list, captions: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        import torch
        import torch.nn.functional as F

        img = self.encode_images(images)  # (b, D)
        model = self.loaded.model
        with torch.inference_mode():
            flat = [c for caps in captions for c in caps]
            txt = torch.cat(
                [
                    model.encode_text(
                        self.loaded.tokenizer(flat[i : i + self.batch_size]).to(self.device)
                    ).float()
                    for i in range(0, len(flat), self.batch_size)
                ]
            )
            return img, F.normalize(txt, dim=-1).cpu().numpy()  # (b, D), (r, D) float32

    def embed(self, url: str, u: int, out: Path, progress=None) -> dict:
        """Write shard ``u``'s pass-1 files (module docstring); returns its stats."""
        from data_pipelines.curate.fingerprint import fingerprint
        from mmalign.data.shards import BadSample, decode_sample, iter_tar_groups
        from mmalign.data.tario import CorruptTar, TruncatedTar

        start = time.time()
        try:
            source = fingerprint(
                url
            )  # what these embeddings are of: a rerun compares it (fingerprint.changed)
        except OSError:
            source = None  # unreadable: the read below says so, and the shard ends early
        rows: list[dict] = []
        images: list[np.ndarray] = []
        texts: list[np.ndarray] = []
        scores: list[np.ndarray] = []
        hashes: list[np.ndarray] = []
        skipped: dict[str, int] = {}
        fields: set[str] = set()
        samples, ended_early = 0, None
        pending: list[tuple[dict, object, list[str]]] = []

        def flush() -> None:
            if not pending:
                return
            hashes.append(hash_rows([p[1] for p in pending]))  # (b, Q + V, W)
            counts = [len(p[2]) for p in pending]
            starts = np.cumsum([0] + counts[:-1])
            if self.loaded is None:  # hashes only: (b, 0) and (r, 0) embeddings keep the row bookkeeping
                img, txt = np.zeros((len(pending), 0), np.float32), np.zeros((sum(counts), 0), np.float32)
                score = np.full(len(pending), np.nan)
            else:
                img, txt = self._encode([p[1] for p in pending], [p[2] for p in pending])
                owner = np.repeat(np.arange(len(pending)), counts)  # (r,) caption row -> sample
                per_caption = clip_scores(img[owner], txt)  # (r,) cosine of each caption with its image
                score = np.add.reduceat(per_caption.astype(np.float64), starts) / np.asarray(counts)  # (b,)
            text_base = sum(t.shape[0] for t in texts)
            for (row, _, _), first in zip(pending, starts.tolist()):
                row["text_emb_id"] = text_base + first
            images.append(img.astype(np.float16))
            texts.append(txt.astype(np.float16))
            scores.append(score.astype(np.float32))
            pending.clear()

        try:
            for raw in iter_tar_groups(url):
                samples += 1
                if progress is not None:
                    progress()
                try:
                    sample = decode_sample(raw, self.max_pixels)
                except BadSample as e:
                    skipped[e.reason] = skipped.get(e.reason, 0) + 1
                    if sum(skipped.values()) <= 3:
                        log.warning("curate: skipped sample %s of %s: %s", raw["__key__"], url, e)
                    continue
                fields.update(sample["json"])
                image_bytes = next(raw[e] for e in ("jpg", "jpeg", "png", "webp") if e in raw)
                row = {
                    "key": raw["__key__"].rsplit("/", 1)[-1],
                    "tar_key": raw["__key__"],
                    "index": samples - 1,
                    "offset": int(raw["__offset__"]),
                    "image_emb_id": len(rows),
                    "captions": len(sample["captions"]),
                    "caption": sample["captions"][0],
                    "image_sha256": hashlib.sha256(image_bytes).hexdigest(),
                }
                rows.append(row)
                pending.append((row, sample["image"].convert("RGB"), sample["captions"]))
                if len(pending) == self.batch_size:
                    flush()
        except (TruncatedTar, CorruptTar, OSError) as e:
            ended_early = f"{type(e).__name__}: {e}"
            log.warning(
                "curate: shard %s ended early (%s); its %d readable samples are kept",
                url,
                ended_early,
                len(rows),
            )
        flush()
        dim = 0 if self.loaded is None else int(self.loaded.model.embed_dim)
        score = np.concatenate(scores) if scores else np.zeros(0, np.float32)
        for row, s in zip(rows, score.tolist()):
            row["clip_score"] = s
        stacked = np.concatenate(hashes) if hashes else np.zeros((0, HASH_WIDTH, phash.WORDS), np.uint64)
        self._write(out, u, rows, images, texts, dim)
        _atomic(shard_files(out, u)["phash"], lambda p: _save(p, stacked))
        stats = {
            "url": url,
            "source": source,
            "samples": samples,
            "readable": len(rows),
            "skipped": dict(sorted(skipped.items())),
            "ended_early": ended_early,
            "fields": sorted(fields),
            "dim": dim,
            "phash_version": phash.VERSION,
            "seconds": round(time.time() - start, 3),
        }
        _atomic(shard_files(out, u)["stats"], lambda p: p.write_text(json.dumps(stats, indent=1)))
        return stats

    @staticmethod
    def _write(out: Path, u: int, rows: list[dict], images: list, texts: list, dim: int) -> None:
        import pandas as pd

        files = shard_files(out, u)
        files["parquet"].parent.mkdir(parents=True, exist_ok=True)
        frame = pd.DataFrame(rows, columns=COLUMNS)
        for col, dtype in (
            ("index", "int64"),
            ("offset", "int64"),
            ("image_emb_id", "int64"),
            ("text_emb_id", "int64"),
            ("captions", "int32"),
            ("clip_score", "float32"),
        ):
            frame[col] = frame[col].astype(dtype)

        def stack(parts):
            return np.concatenate(parts) if parts else np.zeros((0, dim), np.float16)

        _atomic(files["image"], lambda p: _save(p, stack(images)))
        _atomic(files["text"], lambda p: _save(p, stack(texts)))
        _atomic(files["parquet"], lambda p: frame.to_parquet(p, index=False))
