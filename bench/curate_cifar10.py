"""Curation proven on a noisy pool: ``mmalign curate`` on CIFAR-10 with known noise.

The pool (from CIFAR-10 train; nothing of the test split is used before the final scoring):

- a clean, disjoint ``--filter-samples`` subset (10%) trains the filter model;
- the other images are the pool's originals, each captioned with one random clip_benchmark
  CIFAR template over its class name;
- ``--dup-fraction`` (20%) extra samples are near-duplicates of random originals: a horizontal
  flip, a small crop (28-30 px resized back to 32) or a JPEG re-encode (quality 60-85), one of
  the three at random, with a fresh caption of the same class;
- then ``--noise`` (30%) of all pool captions are re-labelled to a random wrong class.

The truth (which caption is wrong, which sample copies which) stays in the bench's own
``truth.parquet``; the shards carry only what a real pool would.

Arms, each trained from scratch with the tiny towers at equal steps, batch and lr, ``--seeds``
seeds each, scored by zero-shot top-1 on the 10000 CIFAR-10 test images (eval/cifar10.yaml):

- (a) the raw pool;
- (b) ``mmalign curate --keep-fraction F --dedupe semantic --dedupe-eps E --keys-only``
  (DataComp's CLIP-score top fraction, 0.3 by default, then SemDeDup), trained through
  ``data.keep_keys``;
- (c) a random subset of the raw pool of (b)'s size (seeded), also through ``data.keep_keys``;
- (d) the raw pool with ``--false-negative-groups dup_group`` (nothing dropped; duplicate
  groups are positives of each other: ``loss.false_negative_ids: dup_group``);
- (b2), (d2): (b) and (d) with ``--dedupe perceptual,semantic`` (the perceptual hash,
  :mod:`mmalign.data.phash`, and SemDeDup together: a sample joins a kept sample within either
  threshold).

Also reported: how well curation finds the injected noise, against the truth: precision and
recall of the score filter's drops for mismatched captions; for each detector (SemDeDup,
perceptual, both) the fraction of injected duplicates grouped with their original (per kind of
edit), and the false-group rate (groups of more than one member that join samples of different
origin; of those, the groups joining different classes), at the chosen thresholds and, for
reading only, at a few others.

    python bench/curate_cifar10.py --quick          # development: minutes
    python bench/curate_cifar10.py --write-doc      # the full size: ~1.5 h on 2 idle cores
    python bench/curate_cifar10.py --arms b2,d2 --previous data/bench_curate_cifar10/results.json
                                                    # only the new arms, the others' runs reused

"""

from __future__ import annotations

import datetime
import io
import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)
import numpy as np

from bench.cifar10_runs import run_mmalign
from bench.cifar10_shards import cifar_items, shard_spec
from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, write_section

SECTION = "## Curation on a noisy CIFAR-10 pool (bench/curate_cifar10.py)"
ARMS = ("a", "b", "c", "d", "b2", "d2")
ARM_NAMES = {
    "a": "(a) raw pool",
    "b": "(b) curate: score top fraction + SemDeDup",
    "c": "(c) random subset, (b)'s size",
    "d": "(d) raw pool, duplicate groups as positives",
    "b2": "(b2) curate: score top fraction + perceptual + SemDeDup",
    "d2": "(d2) raw pool, perceptual + SemDeDup groups as positives",
}
FIELD = "dup_group"
# The filter model's recipe on top of the arms' (bench/cifar10_runs.run_mmalign). With CLIP's loss
# alone the tiny model's image embeddings of one class crowd together as closely as a flipped copy
# of one image sits to it, so near-duplicates cannot be told from class-mates; an image-image
# NT-Xent term (SimCLR, Chen et al. 2020, as SLIP adds it to CLIP, Mu et al. 2022) between two
# flipped and cropped views makes the embedding invariant to those edits and keeps other images apart.
FILTER_RECIPES = {
    "slip": (
        "data.views=2",
        "loss.image_image_weight=1.0",
        "data.augment.hflip=true",
        "data.augment.crop_scale=[0.5,1.0]",
    ),
    "clip": (),
}
EPS_SWEEP = [0.002, 0.005, 0.01, 0.02, 0.05]
DISTANCE_SWEEP = [0, 2, 4, 6, 8]  # perceptual bits (pHash distances of 64 bits are even)


