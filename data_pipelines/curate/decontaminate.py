"""``mmalign curate --decontaminate TARGET``: pool samples whose image near-duplicates an image of
an evaluation set are dropped, and the report shows each beside the image it copies.

TARGET is what :func:`mmalign.evaluation.contamination.resolve` accepts (a suite name or YAML,
``cb:DIR`` or a clip_benchmark folder, .tar shards); the flag repeats, and each value may be a
comma list. Per target:

- **perceptual** (always): the pool's hashes from pass 1 (``OUT/pool/NNNNN.phash.npy``) against
  the target's (hashed once, cached in ``OUT/pool/decontaminate/`` while its files are unchanged),
  within ``--decontaminate-distance`` bits (:func:`mmalign.evaluation.contamination.matches`);
- **semantic** (with ``--model``): the pool's image embeddings against the target's, embedded
  with the same model, cosine > 1 - ``--dedupe-eps``.

Every pool sample is checked, exact copies included: a copy of a test image is dropped wherever
it is. A sample matched by a target is listed once for it, with its nearest image there (the
perceptual match first; else the semantic one).
"""

from __future__ import annotations

import html
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from data_pipelines.curate.embed_pass import split_hashes
from data_pipelines.curate.report import thumbnail_uri
from data_pipelines.curate.scores import _unit_rows
from mmalign.data import phash
from mmalign.errors import UsageError

CACHE = "decontaminate"  # under OUT/pool: the targets' hashes
SHOWN = 200  # match pairs the HTML report shows (the JSON lists all)


def parse_targets(values) -> tuple[str, ...]:
    """``--decontaminate`` values (repeated, each possibly a comma list) -> the targets, in order, once each."""
    out: list[str] = []
    for value in values or ():
        for part in str(value).split(","):
            if part.strip() and part.strip() not in out:
                out.append(part.strip())
    return tuple(out)


def radius(distance: int | None) -> int:
    """``--decontaminate-distance`` as given, else :data:`mmalign.data.phash.DECONTAMINATE_DISTANCE`
    (:mod:`mmalign.evaluation.contamination`'s default, read without importing the evaluation
    package: a usage error stays a line before torch's seconds)."""
    return phash.DECONTAMINATE_DISTANCE if distance is None else int(distance)


def check(targets: tuple[str, ...], distance) -> None:
    """The flags' one-line errors, before any data is read: the distance's range, each target's kind."""
    try:
        phash.check_distance(radius(distance) if distance is None else distance)
    except ValueError as e:
        raise UsageError(f"--decontaminate-distance: {e}") from None
    if targets:  # the evaluation package (and torch) only when there is a target to read
        from mmalign.evaluation.contamination import resolve

        for t in targets:
            resolve(t, "--decontaminate")


@dataclass
class Contamination:
    """The matches of every target: one row per (pool sample, target)."""

    pool_rows: np.ndarray  # (K,) int64
    target: list[str]  # (K,)
    eval_row: np.ndarray  # (K,) int64, the evaluation image's place in its target
    eval_key: list[str]  # (K,)
    distance: np.ndarray  # (K,) int64 bits (the pair distance, also for a semantic match)
    cosine: np.ndarray  # (K,) float64, NaN without a model
    by: list[str]  # (K,) "perceptual", "semantic" or "perceptual+semantic"
    targets: list[dict] = field(default_factory=list)  # per target: name, images, matched
    semantic: bool = False  # the semantic detector ran (a model was given)
    thumbs: dict = field(default_factory=dict)  # (target, eval row) -> data URI, for the report

    def clean(self, n: int) -> np.ndarray:
        """(n,) bool: no target's image is near the sample."""
        keep = np.ones(n, dtype=bool)
        keep[self.pool_rows] = False
        return keep

    def reasons(self) -> dict[int, list[str]]:
        """Pool row -> its reasons, "near-duplicate of TARGET image KEY (d bits[, cosine c])"."""
        out: dict[int, list[str]] = {}
        for k, row in enumerate(self.pool_rows.tolist()):
            cos = "" if np.isnan(self.cosine[k]) else f", cosine {self.cosine[k]:.4f}"
            out.setdefault(row, []).append(
                f"near-duplicate of {self.target[k]} image {self.eval_key[k]} ({int(self.distance[k])} bits{cos})"
            )
        return out


