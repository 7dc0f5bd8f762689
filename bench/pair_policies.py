"""Pair-construction policies at an equal budget: what each one does to the embedding.

Trains the tiny towers once per policy with the same data, steps, batch, lr and seed,
then scores every final model with the same suite:

* **shapes, subset captions** (``data_pipelines.shapes`` with ``caption_mode="subset"``):
  each training caption names a random subset of the attributes ("a red shape"), so one
  caption truly describes many images of a batch.  This is where false negatives bite:
  matching captions are worded differently, so they are not token-identical duplicates.
  Val keeps full captions.  Suite: ``eval/shapes.yaml`` (shape and colour zero-shot,
  Recall@k) plus embedding diagnostics.
* **CIFAR-10** (when ``../shared/data/cifar10`` is present): one random clip_benchmark
  template per image, the class id in ``.json``.  Suite: ``eval/cifar10.yaml`` zero-shot
  on the test split plus diagnostics (no Recall@k: a template caption matches a whole
  class, see the suite).

Policies (each is one ``--set`` list over the same base config):

    plain        in-batch InfoNCE (CLIP)
    ids          false-negative-aware ids: same caption (shapes) / same class (CIFAR) => positive
    mask         shapes only: metadata positives, image i fits caption j (B x B mask)
    hardneg      hard-negative weighting, beta (Robinson et al. 2021)
    debiased     debiased InfoNCE, class prior tau+ (Chuang et al. 2020)
    queue        MoCo queue of EMA-tower embeddings as extra negatives (He et al. 2020)
    views        a second augmented view and an image-image NT-Xent term (SLIP)
    jitter       colour jitter on (declares colour invariance; the shapes captions name colours)

Reported per run: zero-shot top-1, Recall@k (shapes), alignment, uniformity, effective
rank (both modalities, of the val embeddings after the projection heads), and the
hardest-negative share: the softmax probability that the hardest in-batch negative
takes, from the training monitor, averaged over the last quarter of the logged steps.

    python bench/pair_policies.py                       # both datasets, every policy, docs table
    python bench/pair_policies.py --steps 20 --no-doc   # smoke run
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import ROOT, LoadWatch, command, cpu_line, parser, write_section

DOC = ROOT / "docs" / "pair_policies.md"
SECTION = "## Evidence (bench/pair_policies.py)"
CIFAR_SRC = ROOT.parent / "shared" / "data" / "cifar10"

# Policy name -> overrides (on top of a dataset's base).  Values chosen for a short run:
# beta multiplies the logit s*cos (s ~ 15-30 here), so 0.25 already sharpens a lot.
POLICIES = {
    "plain": [],
    "ids": ["loss.false_negative_ids={ids}"],
    "mask": ["loss.positive_mask=attribute_subset", "data.id_field=subset_code"],
    "hardneg": ["loss.hard_negative_beta=0.25"],
    "debiased": ["loss.debias_prior=0.1"],
    "queue": ["loss.queue_size=1024", "loss.momentum=0.99"],
    "views": ["data.views=2", "loss.image_image_weight=0.5"],
    "jitter": ["data.augment.color_jitter=[0.4,0.4,0.4,0.1]"],
}


def base_shapes(work: Path, steps: int) -> tuple[str, list[str], str, dict]:
    from data_pipelines import shapes

    data = work / "shapes_subset"
    if not shapes.is_complete(str(data)):
        print(f"generating subset-caption shapes into {data}", flush=True)
        shapes.generate(data, caption_mode="subset")
    suite = work / "suite_shapes.yaml"
    suite.write_text(
        "name: shapes_policies\nextends: shapes\ntasks:\n  - name: geometry\n    type: diagnostics\n"
    )
    # the quickstart's towers, augmentation, batch and lr; only the data and the budget change
    over = [
        f"data.train={data}/train/{{00000..00007}}.tar",
        f"data.val={data}/val/00000.tar",
        f"train.warmup_steps={max(1, steps // 15)}",
    ]
    return "configs/quickstart.yaml", over, str(suite), {"ids": "caption"}


def base_cifar(work: Path, steps: int) -> tuple[str, list[str], str, dict] | None:
    if not (CIFAR_SRC / "train.tar").is_file():
        print(f"CIFAR-10 not found at {CIFAR_SRC}: skipping that dataset", flush=True)
        return None
    from bench.quality_cifar10 import build_split

    train = build_split(CIFAR_SRC / "train.tar", work / "cifar10" / "train", 50000, 0, 1000)
    test = build_split(CIFAR_SRC / "test.tar", work / "cifar10" / "test", 10000, 1, 1000)
    suite = work / "suite_cifar10.yaml"
    suite.write_text(
        "name: cifar10_policies\nextends: cifar10\ntasks:\n  - name: geometry\n    type: diagnostics\n"
    )
    # configs/cifar10_cpu.yaml's towers, augmentation, batch and lr on shards shuffled across classes
    over = [
        f"data.train={train}",
        f"data.val={test}",
        "data.shuffle_buffer=5000",
        f"train.warmup_steps={max(1, steps // 10)}",
    ]
    return "configs/cifar10_cpu.yaml", over, str(suite), {"ids": "label"}


def supported(policy: str) -> bool:
    """Policies whose config keys this checkout has (the bench runs on older trees too)."""
    from mmalign.config import LossConfig

    keys = {"queue": "queue_size", "views": "image_image_weight"}
    return policy not in keys or hasattr(LossConfig(), keys[policy])


def train_one(config: str, out: Path, overrides: list[str], suite: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "mmalign.cli",
        "train",
        "--config",
        config,
        "--output",
        str(out),
        "--overwrite",
    ]
    for o in overrides + [f"eval.suite={suite}", "monitor.probe_size=0", "monitor.tensorboard=false"]:
        cmd += ["--set", o]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    start = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
    wall = time.time() - start
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": tail[0][:200], "wall_s": wall}
    return {"wall_s": wall, **read_run(out)}


def read_run(out: Path) -> dict:
    res: dict = {}
    for rec in json.loads((out / "eval.json").read_text()):
        task, m = rec["dataset"].split("/")[-1], rec["metrics"]
        if rec["task"] == "zeroshot_classification":
            res[f"zs_{task}"] = m["acc1"]
        elif rec["task"] == "zeroshot_retrieval":
            res["t2i_r1"], res["t2i_r5"] = m["image_retrieval_recall@1"], m["image_retrieval_recall@5"]
            res["i2t_r1"], res["i2t_r5"] = m["text_retrieval_recall@1"], m["text_retrieval_recall@5"]
        elif rec["task"] == "embedding_diagnostics":
            for k in (
                "alignment",
                "uniformity_image",
                "uniformity_text",
                "effective_rank_image",
                "effective_rank_text",
                "modality_gap",
            ):
                res[k] = m[k]
    logs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    tail = [r for r in logs[-max(1, len(logs) // 4) :] if "hardest_neg_prob" in r]
    if tail:
        res["hardest_neg"] = sum(r["hardest_neg_prob"] for r in tail) / len(tail)
        res["logit_scale"] = tail[-1].get("logit_scale")
    return res


def fmt(v, pct=False) -> str:
    if v is None:
        return "–"
    return f"{100 * v:.1f}" if pct else f"{v:.2f}"


def table(name: str, rows: dict[str, dict]) -> str:
    shapes = name == "shapes"
    head = ["policy", "zero-shot shape (%)" if shapes else "zero-shot top-1 (%)"]
    if shapes:
        head += ["zero-shot colour (%)", "t→i R@1 / R@5 (%)", "i→t R@1 / R@5 (%)"]
    head += [
        "alignment ↓",
        "uniformity img / txt ↓",
        "eff. rank img / txt",
        "modality gap",
        "hardest-neg share",
        "final scale",
        "wall (s)",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for pol, r in rows.items():
        if "error" in r:
            lines.append(f"| {pol} | failed: {r['error']} |" + " |" * (len(head) - 2))
            continue
        cells = [pol, fmt(r.get("zs_shape" if shapes else "zs_zeroshot"), True)]
        if shapes:
            cells += [
                fmt(r.get("zs_colour"), True),
                f"{fmt(r.get('t2i_r1'), True)} / {fmt(r.get('t2i_r5'), True)}",
                f"{fmt(r.get('i2t_r1'), True)} / {fmt(r.get('i2t_r5'), True)}",
            ]
        cells += [
            fmt(r.get("alignment")),
            f"{fmt(r.get('uniformity_image'))} / {fmt(r.get('uniformity_text'))}",
            f"{r.get('effective_rank_image', 0):.1f} / {r.get('effective_rank_text', 0):.1f}",
            fmt(r.get("modality_gap")),
            fmt(r.get("hardest_neg")),
            fmt(r.get("logit_scale")),
            f"{r['wall_s']:.0f}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_doc(text: str, watch: LoadWatch, allow_loaded: bool) -> None:
    write_section(DOC, text, watch, allow_loaded, title="# Pair-construction policies")


def main() -> None:
    p = parser(__doc__, write_doc=None)
    p.add_argument(
        "--steps", type=int, default=150, help="shapes: training steps per run (same for every policy)"
    )
    p.add_argument("--cifar-steps", type=int, default=100, help="CIFAR-10: training steps per run")
    p.add_argument("--datasets", default="shapes,cifar10")
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default=str(ROOT / "data" / "bench_pair_policies"))
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/pair_policies.md alone")
    args = p.parse_args()
    watch = LoadWatch()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    sections = []
    all_rows = {}
    for name in args.datasets.split(","):
        steps = args.steps if name == "shapes" else args.cifar_steps
        base = base_shapes(work, steps) if name == "shapes" else base_cifar(work, steps)
        if base is None:
            sections.append(f"**{name}**: not run (data absent).")
            continue
        config, over, suite, fill = base
        rows = {}
        for pol in args.policies.split(","):
            if pol == "mask" and name != "shapes":
                continue
            if not supported(pol):
                rows[pol] = {"error": "not in this checkout", "wall_s": 0}
                continue
            extra = [o.format(**fill) for o in POLICIES[pol]]
            out = work / "runs" / f"{name}_{pol}"
            print(f"[{name}] {pol}: {' '.join(extra) or '(base)'}", flush=True)
            rows[pol] = train_one(
                config, out, over + [f"seed={args.seed}", f"train.steps={steps}"] + extra, suite
            )
            print(f"  {json.dumps(rows[pol])}", flush=True)
        all_rows[name] = rows
        sections.append(f"**{name}** ({steps} steps)\n\n" + table(name, rows))
    (work / "results.json").write_text(json.dumps(all_rows, indent=1))
    body = "\n\n".join(sections)
    print(body)
    if not args.no_doc:
        cmd = command()
        write_doc(
            f"{SECTION}\n\nCommand: `{cmd}` · {datetime.date.today()} · {cpu_line()} · "
            f"shapes: configs/quickstart.yaml's towers and settings; "
            f"CIFAR-10: configs/cifar10_cpu.yaml's; fp32, one process, seed {args.seed}, one run per policy.\n\n{body}\n",
            watch,
            args.allow_loaded,
        )


if __name__ == "__main__":
    main()