# ------------------------------------------------------------------ the pool


def _near_copy(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    from PIL import Image, ImageOps

    image = Image.open(io.BytesIO(data)).convert("RGB")
    kind = rng.choice(["flip", "crop", "jpeg"])
    quality = 92
    if kind == "flip":
        image = ImageOps.mirror(image)
    elif kind == "crop":
        w, h = image.size
        side = rng.randint(round(0.875 * min(w, h)), round(0.94 * min(w, h)))  # 28-30 of 32 px
        left, top = rng.randint(0, w - side), rng.randint(0, h - side)
        image = image.crop((left, top, left + side, top + side)).resize((w, h), Image.BICUBIC)
    else:
        quality = rng.randint(60, 85)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=quality)
    return buf.getvalue(), kind


def build_pool(
    src: Path, work: Path, *, n_filter: int, n_pool: int | None, noise: float, dup_fraction: float, seed: int
) -> tuple[str, str, Path]:
    """Filter shards, pool shards and truth.parquet under ``work`` (cached by their settings)."""
    import pandas as pd

    from data_pipelines.build import build_shards
    from data_pipelines.sources import Captioner, Item, load_templates

    want = {
        "src": str(src),
        "n_filter": n_filter,
        "n_pool": n_pool,
        "noise": noise,
        "dup": dup_fraction,
        "seed": seed,
        "version": 1,
    }
    stamp = work / "pool_stamp.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return shard_spec(work / "filter"), shard_spec(work / "pool"), work / "truth.parquet"
    for sub in ("filter", "pool"):
        shutil.rmtree(work / sub, ignore_errors=True)
    tset = load_templates("cifar10")
    classes = tset["classnames"]
    captioner = Captioner(tset["templates"], per_image=1, seed=seed + 1)
    rng = random.Random(seed)
    items = list(cifar_items(src, seed))
    rng.shuffle(items)
    filt, base = items[:n_filter], items[n_filter:]
    if n_pool is not None:
        base = base[:n_pool]
    samples = []  # (image bytes, true label, origin id, kind)
    for i, item in enumerate(base):
        samples.append((item.image, item.meta["label"], i, "original"))
    for _j, o in enumerate(rng.sample(range(len(base)), round(dup_fraction * len(base)))):
        data, kind = _near_copy(base[o].image, rng)
        samples.append((data, base[o].meta["label"], o, kind))
    wrong = set(rng.sample(range(len(samples)), round(noise * len(samples))))
    order = list(range(len(samples)))
    rng.shuffle(order)
    pool_items, truth = [], []
    for bench_id in order:
        data, label, origin, kind = samples[bench_id]
        caption_label = label
        if bench_id in wrong:
            caption_label = rng.choice([c for c in range(len(classes)) if c != label])
        pool_items.append(
            Item(data, captioner(classes[caption_label]), {"bench_id": bench_id, "label": label})
        )
        truth.append(
            {
                "bench_id": bench_id,
                "label": label,
                "caption_label": caption_label,
                "mismatched": bench_id in wrong,
                "origin": origin,
                "kind": kind,
            }
        )
    build_shards(
        filt, work / "filter", per_shard=1000, dedupe=False, progress=False, source="cifar10 clean subset"
    )
    build_shards(
        pool_items, work / "pool", per_shard=1000, dedupe=False, progress=False, source="cifar10 noisy pool"
    )
    keys = pd.concat([pd.read_parquet(p) for p in sorted((work / "pool").glob("*.parquet"))])[
        ["key", "bench_id"]
    ]
    frame = pd.DataFrame(truth).merge(keys, on="bench_id", validate="one_to_one")
    frame.to_parquet(work / "truth.parquet", index=False)
    stamp.write_text(json.dumps(want))
    print(
        f"  pool: {len(base)} originals + {len(samples) - len(base)} near-duplicates = {len(samples)} samples, "
        f"{len(wrong)} captions re-labelled; filter set {len(filt)} clean samples",
        flush=True,
    )
    return shard_spec(work / "filter"), shard_spec(work / "pool"), work / "truth.parquet"


