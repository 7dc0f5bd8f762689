"""``OUT/curate_report.json`` and ``OUT/curate_report.html``: what curation did to the pool.

The JSON holds the counts (pool, skips by reason, kept per policy alone and together), the
threshold, a histogram of the CLIP scores, the duplicate groups' sizes and two histograms to
pick eps from (each removed duplicate's cosine with its kept member; each sample's highest
cosine with another sample of its cluster). The HTML page is self-contained (images inline,
no script, no network): the score histogram with the threshold, the kept fraction per policy,
the similarity histograms with 1 - eps, the dropped pairs of lowest score as thumbnails with
their captions, and the largest duplicate groups with their sizes, the kept member outlined
and each other member's cosine to it. With perceptual de-duplication the JSON adds a histogram
of each removed duplicate's distance in bits to its kept member, and each group member shows
that distance too. A run without a model has no scores: its report says "no model".
"""

from __future__ import annotations

import base64
import html
import io
import json
import logging
from pathlib import Path

import numpy as np

from mmalign.data.phash import BITS

log = logging.getLogger("mmalign.curate")

REPORT_JSON = "curate_report.json"
REPORT_HTML = "curate_report.html"
BINS = 40
THUMB = 96  # pixels, the longer side


def histogram(scores: np.ndarray, bins: int = BINS) -> dict:
    scores = np.asarray(scores, dtype=np.float64)  # float32 edges 1e-6 apart near 1 would collide
    if scores.size == 0:
        return {"edges": [], "counts": []}
    lo, hi = float(scores.min()), float(scores.max())
    if hi - lo < 1e-6:  # (nearly) one value: a range numpy can split into bins
        hi = lo + 1e-6
    counts, edges = np.histogram(scores, bins=bins, range=(lo, hi))
    return {"edges": [round(float(e), 6) for e in edges], "counts": [int(c) for c in counts]}


def skips(stats: list[dict]) -> dict[str, int]:
    """Pass 1's skipped samples by reason, summed over the shards' stats, reasons sorted."""
    total: dict[str, int] = {}
    for s in stats:
        for reason, count in s["skipped"].items():
            total[reason] = total.get(reason, 0) + count
    return dict(sorted(total.items()))


def summary(pool, decisions, policies, extra: dict) -> dict:
    """The report's JSON content."""
    n = len(pool)
    scores = pool.frame["clip_score"].to_numpy(np.float64) if n else np.zeros(0)
    scores = scores[~np.isnan(scores)]  # a run without a model scores nothing
    skipped = skips(pool.stats)

    def kept(mask) -> dict:
        k = int(np.asarray(mask).sum())
        return {"kept": k, "fraction": round(k / n, 6) if n else 0.0}

    report = {
        "pool": {
            "shards": len(pool.stats),
            "samples": sum(s["samples"] for s in pool.stats),
            "readable": n,
            "skipped": skipped,
            "shards_ended_early": sum(1 for s in pool.stats if s["ended_early"]),
        },
        "policies": {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(policies).items()},
        "clip_score": (
            {
                "mean": round(float(scores.mean()), 6),
                "min": round(float(scores.min()), 6),
                "max": round(float(scores.max()), 6),
                "quantiles": {
                    str(q): round(float(np.quantile(scores, q)), 6) for q in (0.1, 0.25, 0.5, 0.7, 0.75, 0.9)
                },
            }
            if scores.size
            else None
        ),
        "threshold": decisions.threshold,
        "histogram": histogram(scores),
        "kept_by_policy": {name: kept(mask) for name, mask in decisions.by_policy.items()},
        "kept": kept(decisions.keep),
        "dedupe": {
            **decisions.info,
            "clusters": decisions.clusters,
            **_similarities(decisions),
            **_distances(decisions, pool),
        },
        **extra,
    }
    if decisions.group_field is not None:
        groups = decisions.groups["combined"]
        _, counts = np.unique(groups, return_counts=True)
        report["false_negative_groups"] = {
            "field": policies.false_negative_field,
            "groups_of_more_than_one": int((counts > 1).sum()),
            "samples_in_them": int(counts[counts > 1].sum()),
        }
    if decisions.contamination is not None:  # every match, beside its evaluation image's key
        from data_pipelines.curate.decontaminate import report_json

        report["decontamination"] = report_json(decisions.contamination, pool, policies)
    return report


