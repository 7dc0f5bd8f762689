"""Evaluation sets kept out of training: an evaluation set's images, their perceptual hashes, and
the pool samples that near-duplicate one of them.

A *target* names an evaluation set the way ``mmalign eval`` does (:func:`resolve`):

- a shipped suite's name (``cifar10``) or a suite YAML: the suite's dataset (shards, an image
  folder, the digits, as :mod:`mmalign.evaluation.datasets` reads them, ``limit`` and
  ``per_class`` included);
- ``cb:DIR``, or a folder in clip_benchmark's WebDataset layout (:mod:`.cb_wds`, split ``test``);
- a shard spec (``data/x/{00000..00009}.tar``, a list joined by ``::``, or a folder of ``.tar``
  files): every member image of the tars, captions or not (so a tar of class folders works too).

Anything else is one :class:`~mmalign.errors.UsageError` line. The images are hashed with
:mod:`mmalign.data.phash`; :func:`matches` finds, for each pool sample within ``radius`` bits of an
evaluation image (the pair distance of :func:`mmalign.data.phash.distance`), its nearest one,
through :func:`mmalign.data.hamming.near_pairs` run both ways. :func:`semantic_matches` does the
same with image embeddings (cosine > 1 - eps). Curate's ``--decontaminate`` and training's
``data.decontaminate`` both use them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mmalign.data import phash
from mmalign.errors import UsageError

# bits: one step (distances are even) looser than de-duplication's, as a missed test copy costs
# more than a dropped training image (docs/data.md, "Decontamination")
DEFAULT_DISTANCE = phash.DECONTAMINATE_DISTANCE
SEMANTIC_BLOCK = 2048  # pool rows a block against all evaluation rows (float32 (b, M))


@dataclass
class Target:
    """A resolved evaluation set: its name, the dataset mapping it is read from, and its files."""

    name: str  # as given
    spec: dict  # a dataset mapping of mmalign.evaluation.datasets, or {"type": "tars", "urls": [...]}
    files: list[str]  # the files its images come from (for the cache's fingerprint)


@dataclass
class EvalHashes:
    target: str
    keys: list[str]  # (M,) the evaluation images' keys, in the set's order
    query: np.ndarray  # (M, QUERIES, WORDS) uint64
    index: np.ndarray  # (M, VIEWS, WORDS) uint64
    # what could not be read, by reason: samples without a readable image, damaged tars (whose
    # later images are unknown); the images hashed are the rest
    skipped: dict[str, int] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.keys)

    def skip_line(self, what: str) -> str | None:
        """One line for what was skipped (None: nothing was)."""
        if not self.skipped:
            return None
        return (
            f"mmalign: {what}: {self.target}: skipped {skip_counts(self.skipped)}; the {len(self)} "
            "images read are the ones checked"
        )


def skip_counts(skipped: dict[str, int]) -> str:
    """``skipped`` (reason -> count) as words: "1 damaged tar(s), ..., 2 sample(s) ...";
    the report's summary and :meth:`EvalHashes.skip_line` say it alike."""
    return ", ".join(f"{n} {reason}" for reason, n in sorted(skipped.items()))


def _not_eval(target: str, what: str, why: str = "") -> UsageError:
    from mmalign import resources

    known = ", ".join(resources.names(resources.SUITES))
    detail = f": {why}" if why else ""
    return UsageError(
        f"{what}: {target!r} is not an evaluation set{detail} (a suite name: {known}; a suite YAML; "
        f"cb:DIR or a clip_benchmark folder; or .tar shards)"
    )


def _is_cb_folder(path: Path) -> bool:
    return path.is_dir() and any(p.name == "nshards.txt" for p in path.glob("*/nshards.txt"))


