"""``mmalign embed``: a dataset -> embeddings in clip-retrieval's layout, streamed, split over ranks.

Output (``N`` = part number, ``0 .. parts - 1``)::

    OUT/img_emb/img_emb_N.npy         (rows, D) float16, L2-normalised
    OUT/text_emb/text_emb_N.npy       (rows, D) float16, L2-normalised (absent for image-only folders)
    OUT/metadata/metadata_N.parquet   key, caption, caption_index, json, source_path, file, offset,
                                      then one column per field of the samples' .json
                                      (row-aligned with both; :mod:`.embed_parts`)
    OUT/embed.json                    model, dim, rows, images, parts, units, layout

``source_path`` is where the sample came from (``cat/0001.jpg``: the ``.json``'s
``source_path``, which ``mmalign shards`` writes, or the image's path in an image
folder), null when unknown.  ``file`` and ``offset`` locate the image for a later
look (the search page's thumbnails): the tar shard and the byte offset of the sample's
first header, or an image folder's file itself with offset -1.  clip-retrieval reads the
first four columns and ignores the rest.  The ``.json``'s own fields follow as columns under
their own names (img2dataset's ``url``, ``status``, ``width``, ...; a fixed name wins a clash),
so ``url`` is where a hit's source URL is read from.  **Parts may differ in their extra columns**
(and an extra column in its type): a reader unions them, missing = null.

One row per (image, caption) pair, so an image with two captions fills two rows that
share its image embedding; ``caption_index == 0`` marks an image's first row (the
index builder indexes each image once).  This keeps the three files row-aligned, as
clip-retrieval expects, without dropping captions that retrieval metrics count.

Units, ranks, resume.  ``--data`` is a list of units (:mod:`.embed_inputs`: a tar shard, or a
slice of an image folder).  Under ``--nproc N`` (re-run under torchrun, as ``curate`` does) or an
outside torchrun / SLURM launch (``RANK`` / ``WORLD_SIZE``), rank r embeds units r, r + W, ...
Each unit is written on its own into ``OUT/embed_work/UUUUUU/`` (parts of at most ``part_size``
rows, so a part never spans two units), its ``done.json`` last; batches never span units either,
so the result is bitwise the same for any number of ranks.  Rank 0 then waits for every unit and
moves their parts, in unit order, to ``OUT/*/`` numbered 0.., writes ``embed.json`` and removes
``OUT/embed_work``.  No process group is started: the files are the synchronisation (so ranks
on several hosts need ``OUT`` on a file system they share).

Run the same command again after a kill and the units with a ``done.json`` are not embedded
again (one line says how many); ``OUT/embed_work/stamp.json`` (the model's weight files, the
units, ``part_size``) refuses a rerun with other arguments.  A finished ``OUT`` (``embed.json``)
is refused.

Memory is bounded: a part is written every ``part_size`` rows and only one batch of
images is decoded at a time, so a rank holds O(part_size x D) floats however large
the dataset.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.nn.functional as F

from mmalign.data.shards import shard_total  # noqa: F401 (re-exported: its old home)
from mmalign.errors import UsageError
from mmalign.progress import track
from mmalign.search.embed_inputs import FOLDER_IMAGE_EXTS, Units, open_data, plan_units
from mmalign.search.embed_parts import EMBED_INFO, METADATA_COLUMNS, PartWriter
from mmalign.search.embed_ranks import STAMP, WorkFolder, launch_rank, stamp_content, write_json

__all__ = ["EMBED_INFO", "FOLDER_IMAGE_EXTS", "METADATA_COLUMNS", "embed", "open_data", "plan_units"]

WORK = "embed_work"
DONE = "done.json"
KINDS = ("img_emb", "text_emb", "metadata")


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
    fields = [s["json"] for s in samples for _ in s["captions"]]
    return rows_img, rows_txt, meta, fields


class _UnitRun:
    """One unit: its samples batched, encoded and written into its own folder; ``done.json`` last."""

    def __init__(self, folder: Path, source, with_text: bool, part_size: int, batch_size: int, device: str):
        shutil.rmtree(folder, ignore_errors=True)  # what a killed run left of this unit
        self.folder, self.source, self.with_text = folder, source, with_text
        self.batch_size, self.device = batch_size, device
        self.writer = PartWriter(folder, part_size, with_text)
        self.batch: list[dict] = []
        self.images = 0

    def add(self, sample: dict) -> None:
        self.batch.append(sample)
        if len(self.batch) == self.batch_size:
            self._encode()

    def _encode(self) -> None:
        s = self.source
        self.writer.add(
            *_encode_batch(
                s.model, self.batch, s.preprocess, s.tokenizer, self.with_text, self.device, self.batch_size
            )
        )
        self.images += len(self.batch)
        self.batch = []

    def finish(self, name: str) -> None:
        if self.batch:
            self._encode()
        self.writer.close()
        done = {
            "unit": name,
            "rows": self.writer.rows,
            "images": self.images,
            "parts": self.writer.parts,
            "dim": int(self.source.model.embed_dim),
        }
        write_json(self.folder / DONE, done)


def _unit_dir(out: Path, u: int) -> Path:
    return out / WORK / f"{u:06d}"


def _mismatch(out: Path):
    """The one-line refusal of a stamp from other arguments (the first field that differs)."""

    def line(have: dict, want: dict) -> str:
        what = next(k for k in ("model", "weights", "units", "text", "part_size") if have.get(k) != want[k])
        what = {"weights": "model", "units": "data", "text": "data"}.get(what, what)
        return (
            f"--out: {out} holds a partial embed with another {what.replace('_', '-')} ({out / WORK / STAMP}); "
            f"rerun with the same arguments to resume, or use another --out"
        )

    return line


def _work(out: Path) -> WorkFolder:
    return WorkFolder(out, WORK, lambda u: _unit_dir(out, u) / DONE, "embedded", _mismatch(out))


# ------------------------------------------------------------------- embed


def embed(
    model_dir: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    batch_size: int = 64,
    part_size: int = 100_000,
    device: str = "cpu",
    progress: bool = True,
    rank: int | None = None,
    world: int | None = None,
    stall_timeout_s: float = 3600.0,
) -> dict | None:
    """Embed this rank's units of ``data`` with the model in ``model_dir`` (module docstring);
    rank 0 also finishes the directory and returns ``embed.json``'s content, other ranks None.
    ``rank`` / ``world`` default to the launcher's (``RANK`` / ``WORLD_SIZE``, SLURM's), else 0 / 1."""
    if batch_size <= 0 or part_size <= 0:
        raise UsageError("--batch-size and --part-size must be positive")
    rank, world = launch_rank(rank, world)
    out = Path(out)
    if (out / EMBED_INFO).exists():
        if rank != 0:
            return None  # rank 0 refuses it (or has just finished it)
        raise UsageError(f"--out: {out} already holds embeddings; choose an empty directory")
    from mmalign.models.load import load

    # rank 0 loads the model first: a bad --model is the first line (and a failed load leaves no stamp)
    source = load(model_dir, device=device) if rank == 0 else None
    units = plan_units(data)
    n = len(units.names)
    stamp = stamp_content(model_dir, units, part_size)
    work = _work(out)
    stamped, todo = work.start(stamp, n, rank, world)
    if rank != 0 and not todo:
        return None
    if source is None and todo:
        source = load(model_dir, device=device)
    work.publish_stamp(stamp, stamped, rank)
    if todo:
        _embed_units(source, units, todo, out, batch_size, part_size, device, progress, rank, world)
    if rank != 0:
        return None
    work.wait_for_all(n, stall_timeout_s)
    return _finish(out, units, data, model_dir, part_size)


def _embed_units(source, units: Units, todo, out, batch_size, part_size, device, progress, rank, world):
    """This rank's units, one after another (a bar or a line every 10 s over all of them)."""
    current: list[_UnitRun] = []

    def stream():
        for u in todo:
            current[:] = [_UnitRun(_unit_dir(out, u), source, units.with_text, part_size, batch_size, device)]
            yield from units.samples(u)
            current[0].finish(units.names[u])

    totals = [units.total(u) for u in todo]
    total = None if None in totals else sum(t for t in totals if t is not None)
    label = "embedding" + (f" (rank {rank} of {world})" if world > 1 else "")
    for sample in track(stream(), label, total=total or None, unit="images", enabled=progress):
        current[0].add(sample)


