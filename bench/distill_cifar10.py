"""Distillation from a larger teacher on CIFAR-10: the tiny towers from scratch against distilled.

The teacher is the tiny preset made larger (``TEACHER_SETS``: both towers 5 layers x 160 wide,
embedding 160; there is no larger mmalign preset that trains on 2 CPU cores, and open_clip's
ViT-B-32 would take hours) and trained longer (``--teacher-steps`` x ``--teacher-batch``), on
the 50000 CIFAR-10 train images, each captioned with one seeded random clip_benchmark CIFAR
template over its class name. Its embeddings are then written once into a copy of the shards
(``mmalign embed --teacher-shards``), so the distilled students never run the teacher
(``loss.distill.teacher: stored``; ``--teacher-mode live`` runs it in every step instead).

Students, ``--seeds`` seeds each, equal steps, batch, lr and schedule (configs/cifar10_cpu.yaml's
recipe, as bench/cifar10_runs.run_mmalign sets it):

- scratch: the tiny preset, CLIP's InfoNCE loss alone;
- distilled: the same, plus ``loss.distill.weight`` x the KL divergence between the teacher's and
  the student's image->text and text->image softmax over the batch.

Both are scored by zero-shot top-1 on the 10000 CIFAR-10 test images (eval/cifar10.yaml), as
mean +- sample std over the seeds. The goal: distilled >= scratch + 2 points beyond the spread,
i.e. mean(distilled) - mean(scratch) - (std(distilled) + std(scratch)) >= 2.

Every finished run is cached in ``--work`` with a stamp of its settings (the teacher, the teacher
shards, each student), so the same command after an interruption trains only what is missing.

    python bench/distill_cifar10.py --quick                   # development: a few minutes
    python bench/distill_cifar10.py --write-doc               # the full size: < 25 min on 2 cores
        # (measured on a shared, loaded machine: teacher 9.5 min, teacher shards 2.2 min, each of
        # the 6 students 1-3 min including its 10k-image zero-shot)
    python bench/distill_cifar10.py --distill-weight 1,3,10   # a distilled arm per weight
    python bench/distill_cifar10.py --teacher-run DIR         # reuse a teacher trained before
"""

from __future__ import annotations

import datetime
import json
import math
import random
import shutil
import subprocess
import sys
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.cifar10_runs import run_mmalign
from bench.cifar10_shards import cached_shards, cifar_items, shard_spec
from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, write_section

SECTION = "## Distillation from a larger teacher on CIFAR-10 (bench/distill_cifar10.py)"
ARMS = ("scratch", "distilled")
# The teacher: the tiny preset (ViT 4x128 on 32 px, patch 4; text 4x128) made deeper and wider.
TEACHER_SETS = (
    "model.embed_dim=160",
    "model.vision.layers=5",
    "model.vision.width=160",
    "model.text.layers=5",
    "model.text.width=160",
    "model.text.heads=5",
)
TEACHER_NAME = "tiny widened: ViT 5x160 (patch 4, 32 px), text 5x160, embedding 160"
GOAL_POINTS = 2.0


# ------------------------------------------------------------------ data


def build_split(src: Path, out: Path, n: int | None, seed: int, per_shard: int) -> str:
    """``n`` random images (None: all) of a class-folder tar -> shuffled shards, one random
    CIFAR template per image (cached under ``out`` by these settings)."""

    def shuffled() -> list:
        items = list(cifar_items(src, seed))
        random.Random(seed).shuffle(items)  # class-mixed shards: the 5000-sample buffer suffices
        return items if n is None else items[:n]

    want = {"src": str(src), "n": n, "seed": seed, "per_shard": per_shard}
    return cached_shards(src, out, want, shuffled)


# ------------------------------------------------------------------ cached runs


def _cached(stamp: Path, want: dict) -> dict | None:
    """The result stored beside ``stamp`` when it was made with ``want``, else None."""
    if stamp.is_file():
        have = json.loads(stamp.read_text())
        if have.get("want") == json.loads(json.dumps(want)):  # as stored: tuples read back as lists
            return have["result"]
    return None


