"""``mmalign report --run DIR``: one HTML page and PNGs that show how a run went.

- ``curves.png``: the trainer's ``metrics.jsonl`` against step: loss with its
  chance floor log N, temperature (logit scale), positive rank and hardest-negative
  probability, in-batch top-1, probe effective ranks, throughput.
- ``similarity.png``: cosine of each caption with its own image against random
  non-matching pairs, with the AUC of the cosine as a match detector.
- ``tsne.png``: a t-SNE (van der Maaten & Hinton 2008) of the image embeddings,
  coloured by the suite's first zero-shot label (e.g. shape).
- ``recall.png``: Recall@k for k = 1..50 in both directions, with chance.
- ``index.html``: first the headline results (zero-shot top-1 / top-5, Recall@k) of the
  last evaluation file; then the figures, the embedding diagnostics, every evaluation file of
  the run (``eval.json`` and ``eval_step*.json``) and what ``mmalign eval`` wrote beside them
  (``eval_cli_*.json``), the run time, a data summary (shards and
  sample counts of data.train / data.val, the embedded sample's class mix and captions)
  and the resolved ``config.yaml``.

The figures after the first need the model (``final/``) and the suite's dataset
(the run's data.val by default); without them the page says what is missing.  The
embedded sample is a seeded random draw stratified by the suite's first zero-shot
label, not the first N images; the page warns when it holds one class, and marks
retrieval and the similarity figures as not meaningful when the suite's captions are
class templates (``template_captions``).
Matplotlib runs on the Agg backend: no display is needed.
"""

from __future__ import annotations

import html
import json
import re
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

import numpy as np
import torch

from mmalign.evaluation import headline
from mmalign.evaluation.caveats import TEMPLATE_CAVEAT, captions_are_templates
from mmalign.evaluation.datasets import dataset_spec, iter_dataset
from mmalign.evaluation.diagnostics import embedding_diagnostics, positive_negative_auc, similarity_samples
from mmalign.evaluation.features import embed_dataset
from mmalign.evaluation.retrieval import retrieval_ranks
from mmalign.evaluation.suite import label_field, load_suite
from mmalign.extras import extra
from mmalign.progress import track

# (title, keys drawn on one axes, dashed keys on the same axes)
CURVES = [
    ("contrastive loss", ["loss"], ["loss_floor"]),
    ("logit scale (1/temperature)", ["logit_scale"], []),
    ("rank of the positive (0 = first)", ["pos_rank"], []),
    ("hardest negative's probability", ["hardest_neg_prob"], []),
    ("in-batch top-1", ["top1"], []),
    ("effective rank of probe embeddings", ["probe_image_effective_rank", "probe_text_effective_rank"], []),
    ("throughput (samples/s)", ["samples_per_s"], []),
]
MAX_RECALL_K = 50


def _pyplot():
    """matplotlib.pyplot on the file-only Agg backend; imported by the plots that need it (this
    module is the one owner of matplotlib, and importing it costs about a second)."""
    with extra("report", "mmalign report"):
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

    return plt