def build_test(src: Path, work: Path, n: int) -> str:
    from bench.cifar10_shards import cached_shards

    def items():
        out = list(cifar_items(src, 1))
        random.Random(1).shuffle(out)
        return out[:n]

    return cached_shards(
        src, work / f"test{n}", {"src": str(src), "n": n, "seed": 1, "per_shard": 1000}, items
    )


# ------------------------------------------------------------------ curation


def curate(work: Path, name: str, pool: str, model: Path, *flags: str, reuse: Path | None = None) -> Path:
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    if reuse is not None:  # the embeddings of an earlier curate of the same pool and model
        shutil.copytree(reuse / "pool", out / "pool")
    cmd = [
        sys.executable,
        "-m",
        "mmalign.cli",
        "curate",
        "--data",
        pool,
        "--model",
        str(model),
        "--out",
        str(out),
        "--no-progress",
        "--force",
        *flags,
    ]  # --force: the bench measures what a policy does, however much
    with (work / f"{name}.log").open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"curate {name} failed (exit {proc.returncode}); see {work / f'{name}.log'}")
    return out


def detection(truth_file: Path, decisions_file: Path, column: str = "semantic_group") -> dict:
    """Curation's finds against the truth: mismatched captions dropped by score, duplicates grouped
    (by the groups in ``column``)."""
    import pandas as pd

    truth = pd.read_parquet(truth_file)
    dec = pd.read_parquet(decisions_file).merge(truth, on="key", validate="one_to_one")
    out = {}
    if "kept_by_clip_score" in dec:
        dropped = ~dec["kept_by_clip_score"].to_numpy()
        bad = dec["mismatched"].to_numpy()
        out["score_drop_precision"] = float((dropped & bad).sum() / max(1, dropped.sum()))
        out["score_drop_recall"] = float((dropped & bad).sum() / max(1, bad.sum()))
        out["score_dropped"] = int(dropped.sum())
        out["mismatched"] = int(bad.sum())
    if column in dec:
        out.update(
            group_quality(
                dec[column].to_numpy(),
                dec["origin"].to_numpy(),
                dec["kind"].to_numpy() != "original",
                dec["kind"].to_numpy(),
                dec["label"].to_numpy(),
            )
        )
    return out


def group_quality(
    groups: np.ndarray, origin: np.ndarray, injected: np.ndarray, kinds=None, labels=None
) -> dict:
    """Injected duplicates grouped with their original (also per kind of edit); groups that join
    different origins ("false" against the injected truth, which does not know CIFAR-10's own
    near-duplicates), and of those the groups that join different classes."""
    # the group of each origin's original sample
    original_group = {}
    for g, o, inj in zip(groups.tolist(), origin.tolist(), injected.tolist()):
        if not inj:
            original_group[o] = g
    grouped = [
        original_group.get(o) == g
        for g, o, inj in zip(groups.tolist(), origin.tolist(), injected.tolist())
        if inj
    ]
    members: dict[int, set] = {}
    classes: dict[int, set] = {}
    sizes: dict[int, int] = {}
    label_list = labels.tolist() if labels is not None else [0] * len(groups)
    for g, o, c in zip(groups.tolist(), origin.tolist(), label_list):
        members.setdefault(g, set()).add(o)
        classes.setdefault(g, set()).add(c)
        sizes[g] = sizes.get(g, 0) + 1
    multi = [g for g, n in sizes.items() if n > 1]
    false = [g for g in multi if len(members[g]) > 1]
    cross = [g for g in false if len(classes[g]) > 1]
    per_kind = {}
    if kinds is not None:
        edits = [k for k, inj in zip(kinds.tolist(), injected.tolist()) if inj]
        for kind in sorted(set(edits)):
            hits = [ok for ok, k in zip(grouped, edits) if k == kind]
            per_kind[kind] = float(np.mean(hits))
    return {
        "duplicates_injected": len(grouped),
        "duplicates_grouped": float(np.mean(grouped)) if grouped else 0.0,
        "grouped_by_edit": per_kind,
        "groups_of_more_than_one": len(multi),
        "false_groups": len(false),
        "false_group_rate": len(false) / len(multi) if multi else 0.0,
        "cross_class_groups": len(cross) if labels is not None else None,
        "cross_class_rate": (len(cross) / len(multi) if multi else 0.0) if labels is not None else None,
    }