def _similarities(decisions) -> dict:
    """Histograms for picking eps: each removed duplicate's cosine with its kept member, and each
    sample's highest cosine with another sample of its cluster (semantic de-duplication only)."""
    out = {}
    if decisions.similarity is not None and "combined" in decisions.groups:
        moved = decisions.groups["combined"] != np.arange(decisions.similarity.size)
        out["duplicate_similarity"] = histogram(decisions.similarity[moved])
    if decisions.nearest is not None:
        near = decisions.nearest[~np.isnan(decisions.nearest)]
        out["nearest_similarity"] = histogram(near)
        out["nearest_similarity_quantiles"] = (
            {str(q): round(float(np.quantile(near, q)), 6) for q in (0.01, 0.05, 0.1, 0.5, 0.9, 0.99)}
            if near.size
            else {}
        )
    return out


def _distances(decisions, pool) -> dict:
    """Perceptual de-duplication: each removed duplicate's distance in bits to its kept member,
    as counts per bit (0, 1, ...); exact copies (distance 0 by construction) left out."""
    if decisions.distance is None or "perceptual" not in decisions.groups:
        return {}
    combined = decisions.groups["combined"]
    moved = combined != np.arange(combined.size)
    if "exact" in decisions.groups:
        moved &= decisions.groups["exact"] != combined  # not an exact copy of its kept member
    bits = np.bincount(decisions.distance[moved], minlength=1)
    return {"perceptual_distance": {"bits": list(range(bits.size)), "counts": [int(c) for c in bits]}}


# ------------------------------------------------------------------ html


def thumbnail_uri(image) -> str:
    """A PIL image as an inline JPEG data URI, THUMB pixels on its longer side."""
    image = image.convert("RGB")
    image.thumbnail((THUMB, THUMB))
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _thumbs(urls: list[str], pool, rows: list[int], remote=None) -> dict[int, str]:
    """Pool rows -> inline JPEG data URIs of their images (read back from the shards)."""
    from PIL import Image

    from mmalign.data.tario import iter_samples, open_shard

    frame = pool.frame
    out: dict[int, str] = {}
    by_shard: dict[int, dict[int, int]] = {}
    for r in rows:
        by_shard.setdefault(int(frame["shard"].iat[r]), {})[int(frame["index"].iat[r])] = r
    for u, wanted in by_shard.items():
        try:
            with open_shard(urls[u], remote) as f:
                for raw in iter_samples(f, keep=wanted.__contains__):
                    row = wanted.get(raw.index)
                    data = next(
                        (raw.members[e] for e in ("jpg", "jpeg", "png", "webp") if e in raw.members), None
                    )
                    if row is None or data is None:
                        continue
                    out[row] = thumbnail_uri(Image.open(io.BytesIO(data)))
        except Exception as e:  # a thumbnail is decoration: the report is written without it
            log.warning("curate report: no thumbnails from %s (%s)", urls[u], e)
    return out


def _svg_histogram(hist: dict, threshold: float | None, label: str = "threshold") -> str:
    counts, edges = hist["counts"], hist["edges"]
    if not counts:
        return "<p>(no values)</p>"
    w, h, top = 640, 200, max(counts) or 1
    bar = w / len(counts)
    parts = [f'<svg width="{w}" height="{h + 30}" xmlns="http://www.w3.org/2000/svg">']
    for i, c in enumerate(counts):
        bh = h * c / top
        parts.append(
            f'<rect x="{i * bar:.1f}" y="{h - bh:.1f}" width="{bar - 1:.1f}" height="{bh:.1f}" '
            f'fill="#4a7bb7"><title>{edges[i]:.3f} to {edges[i + 1]:.3f}: {c}</title></rect>'
        )
    lo, hi = edges[0], edges[-1]
    if threshold is not None and lo <= threshold <= hi:
        x = w * (threshold - lo) / (hi - lo)
        parts.append(f'<line x1="{x:.1f}" y1="0" x2="{x:.1f}" y2="{h}" stroke="#c0392b" stroke-width="2"/>')
        parts.append(
            f'<text x="{x + 4:.1f}" y="14" font-size="12" fill="#c0392b">{label} {threshold:.3f}</text>'
        )
    parts.append(f'<text x="0" y="{h + 20}" font-size="12">{lo:.3f}</text>')
    parts.append(f'<text x="{w - 50}" y="{h + 20}" font-size="12">{hi:.3f}</text></svg>')
    return "".join(parts)