def train_cached(work: Path, name: str, want: dict, **kwargs) -> dict:
    """``run_mmalign(work, name, **kwargs)`` unless a run with the same settings finished before."""
    stamp = work / "stamps" / f"{name}.json"
    result = _cached(stamp, want)
    if result is not None and (work / "mmalign_runs" / name / "final").is_dir():
        print(f"  {name}: reusing the run trained before with these settings", flush=True)
        return result
    result = run_mmalign(work, name, **kwargs)
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"want": want, "result": result}, indent=1))
    return result


def teacher_accuracy(run: Path) -> float | None:
    """A run's own final zero-shot top-1 on cifar10 (its eval.json), None when it has none."""
    path = run / "eval.json"
    if not path.is_file():
        return None
    records = json.loads(path.read_text())
    return next((r["metrics"]["acc1"] for r in records if r["dataset"] == "cifar10/zeroshot"), None)


def teacher_shards(work: Path, teacher: Path, train: str, batch: int) -> str:
    """``mmalign embed --teacher-shards``: a copy of ``train`` with the teacher's embeddings per
    sample (cached by the teacher's weights and the data)."""
    out = work / "teacher_shards"
    stamp = work / "stamps" / "teacher_shards.json"
    weights = sorted(p for p in teacher.rglob("*.safetensors"))
    want = {
        "teacher": str(teacher),
        "weights": [[str(p), p.stat().st_mtime_ns] for p in weights],
        "train": train,
    }
    if _cached(stamp, want) is not None and (out / "teacher.json").is_file():
        print("  teacher shards: reusing the copy written before", flush=True)
        return shard_spec(out)
    shutil.rmtree(out, ignore_errors=True)
    cmd = [
        sys.executable,
        "-m",
        "mmalign.cli",
        "embed",
        "--model",
        str(teacher),
        "--data",
        train,
        "--teacher-shards",
        str(out),
        "--batch-size",
        str(batch),
    ]
    log = work / "teacher_shards.log"
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if proc.returncode:
        raise SystemExit(f"mmalign embed --teacher-shards failed (exit {proc.returncode}); see {log}")
    stamp.parent.mkdir(parents=True, exist_ok=True)
    stamp.write_text(json.dumps({"want": want, "result": json.loads((out / "teacher.json").read_text())}))
    return shard_spec(out)


