"""``data.decontaminate``: how many images of an evaluation set have near-duplicates in the
training shards, checked once when ``mmalign train`` starts (the launcher, or rank 0 of an
outside launcher, before the ranks train).

The detector is curate's (``mmalign curate --decontaminate``): the perceptual hash of
:mod:`mmalign.data.phash` and the pool-vs-evaluation matches of
:mod:`mmalign.evaluation.contamination`, within ``data.decontaminate_distance`` bits. The
evaluation set's hashes are cached in ``MMALIGN_CACHE/decontaminate/`` (default
``HF_HOME/mmalign``), keyed by its files (path, size, mtime) and :data:`~mmalign.data.phash.VERSION`,
so a second start hashes only the training sample. The training side is a seeded sample: the
shards of ``data.train`` (every source) in an order drawn from ``seed``, read until
``data.decontaminate_samples`` images are hashed. One line states the result; with
``data.decontaminate_strict`` a found image refuses the start (a ConfigError, exit 2).

The result goes to the run's ranks through :data:`ENV` (a small JSON) and into the run
directory as ``decontamination.json`` (:func:`record`); the end-of-run headline repeats it
beside the zero-shot numbers (:func:`note_lines`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from mmalign.data import phash
from mmalign.errors import ConfigError, UserError
from mmalign.layout.run_dir import DECONTAMINATION

ENV = "MMALIGN_DECONTAMINATION"  # the launcher's result for its ranks (rank 0 writes it into the run)
LISTED = 100  # matches listed in the result; the counts are always whole
KEY = "data.decontaminate"


def _train_urls(cfg) -> list[str]:
    """Every shard of data.train, source after source."""
    from mmalign.data.shards import train_shard_lists

    return [u for found, _ in train_shard_lists(cfg.data) for u in found]


def inputs(cfg, urls: list[str] | None = None) -> dict:
    """What the check's result depends on (``urls``: :func:`_train_urls`, when known): a stored
    result with other inputs is not reused."""
    urls = _train_urls(cfg) if urls is None else urls
    d = cfg.data
    return {
        "target": d.decontaminate,
        "distance": int(d.decontaminate_distance),
        "samples": int(d.decontaminate_samples),
        "seed": int(cfg.seed),
        "shards": hashlib.sha256("\n".join(urls).encode()).hexdigest()[:16],
        "phash_version": phash.VERSION,
    }


def at_start(cfg, out: Path, resume: str | None, say: Callable[[str], None] = print) -> dict | None:
    """The check for ``mmalign train`` (None when ``data.decontaminate`` is null). A resume whose
    run directory holds the result of the same inputs states that result again instead of
    hashing anew."""
    if cfg.data.decontaminate is None:
        return None
    if resume:
        found = stored(out)
        if found is not None and found.get("inputs") == inputs(cfg):
            say(summary(found) + " (as checked at the run's start)")
            return found
    return check(cfg, say)


def check(cfg, say: Callable[[str], None] = print) -> dict:
    """Hash the target's images (cached) and a seeded sample of the training shards, match them,
    state the result in one line; ConfigError when strict and any image is found."""
    from mmalign.evaluation.contamination import nearest, pairs

    d = cfg.data
    target, radius = str(d.decontaminate), int(d.decontaminate_distance)
    keys, eval_q, eval_i = target_hashes(target, say)
    sample = _sample(cfg, say)
    if not sample.refs:
        raise ConfigError(
            f"config key '{KEY}': no readable image in the {sample.read} training shard(s) sampled "
            f"(of {len(sample.urls)}): nothing to compare {target} with"
        )
    near = pairs(sample.query, sample.index, eval_q, eval_i, radius)  # (pool row, eval row, bits), both ways
    pool_rows, eval_rows, dist = nearest(*near)  # each training copy once, with its nearest eval image
    total, exact = sample.total()
    checked = len(sample.refs)
    copies = len(pool_rows)
    estimate = round(copies * total / checked)  # the count itself when every sample was checked
    result = {
        "target": target,
        "distance": radius,
        "strict": bool(d.decontaminate_strict),
        "eval_images": len(keys),
        "eval_found": len(np.unique(near[1])),  # the evaluation images with any copy
        "samples_checked": checked,
        "samples_found": copies,
        "samples_skipped": sample.skipped,
        "shards_read": sample.read,
        "shards": len(sample.urls),
        "pool_samples": total,
        "pool_samples_exact": exact,
        "estimate": estimate,
        "matches": [
            {
                "shard": sample.refs[p][0],
                "key": sample.refs[p][1],
                "eval_key": keys[e],
                "distance": int(b),
            }
            for p, e, b in list(zip(pool_rows.tolist(), eval_rows.tolist(), dist.tolist()))[:LISTED]
        ],
        "inputs": inputs(cfg, sample.urls),
    }
    line = summary(result)
    if result["strict"] and result["eval_found"]:
        raise ConfigError(
            f"config key 'data.decontaminate_strict': {line.removeprefix('mmalign: ' + KEY + ': ')}; "
            f"remove them first (mmalign curate --decontaminate {target}) or set "
            f"data.decontaminate_strict=false"
        )
    say(line)
    return result


def summary(result: dict) -> str:
    """The one line a start states."""
    return (
        f"mmalign: {KEY}: {result['eval_found']} of the {result['eval_images']} images of {result['target']} "
        f"have near-duplicates in the training shards (checked {result['samples_checked']} samples from "
        f"{result['shards_read']} of {result['shards']} shards: {result['samples_found']} copies; "
        f"{_about(result)}{result['estimate']} in all, within {result['distance']} bits)"
    )


def _about(result: dict) -> str:
    """The "~" before the estimate, unless every sample of the pool was checked (then it is a count)."""
    whole = result.get("pool_samples_exact") and result.get("pool_samples") == result.get("samples_checked")
    return "" if whole else "~"


# ------------------------------------------------------------------ the evaluation set's hashes


def cache_dir() -> Path:
    """``MMALIGN_CACHE/decontaminate`` (the folder :mod:`mmalign.models.hub_views` writes under)."""
    from mmalign.models.hub_views import views_dir

    return views_dir() / "decontaminate"


def target_hashes(
    target: str, say: Callable[[str], None] = print
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(keys, (M, QUERIES, W) query, (M, VIEWS, W) index) of the target's images (through
    :func:`mmalign.evaluation.contamination.eval_hashes`, cached in :func:`cache_dir`); a target
    that is no evaluation set is one ConfigError line."""
    from mmalign.evaluation.contamination import eval_hashes, resolve

    what = f"config key '{KEY}'"
    try:
        found = resolve(target, what)  # a wrong target: its line now, before any hashing is announced
        say(
            f"mmalign: {KEY}: the perceptual hashes of {target}'s images (hashed once, then read from {cache_dir()})"
        )
        hashes = eval_hashes(found, what=what, progress=True, cache_dir=cache_dir())
    except UserError as e:
        raise ConfigError(str(e)) from None
    skipped = hashes.skip_line(KEY)
    if skipped is not None:  # counted, never silent
        say(skipped)
    return hashes.keys, hashes.query, hashes.index


