"""Equal-budget quality on CIFAR-10: open_clip's own trainer against mmalign.

Both tools train the same tiny towers (mmalign's ``tiny`` preset: ViT 4x128 on 32 px
with patch 4, text transformer 4x128) on the same CIFAR-10 train shards, where each
caption is one random clip_benchmark CIFAR template over the class name and the
class id sits in ``.json``.  Both final models are then scored by **mmalign's**
zero-shot code (``eval/cifar10.yaml``: the 18 CIFAR templates, the same transform and
tokenizer) on the CIFAR-10 test split, so the metric is identical.

Three parts (``--parts``, comma-separated; default ``equal-steps,wallclock``), run in this order:

speed        each tool's training speed on these shards and towers, no evaluation: short runs
             (``--speed-steps``) alternating the tools (open_clip_train, mmalign, ... per setting,
             ``--speed-reps`` times: A B A B), the median samples/s per tool and setting, and the
             ratio mmalign / open_clip_train at equal settings (fp32, 1 loader worker each; goal
             >= 1.15x) and at each tool's fastest setting (goal >= 1.5x).  Settings are
             ``--speed-openclip`` / ``--speed-mmalign`` lists (bench/abspeed.py: a precision,
             then +compile, +wN workers), the first of each being the equal one.
(a) equal-steps  equal steps, batch, lr, schedule and float32 (same augmentation, weight decay,
             Adam betas/eps, shuffle buffer, one loader worker each), then zero-shot.
(b) wallclock    equal wall-clock: each tool at its fastest setting of the speed runs (run once
             each when ``speed`` is not in --parts), for the steps that fill ``--minutes`` of
             training at that setting's measured samples/s, then zero-shot.

open_clip_train runs from a side directory with webdataset <= 0.2.86 (bench/cifar10_runs.py).

    python bench/quality_cifar10.py --quick                   # development: minutes
    python bench/quality_cifar10.py --parts speed --write-doc # the speed table: ~10 min on 2 idle cores
    python bench/quality_cifar10.py --parts speed,equal-steps,wallclock --write-doc
        # everything at the full size (defaults: 50000 train / 10000 test images, batch 256,
        # (a) 2 epochs = 392 steps, (b) --minutes 8 of training each): ~1 h on 2 idle cores
    python bench/quality_cifar10.py --parts wallclock --minutes 0.2    # the full-size path, briefly

Results go to ``WORK/results.json``; ``--write-doc`` replaces this benchmark's sections of
docs/benchmarks.md (through bench/idle.py: refused when the machine was loaded).
"""

from __future__ import annotations

import datetime
import json
import math
import random
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)
import torch

from bench import abspeed
from bench.cifar10_runs import OPENCLIP_SHUFFLE, WDS_OLD, eval_openclip, run_mmalign, run_openclip
from bench.cifar10_shards import cached_shards, cifar_items
from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, write_section

SECTION = "## Equal-budget quality on CIFAR-10 (bench/quality_cifar10.py)"
SPEED_SECTION = "## Speed against open_clip_train on CIFAR-10 (bench/quality_cifar10.py --parts speed)"
PARTS = ("speed", "equal-steps", "wallclock")


# ------------------------------------------------------------------ data


def build_split(src: Path, out: Path, n: int, seed: int, per_shard: int) -> str:
    """``n`` random images of a class-folder tar -> shards with one random template each.

    The folder tar is sorted by class; shuffling before writing gives every shard all
    classes, which open_clip's pipeline (5000-sample buffer) needs as much as ours.
    """

    def shuffled() -> list:
        items = list(cifar_items(src, seed))  # 60k tiny jpgs: ~100 MB held briefly
        random.Random(seed).shuffle(items)
        return items[:n]

    return cached_shards(src, out, {"src": str(src), "n": n, "seed": seed, "per_shard": per_shard}, shuffled)