def _card(
    src: str | None,
    caption: str,
    score: float,
    kept: bool | None = None,
    similarity: float | None = None,
    bits: int | None = None,
) -> str:
    style = "border:3px solid #27ae60" if kept else "border:3px solid transparent"
    image = f'<img src="{src}" style="{style}">' if src else '<div class="missing">(no image)</div>'
    sim = "" if similarity is None or kept else f"<br>cosine to kept {similarity:.4f}"
    sim += "" if bits is None or kept else f"<br>{bits} bits from kept"
    shown = "no model" if np.isnan(score) else f"{score:.3f}"
    return (
        f"<figure>{image}<figcaption>{html.escape(caption[:120])}<br><b>{shown}</b>"
        f"{' kept' if kept else ''}{sim}</figcaption></figure>"
    )


def write(
    out: Path,
    urls: list[str],
    pool,
    decisions,
    report: dict,
    *,
    examples: int = 24,
    groups: int = 8,
    remote=None,
) -> None:
    (out / REPORT_JSON).write_text(json.dumps(report, indent=2))
    frame = pool.frame
    scores = frame["clip_score"].to_numpy() if len(frame) else np.zeros(0)
    dropped = []
    if "clip_score" in decisions.by_policy:
        low = np.flatnonzero(~decisions.by_policy["clip_score"])
        dropped = low[np.argsort(scores[low], kind="stable")][:examples].tolist()
    shown_groups = []  # (group size, shown members: the kept one first, then by cosine to it, lowest first)
    if "combined" in decisions.groups:
        g = decisions.groups["combined"]
        ids, counts = np.unique(g, return_counts=True)
        largest = np.argsort(-counts, kind="stable")[:groups]
        for gid, count in zip(ids[largest], counts[largest]):
            members = np.flatnonzero(g == gid)
            if members.size > 1:
                others = members[members != gid]
                far = (
                    -decisions.distance[others]
                    if decisions.similarity is None
                    else decisions.similarity[others]
                )
                others = others[np.argsort(far, kind="stable")]  # the least similar first
                shown_groups.append((int(count), [int(gid)] + others[:7].tolist()))
    from data_pipelines.curate import decontaminate

    near = decisions.contamination
    near_rows = [] if near is None else near.pool_rows[: decontaminate.SHOWN].tolist()
    thumbs = _thumbs(urls, pool, dropped + [r for _, grp in shown_groups for r in grp] + near_rows, remote)
    captions = frame["caption"].tolist() if len(frame) else []
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{v['kept']}</td><td>{100 * v['fraction']:.2f}%</td></tr>"
        for name, v in [*report["kept_by_policy"].items(), ("all policies", report["kept"])]
    )
    body = [
        "<!doctype html><meta charset='utf-8'><title>mmalign curate report</title>",
        "<style>body{font-family:sans-serif;margin:2em}figure{display:inline-block;width:110px;margin:4px;"
        "vertical-align:top;font-size:11px}img{max-width:100px}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:4px 8px}.group{margin-bottom:1em}</style>",
        "<h1>mmalign curate report</h1>",
        ""
        if report.get("model")
        else "<p>No model: no CLIP scores; de-duplication by image bytes and hashes.</p>",
        f"<p>{report['pool']['readable']} readable samples of {report['pool']['samples']} in "
        f"{report['pool']['shards']} shards; skipped: {html.escape(json.dumps(report['pool']['skipped']))}.</p>",
        "<h2>CLIP score histogram</h2>",
        _svg_histogram(report["histogram"], decisions.threshold),
        "<h2>Kept per policy</h2><table><tr><th>policy</th><th>kept</th><th>fraction</th></tr>",
        rows,
        "</table>",
    ]
    if dropped:
        body.append(f"<h2>Dropped by score: the {len(dropped)} lowest</h2>")
        body += [_card(thumbs.get(r), captions[r], float(scores[r])) for r in dropped]
    dedupe = report.get("dedupe", {})
    if "duplicate_similarity" in dedupe or "nearest_similarity" in dedupe:
        eps = report["policies"].get("dedupe_eps")
        line = None if eps is None or "semantic" not in report["policies"].get("dedupe", []) else 1.0 - eps
        body.append(
            "<h2>Similarities (to pick eps)</h2><p>A sample is a duplicate when its cosine with a kept "
            "sample exceeds 1 - eps. Near-copies sit in a spike close to 1; distinct images of one "
            "class form the broad hump below it. Put 1 - eps in the gap between the two, above the "
            "hump.</p>"
        )
        if "duplicate_similarity" in dedupe:
            body.append("<h3>Each removed duplicate's cosine with its kept member</h3>")
            body.append(_svg_histogram(dedupe["duplicate_similarity"], line, "1 - eps"))
        if "nearest_similarity" in dedupe:
            body.append("<h3>Each sample's highest cosine with another sample of its cluster</h3>")
            body.append(_svg_histogram(dedupe["nearest_similarity"], line, "1 - eps"))
    if shown_groups:
        body.append(
            f"<h2>The {len(shown_groups)} largest duplicate groups</h2><p>The kept member outlined "
            f"first, then the others, least similar first, with their cosine to the kept one (and their "
            f"perceptual distance in bits, of {BITS}).</p>"
        )
        for size, grp in shown_groups:
            cards = "".join(
                _card(
                    thumbs.get(r),
                    captions[r],
                    float(scores[r]),
                    r == grp[0],
                    None if decisions.similarity is None else float(decisions.similarity[r]),
                    None if decisions.distance is None else int(decisions.distance[r]),
                )
                for r in grp
            )
            more = f" ({size - len(grp)} more not shown)" if size > len(grp) else ""
            body.append(f"<div class='group'><p><b>group of {size}</b>{more}</p>{cards}</div>")
    if near is not None:  # each dropped sample beside the evaluation image it copies
        decontaminate.eval_thumbs(near)
        body.append(decontaminate.html_section(near, pool, thumbs))
    (out / REPORT_HTML).write_text("\n".join(body), encoding="utf-8")