def read_metrics(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a run killed mid-write leaves a partial last line
            continue
    return [r for r in rows if "step" in r]


def plot_curves(rows: list[dict], out: Path) -> Path | None:
    panels = [p for p in CURVES if any(k in r for r in rows for k in p[1])]
    if not panels:
        return None
    cols = 2
    plt = _pyplot()
    fig, axes = plt.subplots(
        (len(panels) + 1) // cols, cols, figsize=(11, 2.8 * ((len(panels) + 1) // cols)), squeeze=False
    )
    for ax, (title, keys, dashed) in zip(axes.flat, panels):
        for key, style in [(k, "-") for k in keys] + [(k, "--") for k in dashed]:
            pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float))]
            if pts:
                x, y = zip(*pts)
                label = "chance floor log N" if key == "loss_floor" else key
                ax.plot(x, y, style, label=label, color="gray" if style == "--" else None)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.grid(alpha=0.3)
        if len(keys) + len(dashed) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels) :]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_similarity(sims: dict, out: Path) -> Path:
    pos, neg = sims["positive"].numpy(), sims["negative"].numpy()
    auc = positive_negative_auc(sims["positive"], sims["negative"])
    lo, hi = min(pos.min(), neg.min()), max(pos.max(), neg.max())
    bins = np.linspace(lo, hi, 60)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for values, colour, label in (
        (neg, "tab:blue", f"non-matching pairs (n={len(neg)})"),
        (pos, "tab:orange", f"caption with its own image (n={len(pos)})"),
    ):
        # outlined, lightly filled: where the two masses overlap both stay readable
        ax.hist(values, bins=bins, density=True, histtype="stepfilled", alpha=0.25, color=colour)
        ax.hist(values, bins=bins, density=True, histtype="step", linewidth=1.5, color=colour, label=label)
        ax.axvline(float(values.mean()), color=colour, linestyle="--", linewidth=1)
    ax.set_xlabel("cosine similarity")
    ax.set_ylabel("density")
    ax.set_title(f"positive vs negative similarity (AUC {auc:.3f}; dashed: means)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _tsne() -> type:
    """sklearn's TSNE (importing sklearn costs about 1.5 s)."""
    with extra("report", "mmalign report"):
        from sklearn.manifold import TSNE

    return TSNE


def plot_tsne(features: torch.Tensor, labels: list[str], title: str, out: Path, seed: int = 0) -> Path:
    n = features.shape[0]
    xy = _tsne()(
        n_components=2, perplexity=float(min(30, max(2, (n - 1) // 3))), init="pca", random_state=seed
    ).fit_transform(features.numpy())  # (N, 2)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 6))
    classes = sorted(set(labels))
    cmap = plt.get_cmap("tab10" if len(classes) <= 10 else "tab20")
    for i, c in enumerate(classes):
        idx = [j for j, lab in enumerate(labels) if lab == c]
        ax.scatter(xy[idx, 0], xy[idx, 1], s=8, color=cmap(i % cmap.N), label=c)
    ax.set_title(title)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.legend(
        fontsize=7, markerscale=2, loc="upper left", bbox_to_anchor=(1.01, 1.0)
    )  # outside: never hides points
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_recall(t2i: torch.Tensor, i2t: torch.Tensor, n_images: int, n_captions: int, out: Path) -> Path:
    ks = np.arange(1, min(MAX_RECALL_K, n_images, n_captions) + 1)
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(
        ks, [(t2i < int(k)).float().mean().item() for k in ks], label="text->image (image_retrieval_recall@k)"
    )
    ax.plot(
        ks, [(i2t < int(k)).float().mean().item() for k in ks], label="image->text (text_retrieval_recall@k)"
    )
    ax.plot(ks, np.minimum(1, ks / n_images), "--", color="gray", label="chance, text->image (k/N)")
    ax.set_xlabel("k")
    ax.set_ylabel("Recall@k")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"Recall@k ({n_images} images, {n_captions} captions)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _table(rows: list[tuple]) -> str:
    cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in row) + "</tr>" for row in rows
    )
    return f"<table>{cells}</table>"


def _run_config(run: Path) -> dict:
    """The run's resolved config (``config.yaml``), else the one saved with ``final/``, else {}."""
    import yaml

    from mmalign.models.io import CONFIG as MODEL_CONFIG

    path = run / "config.yaml"
    if path.is_file():
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            data = None
        if isinstance(data, dict):
            return data
    meta = run / "final" / MODEL_CONFIG
    if meta.is_file():
        try:
            return json.loads(meta.read_text()).get("train_config", {}) or {}
        except (json.JSONDecodeError, OSError):
            pass
    return {}


def _fmt_spec(spec) -> str:
    if not spec:
        return "not set"
    try:
        return f"{spec}: {shard_summary(str(spec))}"
    except Exception as e:  # a malformed spec is described, never the end of a report
        return f"{spec}: {type(e).__name__}: {e}"


def _fmt(value) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _embed_run(
    run: Path, suite_name: str | None, data: str | None, limit: int, seed: int = 0, progress: bool = False
) -> tuple[dict, dict]:
    from mmalign.errors import UsageError
    from mmalign.models.load import load

    try:
        loaded = load(run)
    except UsageError as e:  # no model yet (a run without final/): the page says so and goes on
        raise FileNotFoundError(str(e)) from None
    train_cfg = loaded.config.get("train_config", {})
    suite = load_suite(suite_name or train_cfg.get("eval", {}).get("suite", "shapes"))
    # a seeded draw stratified by label, not the first N (class-sorted shards would give one class)
    spec = dict(
        dataset_spec(suite, train_cfg.get("data", {}).get("val") or None, user_data=data),
        limit=limit,
        seed=seed,
        stratify=label_field(suite),
    )
    samples = track(
        iter_dataset(spec), "report: embedding the sample", total=limit, unit="images", enabled=progress
    )
    emb = embed_dataset(loaded.model, loaded.preprocess, loaded.tokenizer, samples)
    return emb, suite


def eval_files(run: Path) -> list[Path]:
    """``eval_step*.json`` in step order, then ``eval.json`` (the end of the run)."""
    return sorted(run.glob("eval_step*.json")) + [p for p in [run / "eval.json"] if p.is_file()]


def cli_eval_files(run: Path) -> list[Path]:
    """What ``mmalign eval`` wrote beside the run's own: ``eval_cli_*.json`` in the run directory
    (a run, or one of its step checkpoints, evaluated) and in ``final/`` (``--model RUN/final``)."""
    return [
        p for folder in (run, run / "final") for p in sorted(folder.glob("eval_cli_*.json")) if p.is_file()
    ]


def run_time(run: Path) -> str | None:
    """First to last timestamped line of ``train.log`` (a resumed run counts its pause too).

    Without timestamps: from ``config.yaml`` (written at the start) to the newest of
    ``metrics.jsonl``, the eval files and ``final/`` (file times).
    """
    path = run / "train.log"
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    stamps = [m.group(1) for line in lines if (m := re.match(r"(\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2})", line))]
    if stamps:
        first, last = (datetime.strptime(t, "%Y-%m-%d %H:%M:%S") for t in (stamps[0], stamps[-1]))
        return f"{_hms((last - first).total_seconds())} ({stamps[0]} to {stamps[-1]}, train.log)"
    ends = [p.stat().st_mtime for p in [run / "metrics.jsonl", run / "final", *eval_files(run)] if p.exists()]
    if (run / "config.yaml").is_file() and ends:
        return f"{_hms(max(ends) - (run / 'config.yaml').stat().st_mtime)} (file times: config.yaml to the last output)"
    return None


def _hms(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m {seconds % 60:02d}s"


def shard_summary(spec: str | None) -> str:
    """``N shards, M samples`` of a shard spec (counts from each folder's ``sizes.json`` where present)."""
    from mmalign.data.shards import expand_urls

    if not spec:
        return "not set"
    urls = expand_urls(spec)
    present = [Path(u) for u in urls if Path(u).is_file()]
    counts, known = 0, 0
    sizes_cache: dict = {}
    for p in present:
        if p.parent not in sizes_cache:
            f = p.parent / "sizes.json"
            sizes_cache[p.parent] = json.loads(f.read_text()) if f.is_file() else {}
        if p.name in sizes_cache[p.parent]:
            counts += int(sizes_cache[p.parent][p.name])
            known += 1
    samples = f", {counts} samples (sizes.json)" if known == len(present) and present else ""
    return f"{len(present)} of {len(urls)} shards present{samples}"


def sample_summary(emb: dict, field: str) -> tuple[list[tuple], list[str]]:
    """Rows describing the embedded sample, and warnings about it (one class)."""
    n, owners = len(emb["keys"]), emb["text_to_image"]
    labels = Counter(str(m[field]) for m in emb["metas"] if m.get(field) is not None)
    rows: list[tuple] = [
        ("images", n),
        ("captions", len(owners)),
        ("captions per image", len(owners) / max(n, 1)),
    ]
    warnings = []
    if labels:
        mix = ", ".join(f"{k} {v}" for k, v in sorted(labels.items(), key=lambda kv: -kv[1])[:12])
        rows.append((f"classes ({field})", f"{len(labels)}: {mix}{' ...' if len(labels) > 12 else ''}"))
        if len(labels) == 1:
            warnings.append(
                f"the embedded sample holds one class ({field} = {next(iter(labels))}): the figures "
                "describe that class only. Shards written in class order (--no-shuffle) or a dataset "
                "without that class mix give this; check the data summary."
            )
    return rows, warnings


def headline_section(run: Path) -> str:
    """The page's first section: the headline results (:mod:`mmalign.evaluation.headline`) of the run's
    last evaluation file (``eval.json``, else the newest ``eval_step*.json``), and its path."""
    files = eval_files(run)
    if not files:
        return "<h2>Headline results</h2><p>no eval.json or eval_step*.json in the run</p>"
    path = files[-1]
    try:
        records = json.loads(path.read_text())
        found = headline.rows(records)
    except (json.JSONDecodeError, OSError, TypeError, AttributeError) as e:  # a damaged file is described
        return f"<h2>Headline results</h2><p>{html.escape(path.name)} unreadable: {html.escape(str(e))}</p>"
    where = f"<p>from <code>{html.escape(str(path))}</code></p>"
    if not found:
        return f"<h2>Headline results</h2>{where}<p>no zero-shot or retrieval task in this evaluation</p>"
    table = _table([("task", "metric", "value")] + [(t, m, headline.percent(v)) for t, m, v in found])
    return f"<h2>Headline results</h2>{where}{table}"


def write_report(
    run: str | Path,
    output: str | Path | None = None,
    *,
    suite: str | None = None,
    data: str | None = None,
    limit: int = 1000,
    seed: int = 0,
    progress: bool = False,
) -> Path:
    """Write ``index.html`` and the PNGs into ``output`` (default RUN/report); returns the HTML path.
    ``progress``: show the embedding pass (a bar on a terminal, else lines)."""
    run = Path(run)
    # the plots' libraries first: a missing [report] extra is one line before the embedding pass, not after
    _pyplot()
    _tsne()
    out = Path(output) if output else run / "report"
    out.mkdir(parents=True, exist_ok=True)
    body = [
        f"<h1>mmalign run report</h1><p>run <code>{html.escape(str(run))}</code>, "
        f"written {time.strftime('%Y-%m-%d %H:%M')}</p>",
        headline_section(run),
    ]

    rows = read_metrics(run / "metrics.jsonl")
    if plot_curves(rows, out / "curves.png"):
        body.append(
            f"<h2>Training curves</h2><p>{len(rows)} logged steps of metrics.jsonl</p><img src='curves.png'>"
        )
    else:
        body.append("<h2>Training curves</h2><p>no metrics.jsonl with known keys in the run</p>")

    config = _run_config(run)
    duration = run_time(run)
    body.append("<h2>Run</h2>" + _table([("run time", duration or "unknown (no timestamped train.log)")]))
    data_cfg = config.get("data", {}) if isinstance(config.get("data"), dict) else {}
    data_rows = [
        ("data.train", _fmt_spec(data_cfg.get("train"))),
        ("data.val", _fmt_spec(data_cfg.get("val"))),
    ]
    try:
        emb, suite_def = _embed_run(run, suite, data, limit, seed, progress)
    except (FileNotFoundError, OSError) as e:  # no final/ yet, or no evaluation data
        body.append("<h2>Data</h2>" + _table(data_rows))
        body.append(f"<h2>Embeddings</h2><p>skipped: {html.escape(str(e))}</p>")
    else:
        img, txt, owner = emb["image_features"], emb["text_features"], emb["text_to_image"]
        field = label_field(suite_def)
        rows_, warnings = sample_summary(emb, field)
        rows_.append(("distinct captions", len(set(emb["captions"]))))
        body.append("<h2>Data</h2>" + _table(data_rows + [(f"embedded sample: {k}", v) for k, v in rows_]))
        body += [f"<p class='warn'>warning: {html.escape(w)}</p>" for w in warnings]
        templates = captions_are_templates(suite_def)
        body.append(
            f"<h2>Embeddings</h2><p>suite <code>{html.escape(suite_def['name'])}</code>: "
            f"{len(img)} images (a seeded random draw of at most {limit}, stratified by "
            f"<code>{html.escape(field)}</code>), {len(txt)} captions; joint-space embeddings after the "
            "projection heads</p>"
        )
        if templates and len(txt):
            body.append(
                f"<p class='warn'>{html.escape(TEMPLATE_CAVEAT)} (so do the similarity histogram and "
                "the diagnostics below).</p>"
            )
        if len(txt):
            plot_similarity(
                similarity_samples(img, txt, owner, generator=torch.Generator().manual_seed(0)),
                out / "similarity.png",
            )
            t2i, i2t = retrieval_ranks(img, txt, owner, MAX_RECALL_K)
            plot_recall(t2i, i2t, len(img), len(txt), out / "recall.png")
            body.append("<img src='similarity.png'><img src='recall.png'>")
            diag = embedding_diagnostics(img, txt, owner)
            body.append("<h3>Diagnostics</h3>" + _table(sorted(diag.items())))
        task = next((t for t in suite_def["tasks"] if t["type"] == "zeroshot"), None)
        if task is not None and len(img) >= 5:
            labels = [str(m.get(task["label_field"])) for m in emb["metas"]]
            plot_tsne(
                img, labels, f"t-SNE of image embeddings, coloured by {task['label_field']}", out / "tsne.png"
            )
            body.append("<img src='tsne.png'>")

    files, cli_files = eval_files(run), cli_eval_files(run)
    if not files and not cli_files:
        body.append("<h2>Evaluation</h2><p>no eval.json, eval_step*.json or eval_cli_*.json in the run</p>")
    for path in files + cli_files:
        name = html.escape(str(path.relative_to(run))) + (" (mmalign eval)" if path in cli_files else "")
        try:
            records = json.loads(path.read_text())
            records = (
                [records] if isinstance(records, dict) else records
            )  # a clip_benchmark record: one object
            rows_ = [
                (r["dataset"], k, v)
                for r in records
                for k, v in r["metrics"].items()
                if isinstance(v, (int, float)) or v is None
            ]
        except (json.JSONDecodeError, OSError, TypeError, KeyError, AttributeError) as e:
            body.append(f"<h2>{name}</h2><p>unreadable: {html.escape(str(e))}</p>")
            continue
        body.append(f"<h2>{name}</h2>" + _table([("task", "metric", "value")] + rows_))
    if (run / "config.yaml").is_file():
        body.append(
            "<h2>Resolved config (config.yaml)</h2><pre>"
            f"{html.escape((run / 'config.yaml').read_text())}</pre>"
        )
    style = (
        "<style>body{font-family:sans-serif;max-width:1150px;margin:auto}img{max-width:100%;margin:6px 0}"
        "table{border-collapse:collapse}td{border:1px solid #ccc;padding:2px 8px;font-size:13px}"
        ".warn{background:#fff3cd;border:1px solid #e0b000;padding:6px 10px}"
        "pre{background:#f6f6f6;padding:8px;font-size:12px;overflow-x:auto}</style>"
    )
    page = out / "index.html"
    page.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>mmalign report</title>{style}</head>"
        f"<body>{''.join(body)}</body></html>"
    )
    return page