def train_pair(
    work: Path,
    tag: str,
    *,
    train: str,
    test: str,
    n_train: int,
    batch: int,
    steps_per_epoch: int,
    epochs: int,
    lr: float,
    warmup: int,
    precisions: dict,
    log_every: int,
    seed: int = 0,
) -> list[dict]:
    """Train open_clip then mmalign for the same number of epochs/steps with one seed; evaluate both."""
    suffix = "" if seed == 0 else f"_seed{seed}"  # seed 0 keeps the single-run names
    oc = run_openclip(
        work,
        f"openclip_{tag}{suffix}",
        train=train,
        n_train=n_train,
        batch=batch,
        epochs=epochs,
        lr=lr,
        warmup=warmup,
        precision=precisions["open_clip"],
        log_every=log_every,
        seed=seed,
    )
    oc["acc1"] = eval_openclip(work, oc.pop("checkpoint"), test)
    _say(oc)
    mm = run_mmalign(
        work,
        f"mmalign_{tag}{suffix}",
        train=train,
        test=test,
        steps=steps_per_epoch * epochs,
        batch=batch,
        lr=lr,
        warmup=warmup,
        precision=precisions["mmalign"],
        log_every=log_every,
        seed=seed,
    )
    _say(mm)
    return [oc, mm]