# ------------------------------------------------------------------ the training sample


class _Sample:
    """The training images hashed: their (shard, key), hashes, and what was read for them."""

    def __init__(self, urls: list[str], listed: int | None):
        self.urls = urls
        self.listed = listed  # samples in all of urls by their sizes.json, None unless each is listed
        self.refs: list[tuple[str, str]] = []
        self.query = np.zeros((0, phash.QUERIES, phash.WORDS), np.uint64)
        self.index = np.zeros((0, phash.VIEWS, phash.WORDS), np.uint64)
        self.sizes: list[int] = []  # samples in each shard read (a partly read one counted from headers)
        self.read = 0
        self.skipped = 0  # samples without a readable image

    def total(self) -> tuple[int, bool]:
        """(samples in the whole of data.train, exact?): the shards' sizes.json, else every shard
        read, else the mean of the shards read times their number."""
        if self.listed is not None:
            return self.listed, True
        if self.read == len(self.urls):
            return sum(self.sizes), True
        return round(sum(self.sizes) / max(self.read, 1) * len(self.urls)), False


def _sample(cfg, say: Callable[[str], None]) -> _Sample:
    """Shards of data.train in a seeded order, read until data.decontaminate_samples images are hashed."""
    from mmalign.data.shards import shard_total
    from mmalign.progress import track

    urls = _train_urls(cfg)
    sample = _Sample(urls, listed=shard_total("::".join(urls)))
    want = int(cfg.data.decontaminate_samples)
    order = np.random.default_rng(int(cfg.seed)).permutation(len(urls))
    say(f"mmalign: {KEY}: hashing up to {want} training samples from a seeded draw of {len(urls)} shard(s)")
    stream = _images(cfg, [urls[i] for i in order], want, sample)
    total = want if sample.listed is None else min(want, sample.listed)

    def images():  # the sample's images, their (shard, key) noted on the way
        for ref, image in track(stream, f"{KEY}: training samples", total=total, unit="samples"):
            sample.refs.append(ref)
            yield image

    sample.query, sample.index = phash.hash_images(images())  # (S, QUERIES, W), (S, VIEWS, W)
    return sample


