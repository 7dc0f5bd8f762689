"""Offline hard-negative mining: a previous model's nearest captions, written into the shards' ``.json``.

``mmalign mine --data SHARDS --model RUN -k K --out DIR`` (:func:`mine`):

1. embeds every readable sample's image and every one of its captions with a trained
   model (a run directory, its ``final/``, or a step checkpoint ``RUN/checkpoints/step_N``);
2. builds an exact FAISS inner-product index over the L2-normalised caption embeddings
   (inner product = cosine), and searches it with each image;
3. for each image walks its nearest captions, best first, and skips its own captions,
   *positives* (a caption whose normalised text equals one of its own captions, or, with
   ``--id-field``, any caption of a sample with the same id) and repeats of a caption text
   already taken; drops candidates whose cosine exceeds ``--max-similarity`` (an absolute
   threshold) or ``--max-relative`` x the image's own-caption cosine (relative to its
   positive, NV-Retriever's "TopK-PercPos", Moreira et al. 2024, arXiv 2407.15831) as
   suspected false negatives (counted); keeps the first k;
4. rewrites the shards into ``DIR``: every member is copied byte for byte except each
   mined sample's ``.json``, which gains ``"hard_negatives": [{"key", "caption",
   "similarity"}, ...]`` (hardest first; ``[]`` when nothing survived); unreadable
   samples are copied unchanged. Side files (``NNNNN.parquet``, ``NNNNN_stats.json``,
   ``sizes.json``) are copied; ``DIR/mine.json`` holds the statistics.

Storing the negative *caption text* lets the streaming loader (``data.hard_negatives``)
use it without random access to other shards. Image negatives (the nearest images of a
caption, for the text->image direction) are out of scope: they would need the images
themselves copied or fetched at training time.

Scale: embeddings are held in memory (images x D and captions x D float32) and the
search is exact (``IndexFlatIP``, O(images x captions x D)); fine for up to about a
million captions on a CPU. This is the one builder that needs a model; it imports
mmalign's model loading and shard reading, nothing of training.
"""

from __future__ import annotations

import copy
import io
import json
import logging
import shutil
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from data_pipelines.shard_input import input_shards
from mmalign.config import ConfigError
from mmalign.extras import extra, require
from mmalign.losses.positives import normalise_caption  # the loss's "caption" positives' rule
from mmalign.progress import track

log = logging.getLogger("mmalign.mine")

STATS_FILE = "mine.json"


@dataclass
class _Corpus:
    """What pass 1 keeps: per readable sample its place, key, captions and id; the embeddings."""

    where: list[tuple[int, int]] = field(default_factory=list)  # (shard number, sample index in shard)
    keys: list[str] = field(default_factory=list)  # the tar key (may hold folders), as the reader groups it
    texts: list[list[str]] = field(default_factory=list)  # captions per sample
    ids: list[str | None] = field(default_factory=list)  # canonical json of the id value
    image: list[np.ndarray] = field(default_factory=list)  # (b, D) batches
    caption: list[np.ndarray] = field(default_factory=list)  # (r, D) batches
    unreadable: dict[str, int] = field(default_factory=dict)  # reason -> samples copied unchanged
    samples: int = 0  # every sample group seen, readable or not
    shards_ended_early: int = 0


def _check_out(urls: list[str], out: Path) -> None:
    names = [Path(u).name for u in urls]
    if len(set(names)) != len(names):
        raise ConfigError("--data: two shards share a file name; mine them into separate --out folders")
    if any(Path(u).resolve().parent == out.resolve() for u in urls):
        raise ConfigError(f"--out: {out} is where the input shards are; write the mined shards elsewhere")
    if out.is_dir() and (any(out.glob("*.tar")) or (out / STATS_FILE).exists()):
        raise ConfigError(f"--out: {out} already holds shards; choose an empty directory")


def _listed_total(urls: list[str]) -> int | None:
    """The samples of ``urls`` by their folders' ``sizes.json`` (the builders write it); None
    when a shard is not listed."""
    from mmalign.data.shards import shard_total

    counts = [shard_total(url) for url in urls]
    known = [c for c in counts if c is not None]
    return sum(known) if counts and len(known) == len(counts) else None


