"""``mmalign embed --teacher-shards OUT``: a copy of tar shards with a teacher's embeddings per sample.

Distillation (``loss.distill``) needs the teacher's image and text embeddings of every sample in
every step; a costly teacher run once per dataset instead of once per epoch writes them into the
shards, and training reads them (``loss.distill.teacher: stored``). Output::

    OUT/NAME.tar        one per input shard, same name (``.tar.gz`` / ``.tgz`` -> ``.tar``), same
                        samples in the same order; every original member copied byte for byte
                        (name, data, mode, mtime), and after each decodable sample's members:
                          KEY.teacher_image.npy  (D,) float32, L2-normalised
                          KEY.teacher_text.npy   (D,) float32, L2-normalised; (C, D) for a sample
                                                 with C > 1 captions, one row per caption in the
                                                 order the loader parses them
                          KEY.teacher_scale.npy  (1,) float32, exp(logit_scale): the multiplier
    OUT/sizes.json      samples per shard (what the loader's global order is built from)
    OUT/teacher.json    model, embed_dim, logit_scale, count, shards, skipped, preprocess

The images go through the teacher's own evaluation transform (``load().preprocess``: resize and
centre crop, its mean and std), not the training augmentation; the captions through its own
tokenizer. A sample the loader cannot decode (a broken image, no caption) is copied unchanged,
without teacher members, and counted in ``skipped``: training skips it anyway. Teacher members an
input already holds (a copy made from a copy) are replaced, not duplicated.

Units, ranks and resume follow ``mmalign embed`` (:mod:`.embed_ranks`): a unit is one shard; rank r
writes shards r, r + W, ... into ``OUT/teacher_work/`` and moves each finished one to ``OUT``
before its ``UUUUUU.done.json``; rank 0 waits for all, writes ``sizes.json`` and ``teacher.json``
and removes ``OUT/teacher_work``. A rerun after a kill skips the shards with a done file; a rerun
with another model or data is one line (``teacher_work/stamp.json``); a finished ``OUT`` is refused.
"""

from __future__ import annotations

import io
import json
import logging
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from mmalign.errors import UsageError
from mmalign.progress import track
from mmalign.search.embed_inputs import Units, plan_units
from mmalign.search.embed_ranks import STAMP, WorkFolder, launch_rank, stamp_content, write_json

log = logging.getLogger("mmalign.search.embed")

TEACHER_INFO = "teacher.json"
MEMBERS = ("teacher_image.npy", "teacher_text.npy", "teacher_scale.npy")  # the contract with loss.distill
WORK = "teacher_work"


def out_name(url: str) -> str:
    """An input shard's name in OUT: its basename, a gzip suffix made plain ``.tar``."""
    name = url.rstrip("/").rsplit("/", 1)[-1].split("?", 1)[0]
    for gz, plain in ((".tar.gz", ".tar"), (".tgz", ".tar")):
        if name.endswith(gz):
            return name[: -len(gz)] + plain
    return name


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


# ------------------------------------------------------------------ one shard