def _images(cfg, urls: list[str], want: int, sample: _Sample) -> Iterator[tuple[tuple[str, str], object]]:
    """((shard, key), PIL image) of the shards' samples in order, ``want`` at most; a sample
    without a readable image is counted in ``sample.skipped``, a damaged shard ends early."""
    from mmalign.data.shard_sizes import count_samples
    from mmalign.data.tario import CorruptTar, TruncatedTar
    from mmalign.evaluation.contamination import shard_images

    d = cfg.data
    taken = 0
    for url in urls:
        if taken >= want:
            return
        sample.read += 1
        seen, whole = 0, True
        try:
            for key, image in shard_images(url, d.max_member_bytes, d.max_image_pixels, skip_oversized=True):
                seen += 1
                if image is None:
                    sample.skipped += 1
                    continue
                taken += 1
                yield (url, key), image
                if taken >= want:
                    whole = False
                    break
        except (TruncatedTar, CorruptTar, OSError):
            pass  # the samples before the damage count; training counts the rest as skips
        # a shard left part-way: its size from its headers, for the estimate of the whole
        sample.sizes.append(seen if whole else count_samples(url, max_member=cfg.data.max_member_bytes)[0])


# ------------------------------------------------------------------ the run's record of it


@contextlib.contextmanager
def handed_over(result: dict | None):
    """:data:`ENV` holds ``result`` (its listed matches included) for the block: the ranks of
    this launch (``--nproc``'s children inherit it) and :func:`record` read it."""
    if result is None:
        yield
        return
    before = os.environ.get(ENV)
    os.environ[ENV] = json.dumps(result)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


def handed(cfg) -> dict | None:
    """The result :func:`handed_over` gave this process, when it is the check of ``cfg``."""
    text = os.environ.get(ENV)
    if not text or cfg.data.decontaminate is None:
        return None
    try:
        result = json.loads(text)
    except ValueError:
        return None
    return result if isinstance(result, dict) and result.get("inputs") == inputs(cfg) else None


def record(cfg, out: Path) -> None:
    """Rank 0, once the run directory is prepared: ``RUN/decontamination.json``."""
    result = handed(cfg)
    if result is not None:
        (Path(out) / DECONTAMINATION).write_text(json.dumps(result, indent=1) + "\n")


def stored(out: Path) -> dict | None:
    """The run directory's result, None when it has none (or an unreadable one)."""
    try:
        result = json.loads((Path(out) / DECONTAMINATION).read_text())
    except (OSError, ValueError):
        return None
    return result if isinstance(result, dict) else None


def note_lines(out: Path) -> list[str]:
    """For the end-of-run headline: what the start found of the evaluation set in the shards."""
    result = stored(out)
    if result is None:
        return []
    return [
        f"note: {KEY} {result['target']}: {result['eval_found']} of its {result['eval_images']} images "
        f"had near-duplicates in the {result['samples_checked']} training samples checked "
        f"({_about(result)}{result['estimate']} copies in all; {DECONTAMINATION})"
    ]


def announce(out: Path, say: Callable[[str], None]) -> None:
    """Say :func:`note_lines` under the headline, indented as its rows are."""
    for line in note_lines(out):
        say("  " + line)


__all__ = [
    "announce",
    "ENV",
    "at_start",
    "cache_dir",
    "check",
    "handed",
    "handed_over",
    "note_lines",
    "record",
    "stored",
    "summary",
    "target_hashes",
]