@torch.no_grad()
def _embed(
    urls: list[str],
    model,
    preprocess,
    tokenizer,
    id_field: str | None,
    batch_size: int,
    device: str,
    progress: bool,
) -> _Corpus:
    """Pass 1: read every shard in order, embed the readable samples' images and captions."""
    from mmalign.data.shards import BadSample, decode_sample, iter_tar_groups
    from mmalign.data.tario import CorruptTar, TruncatedTar

    corpus = _Corpus()
    pending: list[tuple[object, list[str]]] = []

    def flush() -> None:
        if not pending:
            return
        images = torch.stack([preprocess(image) for image, _ in pending]).to(device)  # (b, 3, S, S)
        corpus.image.append(F.normalize(model.encode_image(images).float(), dim=-1).cpu().numpy())
        captions = [c for _, caps in pending for c in caps]
        for i in range(0, len(captions), batch_size):
            tokens = tokenizer(captions[i : i + batch_size]).to(device)
            corpus.caption.append(F.normalize(model.encode_text(tokens).float(), dim=-1).cpu().numpy())
        pending.clear()

    def raw_samples():  # (shard, index in shard, raw sample); a shard that ends early is counted
        for shard, url in enumerate(urls):
            try:
                for index, raw in enumerate(iter_tar_groups(url)):
                    yield shard, index, raw
            except (TruncatedTar, CorruptTar, OSError) as e:
                corpus.shards_ended_early += 1
                log.warning("mine: shard %s ended early: %s", url, e)

    # a bar on a terminal, a readable line every 10 s elsewhere (not tqdm's carriage returns);
    # a total and an ETA when the shards' sizes.json lists every one of them
    for shard, index, raw in track(
        raw_samples(), "mining: embedding", unit="samples", total=_listed_total(urls), enabled=progress
    ):
        corpus.samples += 1
        try:
            sample = decode_sample(raw)
        except BadSample as e:
            corpus.unreadable[e.reason] = corpus.unreadable.get(e.reason, 0) + 1
            log.warning(
                "mine: copying unreadable sample %s of %s unchanged: %s", raw["__key__"], urls[shard], e
            )
            continue
        value = sample["json"].get(id_field) if id_field else None
        corpus.where.append((shard, index))
        corpus.keys.append(raw["__key__"])
        corpus.texts.append(sample["captions"])
        corpus.ids.append(None if value is None else json.dumps(value, sort_keys=True))
        pending.append((sample["image"].convert("RGB"), sample["captions"]))
        if len(pending) == batch_size:
            flush()
    flush()
    return corpus


@dataclass
class _Choice:
    kept: list[tuple[int, float]]  # (caption row, cosine), best first
    same_caption: int = 0
    same_id: int = 0
    filtered_absolute: int = 0
    filtered_relative: int = 0
    exhausted: bool = False  # walked every returned neighbour without reaching k


def _choose(
    i: int,
    sims: np.ndarray,
    rows: np.ndarray,
    owner: np.ndarray,
    norm_texts: list[str],
    own: set[str],
    ids: list[str | None],
    k: int,
    max_similarity: float | None,
    limit_relative: float | None,
) -> _Choice:
    """Walk image i's neighbours (best first) and keep up to k negatives (module docstring, step 3)."""
    choice, seen = _Choice(kept=[]), set()
    for sim, r in zip(sims.tolist(), rows.tolist()):
        if r < 0:  # FAISS pads with -1 when fewer than asked exist
            break
        j = int(owner[r])
        if j == i:
            continue  # its own caption
        text = norm_texts[r]
        if text in own:
            choice.same_caption += 1
            continue
        if ids[i] is not None and ids[j] == ids[i]:
            choice.same_id += 1
            continue
        if text in seen:
            continue  # one slot per caption text
        seen.add(text)
        if max_similarity is not None and sim > max_similarity:
            choice.filtered_absolute += 1
            continue
        if limit_relative is not None and sim > limit_relative:
            choice.filtered_relative += 1
            continue
        choice.kept.append((r, sim))
        if len(choice.kept) == k:
            return choice
    choice.exhausted = True
    return choice