class _ShardCopy:
    """One shard read as member groups (one group = one sample), written to ``dest`` with the
    teacher's members appended to each decodable group; groups are encoded ``batch_size`` at a time."""

    def __init__(self, source, dest: Path, url: str, batch_size: int, device: str):
        self.source, self.url, self.batch_size, self.device = source, url, batch_size, device
        self.tar = tarfile.open(dest, "w", format=tarfile.PAX_FORMAT)
        self.pending: list[tuple[str | None, list]] = []  # (key or None, [(TarInfo, bytes, ext)])
        self.samples = self.embedded = self.skipped = 0
        self.scale = np.asarray([float(source.model.logit_scale.detach().float().exp())], np.float32)  # (1,)

    def add_group(self, key: str | None, members: list) -> None:
        if key is not None:
            self.samples += 1
        self.pending.append((key, members))
        if sum(k is not None for k, _ in self.pending) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        from mmalign.config import MAX_MEMBER_BYTES
        from mmalign.data.shards import BadSample, decode_sample
        from mmalign.data.tario import unsafe_name

        decoded: dict[int, dict] = {}
        for i, (key, members) in enumerate(self.pending):
            if key is None:
                continue
            raw = {"__key__": key, **{ext: data for info, data, ext in members}}
            big = {ext: info.size for info, _, ext in members if info.size > MAX_MEMBER_BYTES}
            raw.update(
                {"__oversized__": big} if big else {}, **({"__unsafe__": True} if unsafe_name(key) else {})
            )
            try:
                decoded[i] = decode_sample(raw)
            except BadSample as e:
                log.warning("teacher shards: sample %s in %s copied without embeddings: %s", key, self.url, e)
                self.skipped += 1
        vectors = self._encode([decoded[i] for i in sorted(decoded)]) if decoded else []
        by_group = dict(zip(sorted(decoded), vectors))
        for i, (key, members) in enumerate(self.pending):
            for info, data, _ in members:
                self.tar.addfile(info, io.BytesIO(data))
            if i in by_group and key is not None:
                self._add_teacher(key, members[0][0], *by_group[i])
        self.embedded += len(decoded)
        self.pending = []

    def _encode(self, samples: list[dict]) -> list[tuple[np.ndarray, np.ndarray]]:
        model, s = self.source.model, self.source
        with torch.inference_mode():
            images = torch.stack([s.preprocess(x["image"]) for x in samples]).to(self.device)  # (b, 3, S, S)
            img = F.normalize(model.encode_image(images).float(), dim=-1).cpu().numpy()  # (b, D)
            captions = [c for x in samples for c in x["captions"]]
            chunks = []
            for i in range(0, len(captions), self.batch_size):
                part = captions[i : i + self.batch_size]
                try:
                    tokens = s.tokenizer(part)
                except (ValueError, KeyError, TypeError, UnicodeError) as e:
                    raise UsageError(
                        f"--model: the teacher's tokenizer cannot encode the captions of {self.url} "
                        f"({type(e).__name__}: {e})"
                    ) from None
                chunks.append(model.encode_text(tokens.to(self.device)).float())
            txt = F.normalize(torch.cat(chunks), dim=-1).cpu().numpy()  # (r, D): one row per caption
        out, row = [], 0
        for j, x in enumerate(samples):
            n = len(x["captions"])
            rows = txt[row : row + n]
            out.append(
                (np.ascontiguousarray(img[j], np.float32), np.ascontiguousarray(rows[0] if n == 1 else rows))
            )
            row += n
        return out

    def _add_teacher(self, key: str, first: tarfile.TarInfo, image: np.ndarray, text: np.ndarray) -> None:
        for ext, array in zip(MEMBERS, (image, text, self.scale)):
            data = _npy(array)
            info = tarfile.TarInfo(f"{key}.{ext}")
            info.size, info.mtime, info.mode = len(data), first.mtime, 0o644
            self.tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self.flush()
        self.tar.close()


def _copy_shard(source, url: str, dest: Path, batch_size: int, device: str, counts: dict):
    """``url`` -> ``dest`` (module docstring), yielding once per sample read; ``counts`` gets its
    counts. A shard that ends early is logged and copied up to where it is readable, as the loader
    reads it."""
    from mmalign.data.tario import open_shard, split_name

    copy = _ShardCopy(source, dest, url, batch_size, device)
    key: str | None = None
    members: list[tuple[tarfile.TarInfo, bytes, str]] = []
    try:
        with open_shard(url) as f, tarfile.open(fileobj=f, mode="r|") as tar:
            for info in tar:
                data = tar.extractfile(info).read() if info.isfile() else b""  # type: ignore[union-attr]
                parts = split_name(info.name) if info.isfile() else None
                if parts is not None and parts[1] in MEMBERS:
                    continue  # an older teacher's member: replaced below
                if (
                    parts is not None and parts[0] != key
                ):  # a directory or a name without a dot joins the group
                    if members:
                        copy.add_group(key, members)
                        yield
                    key, members = parts[0], []
                members.append((info, data, parts[1] if parts is not None else ""))
    except (tarfile.TarError, EOFError, OSError) as e:
        log.warning("teacher shards: shard %s ended early (%s); copied what is readable", url, e)
    if members:
        copy.add_group(key, members)
        yield
    copy.close()
    counts.update(samples=copy.samples, embedded=copy.embedded, skipped=copy.skipped)


# ------------------------------------------------------------------ the units


def _done_file(out: Path, u: int) -> Path:
    return out / WORK / f"{u:06d}.done.json"