def mean_std(values) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for one value)."""
    values = [float(v) for v in values]
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, math.sqrt(var)


def _say(r: dict) -> None:
    print(
        f"  {r['tool']:<9} {r['precision']:<9} {r['steps']:>5} steps: zero-shot top-1 {100 * r['acc1']:.2f}%, "
        f"{r['samples_per_s']:.1f} samples/s, process {r['process_s']:.0f} s",
        flush=True,
    )


def speed(
    work: Path,
    *,
    train: str,
    test_small: str,
    batch: int,
    steps: int,
    log_every: int,
    settings: dict[str, list[str]],
    reps: int,
) -> tuple[list[dict], dict]:
    """Short training runs of both tools, alternated (abspeed.alternation); no evaluation."""
    runs = []
    for tool, setting, rep in abspeed.alternation(settings, reps):
        kw = abspeed.setting_args(tool, setting)
        name = f"{'openclip' if tool == 'open_clip' else 'mmalign'}_speed_{setting.replace('+', '_')}_{rep}"
        if tool == "open_clip":
            r = run_openclip(
                work,
                name,
                train=train,
                n_train=steps * batch,
                batch=batch,
                epochs=1,
                lr=1e-3,
                warmup=1,
                log_every=log_every,
                **kw,
            )
            r.pop("checkpoint")
        else:
            r = run_mmalign(
                work,
                name,
                train=train,
                test=test_small,
                steps=steps,
                batch=batch,
                lr=1e-3,
                warmup=1,
                log_every=log_every,
                evaluate=False,
                **kw,
            )
        r.update(setting=setting, rep=rep)
        print(
            f"  {tool:<9} {setting:<16} rep {rep}: {r['samples_per_s']:.1f} samples/s, data wait "
            f"{r['data_ms_per_step']:.1f} ms/step, process {r['process_s']:.0f} s",
            flush=True,
        )
        runs.append(r)
    return runs, abspeed.summarise(runs, settings)


# ------------------------------------------------------------------ report


def table_a(rows: list[dict]) -> str:
    """One line per (tool, seed), then mean +- std per tool over seeds; the difference counts only
    beyond the spread (the guide's seed rule)."""
    lines = [
        "| tool | precision | seed | steps x batch | zero-shot top-1 (%) | train samples/s | process (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["tool"] != "open_clip", r.get("seed", 0))):
        lines.append(
            f"| {r['tool']} | {r['precision']} | {r.get('seed', 0)} | {r['steps']} x {r['batch']} | "
            f"{100 * r['acc1']:.2f} | {r['samples_per_s']:.1f} | {r['process_s']:.0f} |"
        )
    stats = {}
    for tool in ("open_clip", "mmalign"):
        mine = [r for r in rows if r["tool"] == tool]
        stats[tool] = (
            mean_std(100 * r["acc1"] for r in mine),
            mean_std(r["samples_per_s"] for r in mine),
            len(mine),
        )
    lines += [
        "",
        "| tool | seeds | zero-shot top-1 (%), mean +- std | train samples/s, mean +- std |",
        "|---|---|---|---|",
    ]
    for tool, ((acc, acc_sd), (sps, sps_sd), n) in stats.items():
        lines.append(f"| {tool} | {n} | {acc:.2f} +- {acc_sd:.2f} | {sps:.1f} +- {sps_sd:.1f} |")
    (oc_acc, oc_sd), (oc_sps, _), _ = stats["open_clip"]
    (mm_acc, mm_sd), (mm_sps, _), n = stats["mmalign"]
    diff = mm_acc - oc_acc
    spread = oc_sd + mm_sd
    verdict = (
        ("beyond the spread" if abs(diff) > spread else "within the spread: parity")
        if n > 1
        else "one seed: no spread, no claim"
    )
    lines.append(
        f"\nmmalign - open_clip: {diff:+.2f} points top-1 (sum of the two stds {spread:.2f}: {verdict}), "
        f"{mm_sps / oc_sps:.2f}x samples/s."
    )
    return "\n".join(lines)


def table_b(rows: list[dict], minutes: float, summary: dict) -> str:
    oc, mm = rows
    lines = [
        "| tool | best setting (measured) | steps x batch | est. train time (s) | zero-shot top-1 (%) | "
        "train samples/s | process (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        est = r["steps"] * r["batch"] / r["samples_per_s"]
        lines.append(
            f"| {r['tool']} | {r['setting']}, {r['settings']} | {r['steps']} x {r['batch']} | "
            f"{est:.0f} | {100 * r['acc1']:.2f} | {r['samples_per_s']:.1f} | {r['process_s']:.0f} |"
        )
    lines.append(
        f"\nBudget {minutes:g} min of training each; steps = budget x the best setting's median samples/s "
        "from the speed runs / batch ("
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(summary["medians"].items()))
        + " samples/s)."
    )
    lines.append(f"mmalign - open_clip: {100 * (mm['acc1'] - oc['acc1']):+.2f} points top-1.")
    return "\n".join(lines)


def wallclock(
    work: Path, *, train: str, test: str, batch: int, lr: float, minutes: float, log_every: int, summary: dict
) -> list[dict]:
    """Budget (b): each tool at its best setting of the speed runs, for the steps that fill ``minutes``."""
    rows = []
    for tool in ("open_clip", "mmalign"):
        setting = summary["best"][tool]["setting"]
        # cosine schedules need the length up front: fix the steps from the measured rate
        steps = max(1, round(minutes * 60 * summary["best"][tool]["median"] / batch))
        kw = dict(
            abspeed.setting_args(tool, setting),
            batch=batch,
            lr=lr,
            warmup=max(1, round(0.1 * steps)),
            log_every=log_every,
        )
        if tool == "open_clip":
            # open_clip counts epochs over --train-num-samples: one "epoch" of steps x batch samples
            r = run_openclip(work, "openclip_wallclock", train=train, n_train=steps * batch, epochs=1, **kw)
            r["acc1"] = eval_openclip(work, r.pop("checkpoint"), test)
            r["settings"] = "ClipLoss"
        else:
            r = run_mmalign(work, "mmalign_wallclock", train=train, test=test, steps=steps, **kw)
            r["settings"] = "InfoNCE untiled, no id positives"
        r["setting"] = setting
        _say(r)
        rows.append(r)
    return rows


def speed_text(summary: dict, cmd: str, env: str, setup: str, batch: int, steps: int, reps: int) -> str:
    return "\n".join(
        [
            SPEED_SECTION,
            "",
            f"Command: `{cmd}` · {env}",
            "",
            setup,
            "",
            f"Each tool trains {steps} steps x {batch} per run with no evaluation; the runs alternate the tools "
            f"(open_clip_train, mmalign, ... for each setting, {reps} times), and each cell is the median of the "
            "runs' steady samples/s (the runs in brackets). Settings: precision (fp32; bf16 = mmalign's "
            "train.precision=bf16 autocast; amp_bf16 = open_clip_train's), +compile = torch.compile of the towers, "
            "+wN = N loader workers (default 1). Equal settings = both fp32 with 1 worker; best = each tool's "
            "fastest measured setting.",
            "",
            abspeed.speed_table(summary),
        ]
    )


def write_doc(text: str, watch: LoadWatch, allow_loaded: bool) -> None:
    write_section(DOC, text, watch, allow_loaded)


def main() -> None:
    p = parser(__doc__, write_doc="write the tables into docs/benchmarks.md")
    p.add_argument(
        "--parts",
        default="equal-steps,wallclock",
        help=f"comma-separated, from {','.join(PARTS)} (run in that order; wallclock includes "
        "the speed runs, once each unless speed is named)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="development size: 3k train / 500 test images, batch 100, "
        "1 epoch, 1 min wall-clock budget, 10 steps per speed run",
    )
    p.add_argument("--train-samples", type=int, help="train images used (default 50000, quick 3000)")
    p.add_argument("--test-samples", type=int, help="test images scored (default 10000, quick 500)")
    p.add_argument("--batch", type=int, help="batch size (default 256, quick 100)")
    p.add_argument("--epochs", type=int, help="epochs of budget (a) (default 2, quick 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--resume",
        action="store_true",
        help="equal-steps: reuse the seeds an interrupted run finished (WORK/results_partial.json)",
    )
    p.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="equal-steps: train both tools with seeds 0..N-1 (model init and sample order) and report "
        "mean +- std over them (default 1; a quality claim needs >= 3)",
    )
    p.add_argument(
        "--minutes", type=float, help="training minutes per tool in budget (b) (default 8, quick 1)"
    )
    p.add_argument("--skip-wallclock", action="store_true", help="drop wallclock from --parts")
    p.add_argument(
        "--speed-steps",
        type=int,
        help="steps per speed run (default 40, quick 10; a multiple of the log interval, 10 or quick 5)",
    )
    p.add_argument("--speed-reps", type=int, default=2, help="runs per tool and setting in the speed part")
    p.add_argument(
        "--speed-openclip",
        default="fp32,amp_bf16",
        help="open_clip_train settings, the first being the equal one (see bench/abspeed.py)",
    )
    p.add_argument(
        "--speed-mmalign",
        default="fp32,bf16",
        help="mmalign settings, the first being the equal one (see bench/abspeed.py)",
    )
    p.add_argument(
        "--data",
        default=str(ROOT.parent / "shared" / "data" / "cifar10"),
        help="folder with CIFAR-10 train.tar and test.tar (class folders)",
    )
    p.add_argument("--work", default=str(ROOT / "data" / "bench_quality_cifar10"), help="shards, runs, logs")
    args = p.parse_args()
    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    if bad := set(parts) - set(PARTS):
        p.error(f"--parts: unknown {', '.join(sorted(bad))} (choose from {', '.join(PARTS)})")
    if args.seeds < 1:
        p.error("--seeds must be >= 1")
    if args.skip_wallclock and "wallclock" in parts:
        parts.remove("wallclock")
    settings = {"open_clip": args.speed_openclip.split(","), "mmalign": args.speed_mmalign.split(",")}
    try:
        for tool, names in settings.items():
            for name in names:
                abspeed.setting_args(tool, name)
    except ValueError as e:
        p.error(str(e))
    watch = LoadWatch()
    q = args.quick
    n_train = args.train_samples or (3000 if q else 50000)
    n_test = args.test_samples or (500 if q else 10000)
    batch = args.batch or (100 if q else 256)
    epochs = args.epochs or (1 if q else 2)
    minutes = args.minutes or (1.0 if q else 8.0)
    log_every = 5 if q else 10
    speed_steps = args.speed_steps or (2 * log_every if q else 4 * log_every)  # 1 (quick) or 3 steady windows
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)

    print("data: shuffled CIFAR-10 shards, one random CIFAR template per image", flush=True)
    per_shard = (
        1000 if n_train >= 5000 else max(1, n_train // 5)
    )  # >= 5 shards: shard shuffling has work to do
    train = build_split(data / "train.tar", work / f"train{n_train}", n_train, 0, per_shard)
    test = build_split(data / "test.tar", work / f"test{n_test}", n_test, 1, 1000)
    test_small = build_split(data / "test.tar", work / "test_calib", 200, 2, 200)  # the speed runs' data.val
    steps_per_epoch = math.ceil(n_train / batch)  # open_clip's count (it rolls over into the next pass)
    warmup = max(1, round(0.1 * steps_per_epoch * epochs))
    results: dict = {"parts": parts}

    summary = None
    if "speed" in parts or "wallclock" in parts:
        reps = args.speed_reps if "speed" in parts else 1
        print(
            f"speed: {speed_steps} steps x {batch} per run, {reps} run(s) per tool and setting, alternated: "
            f"{settings}",
            flush=True,
        )
        runs, summary = speed(
            work,
            train=train,
            test_small=test_small,
            batch=batch,
            steps=speed_steps,
            log_every=log_every,
            settings=settings,
            reps=reps,
        )
        results.update(speed_runs=runs, speed=summary)
        print(abspeed.speed_table(summary), flush=True)

    rows_a = rows_b = None
    if "equal-steps" in parts:
        print(
            f"(a) equal steps: {epochs} epoch(s) of {n_train} = {steps_per_epoch * epochs} steps x {batch}, "
            f"lr {args.lr:g}, warmup {warmup}, fp32",
            flush=True,
        )
        rows_a = []
        partial = work / "results_partial.json"
        done = json.loads(partial.read_text())["budget_a"] if args.resume and partial.is_file() else []
        for seed in range(args.seeds):
            again = [
                r
                for r in done
                if r.get("seed", 0) == seed and r["steps"] == steps_per_epoch * epochs and r["batch"] == batch
            ]
            if len(again) == 2:  # both tools of this seed, from an interrupted run of the same settings
                print(f"  seed {seed}: reusing the runs of {partial}", flush=True)
                rows_a += again
                continue
            print(f"  seed {seed}", flush=True)
            rows_a += train_pair(
                work,
                "equal_steps",
                train=train,
                test=test,
                n_train=n_train,
                batch=batch,
                steps_per_epoch=steps_per_epoch,
                epochs=epochs,
                lr=args.lr,
                warmup=warmup,
                precisions={"open_clip": "fp32", "mmalign": "fp32"},
                log_every=log_every,
                seed=seed,
            )
            (work / "results_partial.json").write_text(json.dumps({"budget_a": rows_a}, indent=2))
        results["budget_a"] = rows_a
    if "wallclock" in parts:
        print(
            f"(b) equal wall-clock: {minutes:g} min of training each, each tool at its fastest setting",
            flush=True,
        )
        rows_b = wallclock(
            work,
            train=train,
            test=test,
            batch=batch,
            lr=args.lr,
            minutes=minutes,
            log_every=log_every,
            summary=summary,
        )
        results.update(budget_b=rows_b, minutes=minutes)

    cmd = command()
    env = (
        f"{datetime.date.today().isoformat()} · {cpu_line(torch.get_num_threads())} · "
        f"torch {torch.__version__}, open_clip_torch "
        f"{_version('open_clip_torch')} (open_clip_train with webdataset {WDS_OLD}), mmalign with webdataset "
        f"{_version('webdataset')}"
    )
    data_line = (
        f"data: CIFAR-10 train, {n_train} images shuffled into {per_shard}-image shards, one random "
        f"clip_benchmark CIFAR template per image"
    )
    common = (
        f"tiny towers (ViT 4x128 @32px patch 4, text 4x128) · AdamW lr {args.lr:g}, betas (0.9, 0.98), "
        f"eps 1e-6, wd 0.1, warmup 10% then cosine · random-resized-crop 0.9-1, no flip · "
        f"{OPENCLIP_SHUFFLE}-sample shuffle buffer. samples/s: mean over log windows after the first "
        f"(data wait included)"
    )
    texts = []
    if summary is not None and "speed" in parts:
        texts.append(
            speed_text(summary, cmd, env, f"{data_line} · {common}.", batch, speed_steps, args.speed_reps)
        )
    if rows_a or rows_b:
        setup = (
            f"{data_line}; zero-shot top-1 on {n_test} test images with mmalign's suite (eval/cifar10.yaml, "
            f"18 templates) for both models · {common}; one pass per epoch. process (s): the training "
            f"subprocess end to end, start-up included; mmalign's also saves final/ and scores the test split."
        )
        text = [SECTION, "", f"Command: `{cmd}` · {env}", "", setup]
        if rows_a:
            text += [
                "",
                f"**(a) Equal steps, batch, lr and float32, 1 loader worker each, "
                f"{args.seeds} seed(s) per tool**",
                "",
                table_a(rows_a),
            ]
        if rows_b:
            text += [
                "",
                "**(b) Equal wall-clock, each at its best measured setting**",
                "",
                table_b(rows_b, minutes, summary),
            ]
        texts.append("\n".join(text))
    for text in texts:
        print("\n" + text)
    results["markdown"] = texts
    (work / "results.json").write_text(json.dumps(results, indent=2))
    if args.write_doc:
        for text in texts:  # the load guard judges the whole run once; both sections or neither
            write_doc(text, watch, args.allow_loaded)
            print(f"\nwrote {text.splitlines()[0]!r} in docs/benchmarks.md")


def _version(dist: str) -> str:
    from importlib.metadata import version

    try:
        return version(dist)
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