# ------------------------------------------------------------------ report


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    values = [float(v) for v in values]
    m = sum(values) / len(values)
    var = sum((v - m) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return m, math.sqrt(var)


def goal_line(
    scratch: list[float], distilled: list[float], points: float = GOAL_POINTS, label: str = "distilled"
) -> str:
    """The goal, on accuracies in percent: mean(distilled) - mean(scratch) >= ``points`` + the
    spread (the two sample stds summed)."""
    (ms, ss), (md, sd) = mean_std(scratch), mean_std(distilled)
    diff, spread = md - ms, ss + sd
    met = "met" if diff - spread >= points else "not met"
    return (
        f"- {label} - scratch: {diff:+.2f} points; spread (sum of stds) {spread:.2f}; beyond the spread "
        f"{diff - spread:+.2f} (goal >= +{points:g}: {met})"
    )


def results_table(runs: list[dict]) -> str:
    lines = [
        "| student | seeds | zero-shot top-1 (%) per seed | mean +- std | wall per run (s, indicative) |",
        "|---|---|---|---|---|",
    ]
    acc: dict[str, list[float]] = {}
    labels = sorted(
        {_label(r): r.get("weight", 0.0) for r in runs}.items(), key=lambda kv: (kv[0] != "scratch", kv[1])
    )
    for label, _ in labels:
        rows = [r for r in runs if _label(r) == label]
        acc[label] = [100 * r["acc1"] for r in rows]
        m, s = mean_std(acc[label])
        wall = sum(r["process_s"] for r in rows) / len(rows)
        lines.append(
            f"| {label} | {len(rows)} | {', '.join(f'{a:.2f}' for a in acc[label])} | {m:.2f} +- {s:.2f} | "
            f"{wall:.0f} |"
        )
    lines.append("")
    distilled = [label for label in acc if label != "scratch"]
    if "scratch" in acc and distilled:
        lines += [goal_line(acc["scratch"], acc[label], label=label) for label in distilled]
    else:
        lines.append("- goal: not evaluated (an arm has no finished run yet)")
    return "\n".join(lines) + "\n"


def _label(run: dict) -> str:
    """A run's row: ``scratch``, or ``distilled, weight W``."""
    return "scratch" if run["arm"] == "scratch" else f"distilled, weight {run['weight']:g}"


def run_name(arm: str, seed: int, weight: float) -> str:
    """A student's run folder: ``distilled_seedS`` at weight 1 (open_clip's), else ``distilled_wW_seedS``."""
    if arm == "scratch" or weight == 1.0:
        return f"{arm}_seed{seed}"
    return f"{arm}_w{weight:g}_seed{seed}"


# ------------------------------------------------------------------ main


def main() -> None:
    p = parser(__doc__, write_doc="")
    p.add_argument(
        "--quick",
        action="store_true",
        help="development size: 2000 train / 500 test images, teacher 20 steps x 64, students 10 steps x 64, 1 seed",
    )
    p.add_argument(
        "--data",
        default=str(ROOT.parent / "shared" / "data" / "cifar10"),
        help="folder with CIFAR-10 train.tar and test.tar (class folders)",
    )
    p.add_argument("--work", default=str(ROOT / "data" / "bench_distill_cifar10"))
    p.add_argument("--seeds", type=int, default=None, help="student seeds per arm (default 3, quick 1)")
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--steps", type=int, default=None, help="student steps (default 100, quick 10)")
    p.add_argument("--batch", type=int, default=None, help="student global batch (default 128, quick 64)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--teacher-steps", type=int, default=None, help="teacher steps (default 250, quick 20)")
    p.add_argument(
        "--teacher-batch", type=int, default=None, help="teacher global batch (default 256, quick 64)"
    )
    p.add_argument(
        "--teacher-run",
        default=None,
        help="a teacher run (or model folder) trained before: used as is, not trained here",
    )
    p.add_argument(
        "--teacher-mode",
        choices=("stored", "live"),
        default="stored",
        help="stored (default): the teacher's embeddings written into the shards once "
        "(loss.distill.teacher: stored); live: the teacher runs in every step",
    )
    p.add_argument(
        "--distill-weight",
        default="1",
        help="loss.distill.weight; a comma list (1,5) trains a distilled arm per weight, each with its goal line",
    )
    args = p.parse_args()
    watch = LoadWatch()
    q = args.quick
    seeds = args.seeds or (1 if q else 3)
    steps = args.steps or (10 if q else 100)
    teacher_steps = args.teacher_steps or (20 if q else 250)
    args.batch = args.batch or (64 if q else 128)
    args.teacher_batch = args.teacher_batch or (64 if q else 256)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        raise SystemExit(f"--arms: unknown arm {bad[0]!r} (choose from {', '.join(ARMS)})")
    try:
        weights = [float(w) for w in args.distill_weight.split(",") if w.strip()]
    except ValueError:
        raise SystemExit(
            f"--distill-weight: {args.distill_weight!r} is not a comma list of numbers"
        ) from None
    if not weights or min(weights) < 0:
        raise SystemExit(f"--distill-weight: {args.distill_weight!r}: give weights >= 0")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)
    for split in ("train", "test"):
        if not (data / f"{split}.tar").is_file():
            raise SystemExit(f"--data: {data / f'{split}.tar'} not found (CIFAR-10 as class-folder tars)")

    n_train, n_test = (2000, 500) if q else (None, 10000)
    print("data: shuffled CIFAR-10 shards, one random CIFAR template per image", flush=True)
    train = build_split(
        data / "train.tar", work / f"train{n_train or 'all'}", n_train, 0, 1000 if not q else 400
    )
    test = build_split(data / "test.tar", work / f"test{n_test}", n_test, 1, 1000 if not q else 250)

    common = {"test": test, "lr": args.lr, "precision": "fp32", "log_every": 10}
    if args.teacher_run:
        teacher = Path(args.teacher_run)
        t_acc = teacher_accuracy(teacher)
        t_line = f"given with --teacher-run ({teacher})"
    else:
        print(f"teacher: {TEACHER_NAME}, {teacher_steps} steps x {args.teacher_batch}", flush=True)
        want = {
            "sets": TEACHER_SETS,
            "steps": teacher_steps,
            "batch": args.teacher_batch,
            "train": train,
            **common,
        }
        tr = train_cached(
            work,
            "teacher",
            want,
            train=train,
            steps=teacher_steps,
            batch=args.teacher_batch,
            warmup=max(1, teacher_steps // 10),
            seed=0,
            extra_sets=TEACHER_SETS,
            **common,
        )
        teacher = work / "mmalign_runs" / "teacher"
        t_acc = tr["acc1"]
        t_line = (
            f"{TEACHER_NAME}, {teacher_steps} steps x {args.teacher_batch}, seed 0 ({tr['process_s']:.0f} s)"
        )
    print(f"  teacher zero-shot top-1 {100 * t_acc:.2f}%" if t_acc is not None else "  teacher: no eval.json")

    distill_sets: tuple[str, ...] = ()
    distill_train = train
    if "distilled" in arms:
        if args.teacher_mode == "stored":
            print("teacher embeddings into a copy of the shards (mmalign embed --teacher-shards)", flush=True)
            distill_train = teacher_shards(work, teacher, train, 256)
            distill_sets += ("loss.distill.teacher=stored",)
        else:
            distill_sets += (f"loss.distill.teacher={teacher}",)

    runs = []
    students = [(arm, w) for arm in arms for w in (weights if arm == "distilled" else [0.0])]
    for seed in range(seeds):
        for arm, weight in students:
            name = run_name(arm, seed, weight)
            sets = (f"loss.distill.weight={weight}", *distill_sets) if arm == "distilled" else ()
            shards = distill_train if arm == "distilled" else train
            want = {"arm": arm, "sets": sets, "steps": steps, "batch": args.batch, "seed": seed, **common}
            if arm == "distilled":
                want["teacher"] = str(teacher)
            r = train_cached(
                work,
                name,
                want,
                train=shards,
                steps=steps,
                batch=args.batch,
                warmup=max(1, steps // 10),
                seed=seed,
                extra_sets=sets,
                **common,
            )
            r["arm"], r["weight"] = arm, weight
            runs.append(r)
            print(f"  {name}: zero-shot top-1 {100 * r['acc1']:.2f}% ({r['process_s']:.0f} s)", flush=True)
            (work / "results_partial.json").write_text(json.dumps(runs, indent=1))

    import torch

    env = f"{datetime.date.today().isoformat()} · {cpu_line(torch.get_num_threads())} · torch {torch.__version__}"
    mode = (
        "its embeddings stored in the shards by `mmalign embed --teacher-shards` (loss.distill.teacher: stored)"
        if args.teacher_mode == "stored"
        else "run live in every step (loss.distill.teacher: the teacher run)"
    )
    t_acc_text = f"{100 * t_acc:.2f}%" if t_acc is not None else "not measured"
    setup = (
        f"Data: CIFAR-10 train ({n_train or 50000} images), one random clip_benchmark CIFAR template per image; "
        f"zero-shot top-1 on {n_test} CIFAR-10 test images (eval/cifar10.yaml). Teacher: {t_line}; zero-shot "
        f"top-1 {t_acc_text}; {mode}. Students: the tiny preset, {steps} steps x {args.batch}, AdamW lr "
        f"{args.lr:g}, fp32 (configs/cifar10_cpu.yaml's recipe), seeds 0..{seeds - 1}; distilled adds "
        f"loss.distill.weight ({', '.join(f'{w:g}' for w in weights)}) x KL(teacher || student) over the batch "
        f"(1 is open_clip's). Wall times are indicative only (the runs are compared by accuracy, not speed)."
    )
    text = "\n".join([SECTION, "", f"Command: `{command()}` · {env}", "", setup, "", results_table(runs)])
    print("\n" + text)
    (work / "results.json").write_text(
        json.dumps({"runs": runs, "teacher_acc1": t_acc, "markdown": text}, indent=1)
    )
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