def _eval_embeddings(target: str, keys: list[str], loaded, batch_size: int, device: str) -> np.ndarray:
    """(M, D) float32 L2-normalised embeddings of the target's images, as pass 1 embeds the pool's."""
    from data_pipelines.curate.embed_pass import ShardEmbedder
    from mmalign.evaluation.contamination import eval_images

    embedder = ShardEmbedder(loaded, batch_size=batch_size, device=device)
    embs: list[np.ndarray] = []
    batch: list = []
    for _, image in eval_images(target):
        batch.append(image)
        if len(batch) == batch_size:  # bounded: a batch of decoded images at a time
            embs.append(embedder.encode_images([im.convert("RGB") for im in batch]))
            batch = []
    if batch:
        embs.append(embedder.encode_images([im.convert("RGB") for im in batch]))
    emb = np.concatenate(embs) if embs else np.zeros((0, 0), np.float32)
    if len(emb) != len(keys):  # the set changed between its hashing and its embedding
        raise UsageError(f"--decontaminate: {target} changed while it was read; run again")
    return emb


def find(
    out: Path,
    pool,
    targets: tuple[str, ...],
    distance: int | None,
    *,
    loaded=None,
    eps: float = 0.002,
    batch_size: int = 64,
    device: str = "cpu",
    progress: bool = True,
) -> Contamination:
    """Every target's matches in ``pool`` (its ``phash``: (N, Q + V, W); its ``image`` embeddings
    when ``loaded``, the model, is given)."""
    from mmalign.evaluation.contamination import eval_hashes, matches, semantic_matches

    if pool.phash is None:
        raise RuntimeError("--decontaminate without the pool's hashes (hash_pass.ensure_hashes)")
    distance = radius(distance)
    pq, pi = split_hashes(pool.phash)  # (N, Q, W), (N, V, W)
    semantic = loaded is not None and pool.image.ndim == 2 and pool.image.shape[1] > 0
    parts: list[dict] = []
    summary: list[dict] = []
    for target in targets:
        ev = eval_hashes(target, progress=progress, cache_dir=out / "pool" / CACHE)
        skipped = ev.skip_line("curate: --decontaminate")
        if skipped is not None:  # counted, never silent
            print(skipped, file=sys.stderr, flush=True)
        rows, others, dist = matches(pq, pi, ev.query, ev.index, distance)  # (k,) each
        found = {int(r): (int(o), "perceptual") for r, o in zip(rows, others)}
        emb = None
        if semantic:
            emb = _eval_embeddings(target, ev.keys, loaded, batch_size, device)  # (M, D)
            srows, sothers, _ = semantic_matches(pool.image, emb, eps)
            for r, o in zip(srows.tolist(), sothers.tolist()):
                if r in found:
                    found[r] = (found[r][0], "perceptual+semantic")
                else:
                    found[r] = (o, "semantic")
        prow = np.array(sorted(found), dtype=np.int64)
        erow = np.array([found[r][0] for r in prow.tolist()], dtype=np.int64)
        cos = np.full(len(prow), np.nan)
        if emb is not None and len(prow):
            a = _unit_rows(pool.image[prow])  # (k, D) float64
            cos = np.einsum("kd,kd->k", a, emb[erow].astype(np.float64)).clip(-1.0, 1.0)
        parts.append(
            {
                "pool_rows": prow,
                "target": [target] * len(prow),
                "eval_row": erow,
                "eval_key": [ev.keys[e] for e in erow.tolist()],
                "distance": phash.distances(pq[prow], pi[prow], ev.query[erow], ev.index[erow]),
                "cosine": cos,
                "by": [found[r][1] for r in prow.tolist()],
            }
        )
        summary.append(
            {"target": target, "images": len(ev), "skipped": ev.skipped, "matched_pool_samples": len(prow)}
        )
        if progress:
            print(
                f"mmalign: curate: --decontaminate {target}: {len(prow)} pool sample(s) near-duplicate "
                f"{len(set(erow.tolist()))} of its {len(ev)} images",
                flush=True,
            )
    cat = lambda name: [x for p in parts for x in p[name]]  # noqa: E731
    return Contamination(
        pool_rows=np.array(cat("pool_rows"), dtype=np.int64),
        target=cat("target"),
        eval_row=np.array(cat("eval_row"), dtype=np.int64),
        eval_key=cat("eval_key"),
        distance=np.array(cat("distance"), dtype=np.int64),
        cosine=np.array(cat("cosine"), dtype=np.float64),
        by=cat("by"),
        targets=summary,
        semantic=semantic,
    )