def _mismatch(out: Path):
    """The one-line refusal of a stamp from other arguments: another model, else other data."""

    def line(have: dict, want: dict) -> str:
        model = (have.get("model"), have.get("weights")) != (want["model"], want["weights"])
        return (
            f"--teacher-shards: {out} holds a partial copy made with another {'model' if model else 'data'} "
            f"({out / WORK / STAMP}); rerun with the same arguments to resume, or use another folder"
        )

    return line


def _work(out: Path) -> WorkFolder:
    return WorkFolder(out, WORK, lambda u: _done_file(out, u), "copied", _mismatch(out))


def _plan(data, out: Path) -> tuple[Units, list[str]]:
    units = plan_units(data)
    if units.shards is None:
        raise UsageError(f"--teacher-shards: --data {data} is an image folder; give tar shards")
    names = [out_name(u) for u in units.shards]
    seen: dict[str, str] = {}
    for url, name in zip(units.shards, names):
        if name in seen:
            raise UsageError(
                f"--teacher-shards: shards {seen[name]} and {url} would both be written as {name}"
            )
        seen[name] = url
        if "://" not in url and not url.startswith("pipe:") and Path(url).resolve().parent == out.resolve():
            raise UsageError(
                f"--teacher-shards: {out} holds the input shards; write the copy to another folder"
            )
    return units, names


def embed_teacher(
    model_dir: str | Path,
    data: str | Path,
    out: str | Path,
    *,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = True,
    rank: int | None = None,
    world: int | None = None,
    stall_timeout_s: float = 3600.0,
) -> dict | None:
    """Copy this rank's shards of ``data`` into ``out`` with the teacher's embeddings (module
    docstring); rank 0 also finishes ``out`` and returns ``teacher.json``'s content, others None."""
    if batch_size <= 0:
        raise UsageError("--batch-size must be positive")
    rank, world = launch_rank(rank, world)
    out = Path(out)
    if (out / TEACHER_INFO).exists():
        if rank != 0:
            return None
        raise UsageError(f"--teacher-shards: {out} already holds teacher shards; choose an empty folder")
    from mmalign.models.load import load

    source = load(model_dir, device=device) if rank == 0 else None  # a bad --model first
    units, names = _plan(data, out)
    n = len(names)
    stamp = {**stamp_content(model_dir, units, 0), "kind": "teacher-shards"}
    work = _work(out)
    stamped, todo = work.start(stamp, n, rank, world)
    if rank != 0 and not todo:
        return None
    if source is None:
        source = load(model_dir, device=device)
    work.publish_stamp(stamp, stamped, rank)
    totals = [units.total(u) for u in todo]
    total = None if None in totals else sum(t or 0 for t in totals)
    label = "teacher shards" + (f" (rank {rank} of {world})" if world > 1 else "")
    copies = _copy_units(source, units, names, todo, out, batch_size, device)
    for _ in track(copies, label, total=total or None, unit="samples", enabled=progress):
        pass
    if rank != 0:
        return None
    work.wait_for_all(n, stall_timeout_s, example=False)
    return _finish(out, names, model_dir, source)


def _copy_units(
    source, units: Units, names: list[str], todo: list[int], out: Path, batch_size: int, device: str
):
    """This rank's shards one after another, each moved to ``OUT`` whole, then its done file."""
    for u in todo:
        tmp = out / WORK / f"{u:06d}.tar.tmp"
        counts: dict[str, int] = {}
        yield from _copy_shard(source, units.shards[u], tmp, batch_size, device, counts)  # type: ignore[index]
        os.replace(tmp, out / names[u])  # whole or absent
        write_json(_done_file(out, u), {"shard": names[u], **counts})


def _finish(out: Path, names: list[str], model_dir, source) -> dict:
    dones = [json.loads(_done_file(out, u).read_text()) for u in range(len(names))]
    write_json(out / "sizes.json", {d["shard"]: d["samples"] for d in dones})
    info = {
        "model": str(model_dir),
        "embed_dim": int(source.model.embed_dim),
        "logit_scale": float(source.model.logit_scale.detach().float().exp()),
        "count": sum(d["embedded"] for d in dones),
        "samples": sum(d["samples"] for d in dones),
        "skipped": sum(d["skipped"] for d in dones),
        "shards": len(names),
        "members": list(MEMBERS),
        "dtype": "float32",
        "normalised": True,
        "preprocess": dict(source.preprocess_cfg),
    }
    write_json(out / TEACHER_INFO, info)
    shutil.rmtree(out / WORK)
    return info