def sweep(truth_file: Path, curated: Path, name: str, values: list) -> list[dict]:
    """Group quality of one detector (``name``: "semantic", eps values; "perceptual", distances)
    at other thresholds, from the pool stored in ``curated`` (for reading; the arms use one)."""
    import pandas as pd

    from data_pipelines.curate.decide import Policies, decide, load_pool

    n = len(json.loads((curated / "pool" / "stamp.json").read_text())["urls"])
    pool = load_pool(curated, n)
    truth = pd.read_parquet(truth_file).set_index("key").loc[pool.frame["key"]]
    field = "dedupe_eps" if name == "semantic" else "perceptual_distance"
    rows = []
    for value in values:
        dec = decide(pool, Policies(dedupe=(name,), **{field: value}))
        q = group_quality(
            dec.groups[name],
            truth["origin"].to_numpy(),
            truth["kind"].to_numpy() != "original",
            truth["kind"].to_numpy(),
            truth["label"].to_numpy(),
        )
        rows.append({"value": value, **q, "kept_by_dedupe": int(dec.by_policy["dedupe"].sum())})
    return rows


# ------------------------------------------------------------------ report


def mean_std(values) -> tuple[float, float]:
    values = [float(v) for v in values]
    m = sum(values) / len(values)
    return m, (math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1)) if len(values) > 1 else 0.0)


def _grouping_row(name: str, d: dict) -> str:
    edits = ", ".join(f"{k} {100 * v:.1f}%" for k, v in d.get("grouped_by_edit", {}).items())
    multi = d.get("groups_of_more_than_one", 0)
    return (
        f"| {name} | {100 * d.get('duplicates_grouped', 0):.1f}% of {d.get('duplicates_injected')} | {edits} | "
        f"{d.get('false_groups')} of {multi} ({100 * d.get('false_group_rate', 0):.2f}%) | "
        f"{d.get('cross_class_groups')} ({100 * (d.get('cross_class_rate') or 0):.2f}%) |"
    )