def contamination_for_run(opts, out: Path, pool) -> Contamination | None:
    """``mmalign curate``'s call (:class:`data_pipelines.curate.run.Options`): None without
    ``--decontaminate``; else :func:`find` on the pool (whose hashes the run ensured before loading
    it: ``Policies.needs_hashes``), with the model when ``--model`` is given."""
    p = opts.policies
    if not p.decontaminate:
        return None
    loaded = None
    if opts.model is not None:
        from mmalign.models.load import load

        loaded = load(opts.model, device=opts.device)
    return find(
        out,
        pool,
        p.decontaminate,
        p.decontaminate_distance,
        loaded=loaded,
        eps=p.dedupe_eps,
        batch_size=opts.batch_size,
        device=opts.device,
        progress=opts.progress,
    )


# ------------------------------------------------------------------ report


def report_json(c: Contamination, pool, policies) -> dict:
    """The report's ``decontamination`` entry: the settings, per target its counts, and every match."""
    keys = pool.frame["key"].tolist()
    shards = pool.frame["shard"].tolist()
    return {
        "distance_bits": radius(policies.decontaminate_distance),
        "semantic_eps": policies.dedupe_eps if c.semantic else None,
        "targets": c.targets,
        "dropped": int(np.unique(c.pool_rows).size),
        "matches": [
            {
                "pool_key": keys[r],
                "pool_shard": int(shards[r]),
                "target": c.target[k],
                "eval_key": c.eval_key[k],
                "distance_bits": int(c.distance[k]),
                "cosine": None if np.isnan(c.cosine[k]) else round(float(c.cosine[k]), 6),
                "by": c.by[k],
            }
            for k, r in enumerate(c.pool_rows.tolist())
        ],
    }


def eval_thumbs(c: Contamination, shown: int = SHOWN) -> None:
    """Thumbnails of the evaluation images of the first ``shown`` matches, read back from their sets."""
    from mmalign.evaluation.contamination import eval_images

    wanted: dict[str, set[int]] = {}
    for k in range(min(shown, len(c.pool_rows))):
        wanted.setdefault(c.target[k], set()).add(int(c.eval_row[k]))
    for target, rows in wanted.items():
        last = max(rows)
        for i, (_, image) in enumerate(eval_images(target)):
            if i in rows:
                c.thumbs[(target, i)] = thumbnail_uri(image)
            if i >= last:
                break


def html_section(c: Contamination, pool, pool_thumbs: dict[int, str], shown: int = SHOWN) -> str:
    """Each dropped pool sample (left) beside the evaluation image it copies (right)."""
    from mmalign.evaluation.contamination import skip_counts

    counts = "; ".join(
        f"{t['target']}: {t['matched_pool_samples']} pool sample(s) near its {t['images']} images"
        + (f" (skipped {skip_counts(t['skipped'])})" if t.get("skipped") else "")
        for t in c.targets
    )
    body = [
        "<style>.pair{display:inline-block;margin:4px 12px 4px 0;border:1px solid #ddd;padding:2px}</style>",
        f"<h2>Decontamination</h2><p>{html.escape(counts)}. Pool sample left, evaluation image right.</p>",
    ]
    keys = pool.frame["key"].tolist()

    def img(src: str | None) -> str:
        return f'<img src="{src}">' if src else '<div class="missing">(no image)</div>'

    for k in range(min(shown, len(c.pool_rows))):
        r = int(c.pool_rows[k])
        cos = "" if np.isnan(c.cosine[k]) else f", cosine {c.cosine[k]:.4f}"
        body.append(
            "<div class='pair'>"
            f"<figure>{img(pool_thumbs.get(r))}<figcaption>pool {html.escape(str(keys[r]))}</figcaption></figure>"
            f"<figure>{img(c.thumbs.get((c.target[k], int(c.eval_row[k]))))}<figcaption>"
            f"{html.escape(c.target[k])} {html.escape(c.eval_key[k])}<br>{int(c.distance[k])} bits{cos} "
            f"({c.by[k]})</figcaption></figure></div>"
        )
    if len(c.pool_rows) > shown:
        body.append(f"<p>{len(c.pool_rows) - shown} more matches in curate_report.json.</p>")
    return "\n".join(body)