def decisions_table(out: Path, pool, decisions) -> None:
    """``OUT/decisions.parquet``: per readable sample its shard, key, score, groups and verdicts, and
    ``reason`` ("kept", or the policies that dropped it: "clip_score", "exact duplicate of KEY",
    "perceptual duplicate of KEY", "semantic duplicate of KEY", joined by "; ") with
    ``duplicate_of`` (that KEY, else None)."""
    from data_pipelines.curate.decide import reasons

    frame = pool.frame[["shard", "key", "index", "clip_score"]].copy()
    for name, mask in decisions.by_policy.items():
        frame[f"kept_by_{name}"] = mask
    for name, groups in decisions.groups.items():
        frame[f"{name}_group"] = groups
    if decisions.group_field is not None:
        frame["false_negative_group"] = decisions.group_field
    if decisions.similarity is not None:
        frame["similarity_to_kept"] = decisions.similarity  # cosine with its group's kept member
    if decisions.nearest is not None:
        frame["nearest_similarity"] = decisions.nearest  # highest cosine with another sample of its cluster
    if decisions.distance is not None:
        frame["perceptual_distance"] = decisions.distance  # bits to its group's kept member
    frame["kept"] = decisions.keep
    frame["reason"], frame["duplicate_of"] = reasons(pool, decisions)
    frame.to_parquet(out / "decisions.parquet", index=False)