def _finish(out: Path, units: Units, data, model_dir, part_size: int) -> dict:
    """Rank 0, every unit done: their parts moved into ``OUT/*/`` numbered 0.. in unit order,
    ``embed.json`` written, ``OUT/embed_work`` removed. Rerun after a kill here, it completes."""
    kinds = KINDS if units.with_text else ("img_emb", "metadata")
    dones = [json.loads((_unit_dir(out, u) / DONE).read_text()) for u in range(len(units.names))]
    if sum(d["images"] for d in dones) == 0:
        shutil.rmtree(out / WORK)
        raise UsageError(f"--data: {data} holds no readable samples")
    for sub in kinds:
        (out / sub).mkdir(parents=True, exist_ok=True)
    parts = 0
    for u, done in enumerate(dones):
        for j in range(done["parts"]):
            for sub in kinds:
                ext = "parquet" if sub == "metadata" else "npy"
                src, dst = _unit_dir(out, u) / f"{sub}_{j}.{ext}", out / sub / f"{sub}_{parts}.{ext}"
                if src.exists():
                    os.replace(src, dst)
                elif not dst.exists():
                    raise UsageError(f"--out: {src} is missing (was {out} edited?); use another --out")
            parts += 1
    for sub in kinds:  # what an older, killed embed into this folder left past the last part
        for stale in (out / sub).glob(f"{sub}_*.*"):
            number = stale.stem.rsplit("_", 1)[1]
            if not number.isdigit() or int(number) >= parts:
                stale.unlink()
    info = {
        "model": str(model_dir),
        "dim": dones[0]["dim"],
        "rows": sum(d["rows"] for d in dones),
        "images": sum(d["images"] for d in dones),
        "parts": parts,
        "units": len(units.names),
        "part_size": int(part_size),
        "dtype": "float16",
        "normalised": True,
        "text": units.with_text,
        "layout": "one row per (image, caption); caption_index 0 = an image's first row",
    }
    write_json(out / EMBED_INFO, info)
    shutil.rmtree(out / WORK)
    return info