def tables(
    runs: list[dict],
    dets: dict[str, dict],
    eps_rows: list[dict],
    dsweep: list[dict],
    sizes: dict,
    eps: float,
    distance: int,
) -> str:
    """The arms' accuracies, what each detector found against the truth, and the sweeps.
    ``dets``: detector name -> :func:`detection` (the first also holds the score filter's)."""
    lines = [
        "| arm | samples trained on | seeds | zero-shot top-1 (%) per seed | mean +- std |",
        "|---|---|---|---|---|",
    ]
    stats = {}
    for arm in ARMS:
        acc = [100 * r["acc1"] for r in runs if r["arm"] == arm]
        if not acc:
            continue
        stats[arm] = mean_std(acc)
        lines.append(
            f"| {ARM_NAMES[arm]} | {sizes[arm]} | {len(acc)} | {', '.join(f'{a:.2f}' for a in acc)} | "
            f"{stats[arm][0]:.2f} +- {stats[arm][1]:.2f} |"
        )
    lines.append("")
    for arm, other in (
        ("b", "a"),
        ("b", "c"),
        ("d", "a"),
        ("b2", "b"),
        ("b2", "a"),
        ("d2", "a"),
        ("d2", "d"),
    ):
        if arm in stats and other in stats:
            diff = stats[arm][0] - stats[other][0]
            spread = stats[arm][1] + stats[other][1]
            verdict = "beyond the spread" if abs(diff) > spread else "within the spread"
            lines.append(f"- ({arm}) - ({other}): {diff:+.2f} points (sum of stds {spread:.2f}: {verdict})")
    det = next(iter(dets.values()))
    lines += [
        "",
        "**What curation found, against the injected truth**",
        "",
        "| measure | value |",
        "|---|---|",
        f"| score filter: dropped | {det.get('score_dropped')} of {sizes['a']} |",
        f"| score filter: precision of the drops (mismatched among dropped) | "
        f"{100 * det.get('score_drop_precision', 0):.1f}% |",
        f"| score filter: recall (mismatched captions dropped, of {det.get('mismatched')}) | "
        f"{100 * det.get('score_drop_recall', 0):.1f}% |",
        "",
        f"Duplicate detectors (SemDeDup eps {eps:g}, perceptual distance {distance} bits of 64). Goal: >= 90% "
        f"of the injected near-duplicates grouped with their original, <= 2% false groups. A group is "
        f"*false* when it joins samples of different origin; the injected truth does not know CIFAR-10's own "
        f"near-duplicates (one photo twice in the train split), so it counts those too; the last column "
        f"counts the false groups that join different classes, which no copy of one photo does:",
        "",
        "| detector | injected duplicates grouped | by edit | false groups (different origin) | "
        "of them joining different classes |",
        "|---|---|---|---|---|",
        *[_grouping_row(name, d) for name, d in dets.items()],
    ]
    if dsweep:
        lines += [
            "",
            "Perceptual alone at other distances, from the same stored hashes (for reading):",
            "",
            "| distance (bits) | injected duplicates grouped | by edit | false groups (different origin) | "
            "of them joining different classes |",
            "|---|---|---|---|---|",
            *[_grouping_row(str(r["value"]), r) for r in dsweep],
        ]
    if eps_rows:
        lines += [
            "",
            "SemDeDup alone at other eps, from the same stored embeddings (for reading):",
            "",
            "| eps | injected duplicates grouped | by edit | false groups (different origin) | "
            "of them joining different classes |",
            "|---|---|---|---|---|",
            *[_grouping_row(f"{r['value']:g}", r) for r in eps_rows],
        ]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, write_doc="")
    p.add_argument(
        "--quick",
        action="store_true",
        help="development size: 500 filter / 3000 pool / 1000 test images, 20 steps, 1 seed",
    )
    p.add_argument(
        "--data",
        default=str(ROOT.parent / "shared" / "data" / "cifar10"),
        help="folder with CIFAR-10 train.tar and test.tar (class folders)",
    )
    p.add_argument("--work", default=str(ROOT / "data" / "bench_curate_cifar10"))
    p.add_argument("--seeds", type=int, default=None, help="training seeds per arm (default 3, quick 1)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument(
        "--filter-samples", type=int, default=None, help="clean filter-model images (default 5000)"
    )
    p.add_argument("--noise", type=float, default=0.3)
    p.add_argument("--dup-fraction", type=float, default=0.2)
    p.add_argument("--keep-fraction", type=float, default=0.3, help="(b)'s score filter (DataComp's 0.3)")
    p.add_argument("--dedupe-eps", type=float, default=0.05, help="(b)/(d)'s SemDeDup eps")
    p.add_argument(
        "--perceptual-distance",
        type=int,
        default=None,
        help="(b2)/(d2)'s perceptual distance in bits (default: mmalign.data.phash.DEFAULT_DISTANCE)",
    )
    p.add_argument(
        "--previous",
        default=None,
        help="an earlier results.json: the runs of arms not in --arms are taken from it (same settings)",
    )
    p.add_argument("--steps", type=int, default=None, help="training steps per arm (default 200, quick 20)")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument(
        "--filter-steps", type=int, default=None, help="filter model steps (default 300, quick 20)"
    )
    p.add_argument(
        "--filter-recipe",
        choices=("slip", "clip"),
        default="slip",
        help="slip (default): CLIP's loss + an image-image NT-Xent term between two flipped and cropped "
        "views (data.views 2, loss.image_image_weight 1), so that image embeddings tell instances "
        "apart; clip: CLIP's loss alone, crop 0.9-1, no flip (the arms' recipe)",
    )
    p.add_argument("--lr", type=float, default=1e-3)
    args = p.parse_args()
    watch = LoadWatch()
    q = args.quick
    seeds = args.seeds or (1 if q else 3)
    steps = args.steps or (20 if q else 200)
    filter_steps = args.filter_steps or (20 if q else 300)
    n_filter = args.filter_samples or (500 if q else 5000)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    from mmalign.data import phash

    distance = phash.DEFAULT_DISTANCE if args.perceptual_distance is None else args.perceptual_distance
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)

    print("building the noisy pool", flush=True)
    filt, pool, truth = build_pool(
        data / "train.tar",
        work,
        n_filter=n_filter,
        n_pool=3000 if q else None,
        noise=args.noise,
        dup_fraction=args.dup_fraction,
        seed=0,
    )
    test = build_test(data / "test.tar", work, 1000 if q else 10000)
    import pandas as pd

    pool_keys = pd.read_parquet(truth)["key"].tolist()

    print(f"filter model: {filter_steps} steps x {args.batch} on the clean subset", flush=True)
    recipe = FILTER_RECIPES[args.filter_recipe]
    run_dir = work / "mmalign_runs" / f"filter_{args.filter_recipe}"
    model = run_dir / "final"
    want = {"recipe": list(recipe), "steps": filter_steps, "batch": args.batch, "lr": args.lr, "filter": filt}
    stamp = run_dir / "bench_stamp.json"
    if (
        stamp.is_file()
        and json.loads(stamp.read_text())["want"] == want
        and (model / "model.safetensors").is_file()
    ):
        fm = json.loads(stamp.read_text())["result"]  # the same filter model, trained before
        print("  (reusing the filter model trained before with these settings)", flush=True)
    else:
        fm = run_mmalign(
            work,
            f"filter_{args.filter_recipe}",
            train=filt,
            test=test,
            steps=filter_steps,
            batch=args.batch,
            lr=args.lr,
            warmup=max(1, filter_steps // 10),
            precision="fp32",
            log_every=10,
            seed=0,
            extra_sets=recipe,
        )
        stamp.write_text(json.dumps({"want": want, "result": fm}))
    print(f"  filter model zero-shot top-1 {100 * fm['acc1']:.2f}%", flush=True)

    print("curate (b): score top fraction + SemDeDup, keys only", flush=True)
    cur_b = curate(
        work,
        "curate_b",
        pool,
        model,
        "--keep-fraction",
        str(args.keep_fraction),
        "--dedupe",
        "semantic",
        "--dedupe-eps",
        str(args.dedupe_eps),
        "--keys-only",
    )
    print("curate (d): duplicate groups as a .json field, nothing dropped", flush=True)
    cur_d = curate(
        work,
        "curate_d",
        pool,
        model,
        "--false-negative-groups",
        FIELD,
        "--dedupe",
        "semantic",
        "--dedupe-eps",
        str(args.dedupe_eps),
        reuse=cur_b,
    )
    both = ("--dedupe", "perceptual,semantic", "--dedupe-eps", str(args.dedupe_eps))
    both += ("--perceptual-distance", str(distance))
    print("curate (b2): score top fraction + perceptual + SemDeDup, keys only", flush=True)
    cur_b2 = curate(
        work,
        "curate_b2",
        pool,
        model,
        "--keep-fraction",
        str(args.keep_fraction),
        *both,
        "--keys-only",
        reuse=cur_b,
    )
    print("curate (d2): perceptual + SemDeDup groups as a .json field, nothing dropped", flush=True)
    cur_d2 = curate(work, "curate_d2", pool, model, "--false-negative-groups", FIELD, *both, reuse=cur_b)
    print("curate: perceptual alone (detection only)", flush=True)
    cur_p = curate(
        work,
        "curate_p",
        pool,
        model,
        "--dedupe",
        "perceptual",
        "--perceptual-distance",
        str(distance),
        "--keys-only",
        reuse=cur_b,
    )
    report_b = json.loads((cur_b / "curate_report.json").read_text())
    kept_b = report_b["kept"]["kept"]
    kept_b2 = json.loads((cur_b2 / "curate_report.json").read_text())["kept"]["kept"]
    random_keys = work / "random_keys.txt"
    random_keys.write_text("".join(f"{k}\n" for k in random.Random(7).sample(pool_keys, kept_b)))
    dets = {
        f"SemDeDup, eps {args.dedupe_eps:g}": detection(truth, cur_b / "decisions.parquet"),
        f"perceptual, {distance} bits": detection(truth, cur_p / "decisions.parquet", "perceptual_group"),
        f"perceptual {distance} bits + SemDeDup eps {args.dedupe_eps:g}": detection(
            truth, cur_b2 / "decisions.parquet", "combined_group"
        ),
    }
    eps_rows = sweep(truth, cur_b, "semantic", EPS_SWEEP)
    dsweep = sweep(truth, cur_p, "perceptual", DISTANCE_SWEEP)
    print(json.dumps(dets, indent=1), flush=True)

    sizes = {
        "a": len(pool_keys),
        "b": kept_b,
        "c": kept_b,
        "d": len(pool_keys),
        "b2": kept_b2,
        "d2": len(pool_keys),
    }
    per_arm = {
        "a": (pool, ()),
        "b": (pool, (f"data.keep_keys={cur_b / 'keep_keys.txt'}",)),
        "c": (pool, (f"data.keep_keys={random_keys}",)),
        "d": (shard_spec(cur_d), (f"loss.false_negative_ids={FIELD}",)),
        "b2": (pool, (f"data.keep_keys={cur_b2 / 'keep_keys.txt'}",)),
        "d2": (shard_spec(cur_d2), (f"loss.false_negative_ids={FIELD}",)),
    }
    runs = []
    if args.previous:  # the arms not run now, from an earlier run of the same settings
        runs = [r for r in json.loads(Path(args.previous).read_text())["runs"] if r["arm"] not in arms]
        print(
            f"  {len(runs)} runs of arms {sorted({r['arm'] for r in runs})} from {args.previous}", flush=True
        )
    for seed in range(seeds):
        for arm in arms:
            train, sets = per_arm[arm]
            r = run_mmalign(
                work,
                f"arm_{arm}_seed{seed}",
                train=train,
                test=test,
                steps=steps,
                batch=args.batch,
                lr=args.lr,
                warmup=max(1, steps // 10),
                precision="fp32",
                log_every=10,
                seed=seed,
                extra_sets=sets,
            )
            r["arm"] = arm
            runs.append(r)
            print(
                f"  arm {arm} seed {seed}: zero-shot top-1 {100 * r['acc1']:.2f}% ({r['process_s']:.0f} s)",
                flush=True,
            )
            (work / "results_partial.json").write_text(json.dumps(runs, indent=1))
    runs.sort(key=lambda r: (ARMS.index(r["arm"]), r.get("seed", 0)))

    cmd = command()
    import torch

    env = f"{datetime.date.today().isoformat()} · {cpu_line(torch.get_num_threads())} · torch {torch.__version__}"
    n_test = 1000 if q else 10000
    setup = (
        f"Pool: CIFAR-10 train minus a clean {n_filter}-image filter subset; {sizes['a']} samples = originals + "
        f"{100 * args.dup_fraction:g}% near-duplicates (flip, 28-30 px crop, JPEG re-encode), then "
        f"{100 * args.noise:g}% of captions re-labelled to a wrong class. Filter model: the tiny towers, "
        f"{filter_steps} steps x {args.batch} on the clean subset, recipe {args.filter_recipe} "
        f"({', '.join(recipe) or 'the arms own'}; zero-shot top-1 {100 * fm['acc1']:.2f}%). "
        f"Arms: the tiny towers from scratch, {steps} steps x {args.batch}, AdamW lr {args.lr:g}, fp32 "
        f"(configs/cifar10_cpu.yaml's recipe), seeds 0..{seeds - 1}; zero-shot top-1 on {n_test} CIFAR-10 "
        f"test images (eval/cifar10.yaml). (b): --keep-fraction {args.keep_fraction:g} --dedupe semantic "
        f"--dedupe-eps {args.dedupe_eps:g} --keys-only, trained through data.keep_keys; (b2) the same with "
        f"--dedupe perceptual,semantic --perceptual-distance {distance} (a sample joins a kept one within "
        f"either threshold); (d2): the raw pool with those groups as loss.false_negative_ids."
        + (f" Runs of arms other than {','.join(arms)}: from {args.previous}." if args.previous else "")
    )
    text = "\n".join(
        [
            SECTION,
            "",
            f"Command: `{cmd}` · {env}",
            "",
            setup,
            "",
            tables(runs, dets, eps_rows, dsweep, sizes, args.dedupe_eps, distance),
        ]
    )
    print("\n" + text)
    (work / "results.json").write_text(
        json.dumps(
            {
                "runs": runs,
                "detection": dets,
                "sweep": eps_rows,
                "distance_sweep": dsweep,
                "sizes": sizes,
                "filter": fm,
                "markdown": text,
            },
            indent=1,
        )
    )
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