def _select(corpus: _Corpus, k: int, max_similarity: float | None, max_relative: float | None) -> tuple:
    """Search the caption index with every image, widening the search for images that lack k."""
    with extra("search", "mmalign mine"):
        import faiss

    image = np.concatenate(corpus.image).astype(np.float32)  # (S, D)
    caption = np.concatenate(corpus.caption).astype(np.float32)  # (R, D)
    counts = [len(t) for t in corpus.texts]
    owner = np.repeat(np.arange(len(counts)), counts)  # (R,) caption row -> sample
    norm_texts = [normalise_caption(c) for caps in corpus.texts for c in caps]
    # the image's cosine with its own (best) caption: the reference of --max-relative
    own_cos = np.einsum("rd,rd->r", caption, image[owner])  # (R,)
    positive = np.maximum.reduceat(own_cos, np.cumsum([0] + counts[:-1]))  # (S,), every sample has a caption
    index = faiss.IndexFlatIP(caption.shape[1])
    index.add(caption)
    n_rows = caption.shape[0]
    choices: list[_Choice | None] = [None] * len(counts)
    todo = np.arange(len(counts))
    width = min(n_rows, 4 * k + max(counts) + 16)
    while todo.size:
        sims, rows = index.search(image[todo], width)  # (q, width) each, best first
        again = []
        for q, i in enumerate(todo.tolist()):
            own = {normalise_caption(c) for c in corpus.texts[i]}
            limit = None if max_relative is None else max_relative * positive[i]
            choice = _choose(
                i, sims[q], rows[q], owner, norm_texts, own, corpus.ids, k, max_similarity, limit
            )
            if choice.exhausted and len(choice.kept) < k and width < n_rows:
                again.append(i)  # the search stopped before the corpus did: look further
            else:
                choices[i] = choice
        todo = np.array(again, dtype=np.int64)
        width = min(n_rows, 4 * width)
    return choices, positive


def _rewrite(url: str, shard: int, target: Path, negatives: dict[tuple[int, int], tuple[str, list]]) -> dict:
    """Pass 2: copy ``url`` member by member into ``target``, adding ``hard_negatives`` to mined samples' .json."""
    from mmalign.config import MAX_MEMBER_BYTES
    from mmalign.data.tario import split_name, unsafe_name

    written = {
        "json_rewritten": 0,
        "json_added": 0,
        "json_not_object": 0,
        "ended_early": 0,
        "unsafe_members_skipped": 0,
    }
    mode: Literal["w:gz", "w"] = "w:gz" if target.name.endswith((".gz", ".tgz")) else "w"
    with tarfile.open(url, "r:*") as src, tarfile.open(target, mode, format=src.format) as dst:
        current, index, has_json = None, -1, False

        def close_group() -> None:
            # a mined sample without a .json member gets one (after its last member)
            entry = negatives.get((shard, index))
            if current is not None and not has_json and entry is not None and entry[0] == current:
                data = json.dumps({"hard_negatives": entry[1]}, sort_keys=True).encode("utf-8")
                info = tarfile.TarInfo(f"{current}.json")
                info.size, info.mode, info.mtime = len(data), 0o644, 0
                dst.addfile(info, io.BytesIO(data))
                written["json_added"] += 1

        try:
            for member in src:
                parts = split_name(member.name) if member.isreg() else None
                if parts is None:
                    link = member.issym() or member.islnk()
                    if unsafe_name(member.name) or (link and unsafe_name(member.linkname)):
                        written["unsafe_members_skipped"] += 1  # would extract (or point) outside the folder
                        continue
                    dst.addfile(member)  # directories, links and stray files: as they are
                    continue
                key, ext = parts
                if key != current:
                    close_group()
                    current, index, has_json = key, index + 1, False
                if unsafe_name(member.name):  # counted in the sample order as pass 1 counts it, never copied
                    written["unsafe_members_skipped"] += 1
                    continue
                entry = negatives.get((shard, index))
                if member.size > MAX_MEMBER_BYTES:
                    # too large to read whole (pass 1 skipped its sample): copied through a bounded buffer
                    has_json = has_json or ext == "json"
                    dst.addfile(copy.copy(member), src.extractfile(member))
                    continue
                data = src.extractfile(member).read()  # type: ignore[union-attr]  # a regular file (isreg above)
                if ext == "json":
                    has_json = True
                    if entry is not None and entry[0] == key:  # the sample pass 1 read at this place
                        meta = json.loads(data.decode("utf-8"))
                        if isinstance(meta, dict):
                            meta["hard_negatives"] = entry[1]
                            data = json.dumps(meta, sort_keys=True).encode("utf-8")
                            written["json_rewritten"] += 1
                        else:
                            written["json_not_object"] += 1
                info = copy.copy(member)
                info.size = len(data)
                dst.addfile(info, io.BytesIO(data))
            close_group()
        except (tarfile.TarError, OSError, EOFError) as e:  # a truncated source: keep the readable part
            written["ended_early"] += 1
            log.warning("mine: shard %s ended early while copying: %s", url, e)
    return written