def resolve(target: str, what: str = "--decontaminate") -> Target:
    """The evaluation set ``target`` names (module docstring), its files checked; one line otherwise.
    Reads no image."""
    from mmalign import resources
    from mmalign.data.shards import expand_urls
    from mmalign.evaluation.cb_wds import PREFIX, cb_suite, is_cb

    target = str(target).strip()
    if not target:
        raise _not_eval(target, what, "empty")
    path = Path(target)
    if is_cb(target) or _is_cb_folder(path):
        root = target[len(PREFIX) :] if is_cb(target) else target
        spec = cb_suite(root, "test")["dataset"]
        return Target(target, spec, list(spec["urls"]))
    if path.is_file() and path.suffix in (".yaml", ".yml") or resources.shipped(resources.SUITES, target):
        return _suite_target(target, what)
    if path.is_dir():
        urls = sorted(str(p) for p in path.glob("*.tar"))
        if not urls:
            raise _not_eval(target, what, "a folder without .tar shards or a clip_benchmark layout")
    else:
        urls = expand_urls(target)
    if not urls or not all(u.endswith(".tar") for u in urls):
        raise _not_eval(target, what)
    missing = [u for u in urls if not Path(u).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UsageError(f"{what}: shard {missing[0]} not found{more}")
    return Target(target, {"type": "tars", "urls": urls}, urls)


def _suite_target(target: str, what: str) -> Target:
    from mmalign.data.shards import expand_urls
    from mmalign.evaluation.datasets import dataset_spec
    from mmalign.evaluation.suite import load_suite

    suite = load_suite(target)
    spec = suite.get("dataset")
    if spec is None or isinstance(spec, (str, list)):
        spec = {"type": "shards", "urls": spec}
    if spec.get("type") == "shards" and not spec.get("urls"):
        raise UsageError(f"{what}: suite {target!r} names no shards (it reads the run's data.val)")
    spec = dataset_spec(suite)
    files: list[str] = []
    if spec["type"] in ("shards", "cb_wds"):
        files = expand_urls(spec["urls"])
        missing = [u for u in files if "://" not in u and not Path(u).is_file()]
        if missing:
            raise UsageError(f"{what}: suite {target!r}: shard {missing[0]} not found")
    elif spec["type"] == "imagefolder":
        if not Path(str(spec.get("path"))).exists():
            raise UsageError(f"{what}: suite {target!r}: image folder {spec.get('path')!r} not found")
        files = [str(spec["path"])]
    return Target(target, spec, files)


def shard_images(
    url: str, max_member: int | None = None, max_pixels: int | None = None, skip_oversized: bool = False
) -> Iterator[tuple[str, object | None]]:
    """``(key, PIL image)`` of each sample of one tar, in order; the image None when the sample has
    no readable one (none, an unsafe name, a bad image; with ``skip_oversized``, any member over
    ``max_member``, as training skips it). A damaged tar raises as :func:`iter_tar_groups` does."""
    from mmalign.data.shards import IMAGE_EXTS, MAX_MEMBER_BYTES, BadSample, iter_tar_groups, open_image

    for raw in iter_tar_groups(url, MAX_MEMBER_BYTES if max_member is None else max_member):
        key = raw["__key__"].removeprefix("./")  # a class folder stays in the key
        data = next((raw[e] for e in IMAGE_EXTS if e in raw), None)
        if data is None or raw.get("__unsafe__") or (skip_oversized and raw.get("__oversized__")):
            yield key, None
            continue
        try:
            yield key, open_image(data, max_pixels)
        except BadSample:
            yield key, None


NO_IMAGE = "sample(s) without a readable image"
DAMAGED_TAR = "damaged tar(s), read up to the damage"


def _tar_images(urls: list[str], skipped: dict[str, int]) -> Iterator[tuple[str, object]]:
    """Every decodable image member of the tars, keyed by its name in the tar; what cannot be
    read is counted in ``skipped`` by reason."""
    from mmalign.data.shards import CorruptTar, TruncatedTar

    for url in urls:
        try:
            for key, image in shard_images(url):
                if image is None:
                    skipped[NO_IMAGE] = skipped.get(NO_IMAGE, 0) + 1
                else:
                    yield key, image
        except (TruncatedTar, CorruptTar, OSError):
            skipped[DAMAGED_TAR] = skipped.get(DAMAGED_TAR, 0) + 1


def eval_images(
    target: str | Target, what: str = "--decontaminate", skipped: dict[str, int] | None = None
) -> Iterator[tuple[str, object]]:
    """``(key, PIL image)`` of every image of the evaluation set ``target``, in its order; a tar
    target's unreadable samples and damaged tars are counted in ``skipped``."""
    from mmalign.evaluation.datasets import iter_dataset

    t = target if isinstance(target, Target) else resolve(target, what)
    if t.spec["type"] == "tars":
        yield from _tar_images(t.spec["urls"], {} if skipped is None else skipped)
        return
    for sample in iter_dataset(t.spec):
        yield str(sample["key"]), sample["image"]


def fingerprint(t: Target) -> str:
    """What the hashes of ``t`` depend on: its dataset mapping, its files' sizes and mtimes, the hash's version."""
    stats = []
    for f in t.files:
        try:
            st = os.stat(f)
            stats.append([os.path.abspath(f), st.st_size, st.st_mtime_ns])
        except OSError:
            stats.append([f, None, None])
    blob = json.dumps({"spec": t.spec, "files": stats, "phash": phash.VERSION}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def eval_hashes(
    target: str | Target,
    *,
    what: str = "--decontaminate",
    progress: bool = False,
    cache_dir: str | Path | None = None,
) -> EvalHashes:
    """The perceptual hashes of every image of ``target``, with the count of what could not be
    read. With ``cache_dir`` they are kept there as ``eval_phash_<fingerprint>.npz`` and read back
    while the set's files and the hash are unchanged."""
    from mmalign.progress import track

    t = target if isinstance(target, Target) else resolve(target, what)
    cached = Path(cache_dir) / f"eval_phash_{fingerprint(t)}.npz" if cache_dir is not None else None
    if cached is not None and cached.is_file():
        with np.load(cached) as z:
            told = json.loads(str(z["skipped"])) if "skipped" in z.files else {}
            return EvalHashes(t.name, [str(k) for k in z["keys"]], z["query"], z["index"], told)
    keys: list[str] = []
    skipped: dict[str, int] = {}

    def images():  # the set's images, its keys noted on the way (phash hashes them a block at a time)
        read = eval_images(t, what, skipped)
        for key, image in track(read, f"{t.name}: hashing", unit="images", enabled=progress):
            keys.append(key)
            yield image

    query, index = phash.hash_images(images())
    if not keys:
        raise UsageError(f"{what}: {t.name!r} holds no readable images")
    out = EvalHashes(t.name, keys, query, index, skipped)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_name(f".{cached.name}.tmp{os.getpid()}")
        with open(tmp, "wb") as f:  # np.savez on a name would append .npz to the temporary one
            np.savez(
                f,
                keys=np.array(keys, dtype=str),
                query=out.query,
                index=out.index,
                skipped=json.dumps(skipped),
            )
        os.replace(tmp, cached)
    return out


def _nearest(rows: np.ndarray, other: np.ndarray, value: np.ndarray, smaller_is_nearer: bool):
    """One (row, other, value) per row: the nearest ``other`` (ties: the first), rows ascending."""
    if rows.size == 0:
        return rows.astype(np.int64), other.astype(np.int64), value
    key = value if smaller_is_nearer else -value
    order = np.lexsort((other, key, rows))  # by row, then nearest, then the first other
    rows, other, value = rows[order], other[order], value[order]
    first = np.r_[True, rows[1:] != rows[:-1]]
    return rows[first].astype(np.int64), other[first].astype(np.int64), value[first]


def pairs(
    pool_query: np.ndarray,
    pool_index: np.ndarray,
    eval_query: np.ndarray,
    eval_index: np.ndarray,
    radius: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (pool row, evaluation row, distance) within ``radius`` bits, found either way round (a
    pair found both ways appears twice). The distance is :func:`mmalign.data.phash.distance`'s: a
    pool query hash against the evaluation index hashes, or an evaluation query hash against the
    pool's index hashes."""
    from mmalign.data.hamming import near_pairs

    radius = phash.check_distance(radius)
    a1, b1, d1 = near_pairs(
        pool_query, eval_index, radius
    )  # (pool, eval): a pool image or mirror in eval's views
    b2, a2, d2 = near_pairs(
        eval_query, pool_index, radius
    )  # (eval, pool): eval's image or mirror in the pool's
    rows = np.concatenate([np.asarray(a1, np.int64), np.asarray(a2, np.int64)])
    other = np.concatenate([np.asarray(b1, np.int64), np.asarray(b2, np.int64)])
    dist = np.concatenate([np.asarray(d1, np.int64), np.asarray(d2, np.int64)])
    return rows, other, dist


def nearest(
    rows: np.ndarray, other: np.ndarray, dist: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`pairs` reduced to each pool row once, with its nearest evaluation row (ties: the first)."""
    return _nearest(rows, other, dist, smaller_is_nearer=True)


def matches(
    pool_query: np.ndarray,
    pool_index: np.ndarray,
    eval_query: np.ndarray,
    eval_index: np.ndarray,
    radius: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pool sample within ``radius`` bits of an evaluation image, once: ``(pool_rows, eval_rows,
    distance)``, pool rows ascending, each with its nearest evaluation image (ties: the first)."""
    return nearest(*pairs(pool_query, pool_index, eval_query, eval_index, radius))


def semantic_matches(
    pool_emb: np.ndarray, eval_emb: np.ndarray, eps: float, block: int = SEMANTIC_BLOCK
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each pool sample whose image embedding has cosine > 1 - eps with an evaluation image's:
    ``(pool_rows, eval_rows, cosine)``, its most similar one (ties: the first), pool rows ascending.
    (N, D) and (M, D), any float dtype; compared in float32 after L2 normalisation, ``block`` pool
    rows at a time (a (block, M) matrix is what is held)."""

    def unit(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)

    e = unit(eval_emb)  # (M, D)
    rows, others, cos = [], [], []
    if len(e) == 0:
        empty = np.zeros(0, np.int64)
        return empty, empty, np.zeros(0)
    for s in range(0, len(pool_emb), block):
        sim = unit(pool_emb[s : s + block]) @ e.T  # (b, M)
        best = sim.argmax(axis=1)  # (b,) the first of the highest
        value = sim[np.arange(len(sim)), best]
        hit = np.flatnonzero(value > 1.0 - eps)
        rows.append(s + hit)
        others.append(best[hit])
        cos.append(value[hit].astype(np.float64))
    return (
        np.concatenate(rows).astype(np.int64),
        np.concatenate(others).astype(np.int64),
        np.concatenate(cos).clip(-1.0, 1.0),
    )