def _copy_side_files(urls: list[str], out: Path) -> None:
    for url in urls:
        path = Path(url)
        stem = path.name.split(".")[0]
        for side in (path.with_name(f"{stem}.parquet"), path.with_name(f"{stem}_stats.json")):
            if side.is_file():
                shutil.copy2(side, out / side.name)
    parents = {Path(u).parent for u in urls}
    if len(parents) == 1 and (parents.pop() / "sizes.json").is_file():
        shutil.copy2(Path(urls[0]).parent / "sizes.json", out / "sizes.json")


def mine(
    data: str | list[str],
    model: str | Path,
    out: str | Path,
    *,
    k: int,
    max_similarity: float | None = None,
    max_relative: float | None = None,
    id_field: str | None = None,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = True,
) -> dict:
    """Mine ``k`` hard negative captions per sample of ``data`` with ``model``; returns ``mine.json``'s content."""
    from mmalign.models.load import load

    if k < 1:
        raise ConfigError(f"-k must be >= 1, got {k}")
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    if max_similarity is not None and not -1.0 <= max_similarity <= 1.0:
        raise ConfigError(f"--max-similarity is a cosine in [-1, 1], got {max_similarity}")
    if max_relative is not None and max_relative <= 0:
        raise ConfigError(f"--max-relative must be > 0, got {max_relative}")
    require("search", "faiss", "mmalign mine")  # before the embedding pass, not after it
    start = time.time()
    out = Path(out)
    urls = input_shards(data)
    _check_out(urls, out)
    source = load(model, device=device)
    net, preprocess = source.model, source.preprocess

    corpus = _embed(urls, net, preprocess, source.tokenizer, id_field, batch_size, device, progress)
    if not corpus.keys:
        raise ConfigError(f"--data: {data} holds no readable samples")
    choices, positive = _select(corpus, k, max_similarity, max_relative)
    flat_captions = [c for caps in corpus.texts for c in caps]
    # the key a loader reports (no folders), of each caption row's sample
    owner_key = [corpus.keys[i].rsplit("/", 1)[-1] for i, caps in enumerate(corpus.texts) for _ in caps]
    negatives = {}
    for i, choice in enumerate(choices):
        negatives[corpus.where[i]] = (
            corpus.keys[i],
            [
                {"key": owner_key[r], "caption": flat_captions[r], "similarity": round(float(sim), 6)}
                for r, sim in choice.kept
            ],
        )

    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, int] = {}
    for shard, url in enumerate(urls):
        for name, value in _rewrite(url, shard, out / Path(url).name, negatives).items():
            written[name] = written.get(name, 0) + value
    _copy_side_files(urls, out)

    sims = np.array([sim for c in choices for _, sim in c.kept], dtype=np.float64)
    per_sample = np.array([len(c.kept) for c in choices])
    filtered_abs = sum(c.filtered_absolute for c in choices)
    filtered_rel = sum(c.filtered_relative for c in choices)
    stats = {
        "model": str(model),
        "data": urls,
        "out": str(out),
        "k": k,
        "max_similarity": max_similarity,
        "max_relative": max_relative,
        "id_field": id_field,
        "shards": len(urls),
        "samples": corpus.samples,
        "mined_samples": len(corpus.keys),
        "unreadable_copied_unchanged": dict(sorted(corpus.unreadable.items())),
        "shards_ended_early": corpus.shards_ended_early + written.pop("ended_early"),
        "captions_indexed": len(flat_captions),
        "negatives_written": int(per_sample.sum()),
        "samples_with_fewer_than_k": int((per_sample < k).sum()),
        "samples_with_none": int((per_sample == 0).sum()),
        "negative_similarity": (
            {"mean": float(sims.mean()), "min": float(sims.min()), "max": float(sims.max())}
            if sims.size
            else None
        ),
        "positive_similarity_mean": float(positive.mean()),
        # distinct caption texts dropped as suspected false negatives, summed over images
        "filtered_false_negatives": filtered_abs + filtered_rel,
        "filtered_absolute": filtered_abs,
        "filtered_relative": filtered_rel,
        "samples_with_filtered": sum(1 for c in choices if c.filtered_absolute or c.filtered_relative),
        "excluded_same_caption": sum(c.same_caption for c in choices),
        "excluded_same_id": sum(c.same_id for c in choices),
        **written,
        "seconds": round(time.time() - start, 2),
    }
    (out / STATS_FILE).write_text(json.dumps(stats, indent=2))
    log.info("mined %s: %s", out, stats)
    return stats
