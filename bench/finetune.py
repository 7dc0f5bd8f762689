"""Fine-tuning a half-class model on all of CIFAR-10: full vs LiT vs frozen, at equal steps.

The story of ``configs/finetune_cifar10_cpu.yaml``, measured three ways:

1. pretrain the CIFAR-10 recipe's towers (``configs/cifar10_cpu.yaml``) on the images of
   HALF the classes (those outside the ``heldout`` task of ``eval/cifar10_heldout.yaml``),
   then export the model to open_clip's folder format (``mmalign export --format open_clip``);
   both are cached in the work folder and reused while their settings are unchanged;
2. from that export (``model.pretrained``), fine-tune on all ten classes, each mode for the
   same steps, batch, lr and data:

   - ``full``: both towers train;
   - ``lit``: the image tower locked (LiT, Zhai et al. 2022; the recipe's setting);
   - ``frozen``: both towers locked but the text projection (``model.lock_text_unlocked_layers:
     1``): a linear map on frozen text features, plus the temperature (mmalign refuses two
     fully locked towers: only the temperature would train, and zero-shot top-1 does not
     depend on it).

Each run is the recipe's own ``mmalign train`` subprocess; its final evaluation is
``eval/cifar10_heldout.yaml`` on the test images: zero-shot top-1 over all ten classes, and
on the held-out five (their images, scored among their five names).  "before" is the
half-class model's own evaluation on the same test images.  samples/s: the mean of the
log windows after the first (data wait included); peak RSS: the training process's
maximum resident memory (``wait4``: its loader worker included as a maximum, not a sum),
evaluation and start-up included; CPU s: user + system CPU of the whole run.

    python bench/finetune.py                # ~5 min on 2 idle cores (10k images, short runs)
    python bench/finetune.py --full         # the recipe's sizes (50k images, 200 + 3 x 100 steps of 256)

Results go to ``WORK/results.json``; the table replaces this benchmark's section of
docs/benchmarks.md (``--no-doc`` leaves it alone, ``--doc`` writes another file).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.cifar10_shards import cached_shards, cifar_items
from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, write_section

SECTION = "## Fine-tuning a half-class model: full vs LiT vs frozen (bench/finetune.py)"
SUITE = "cifar10_heldout"
MODES = {
    "full": ["model.lock_image=false"],
    "lit": ["model.lock_image=true"],
    "frozen": ["model.lock_image=true", "model.lock_text=true", "model.lock_text_unlocked_layers=1"],
}
TRAINS = {"full": "both towers", "lit": "text tower (image locked)", "frozen": "text projection only"}


def split_classes() -> tuple[list[str], list[str]]:
    """(seen, held out): the held-out five are the suite's ``heldout`` task, the seen ones the rest."""
    from mmalign.evaluation import load_suite

    task = next(t for t in load_suite(SUITE)["tasks"] if t["name"] == "heldout")
    held = list(task["classes"])
    return [c for c in task["classnames"] if c not in held], held


# ------------------------------------------------------------------ data


def build_split(src: Path, out: Path, n: int, seed: int, per_shard: int, only: list[str] | None) -> str:
    """The first ``n`` of a seeded shuffle of a class-folder tar (``only`` these classes) -> shards,
    captioned as ``mmalign shards imagefolder --templates cifar10`` does; reused while unchanged."""
    want = {"src": str(src), "n": n, "seed": seed, "per_shard": per_shard, "only": only}
    return cached_shards(
        src, out, want, lambda: itertools.islice(cifar_items(src, seed, shuffle_seed=seed, only=only), n)
    )


# ------------------------------------------------------------------ runs


def run(cmd: list[str], log: Path) -> dict:
    """A subprocess to its end: wall seconds, CPU seconds and peak RSS (MiB) from ``wait4``."""
    start = time.time()
    with log.open("w") as f:
        proc = subprocess.Popen(
            cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT))
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise SystemExit(f"{' '.join(cmd[2:5])} ... failed (exit {proc.returncode}); see {log}:\n{tail}")
    # ru_maxrss is in KiB on Linux; RUSAGE_BOTH of the child: the larger of it and its reaped children
    return {
        "wall_s": time.time() - start,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "peak_rss_mib": usage.ru_maxrss / 1024,
    }


def train(config: str, out: Path, sets: list[str]) -> dict:
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
    for s in sets:
        cmd += ["--set", s]
    out.parent.mkdir(parents=True, exist_ok=True)
    usage = run(cmd, out.parent / f"{out.name}.log")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    rates = [r["samples_per_s"] for r in records]
    rates = rates[1:] if len(rates) > 1 else rates  # the first window holds start-up and the buffer fill
    return {**usage, "samples_per_s": sum(rates) / len(rates), **accuracies(out / "eval.json")}


def accuracies(path: Path) -> dict:
    records = {r["dataset"]: r for r in json.loads(path.read_text())}
    return {
        "all_acc1": records[f"{SUITE}/zeroshot"]["metrics"]["acc1"],
        "heldout_acc1": records[f"{SUITE}/heldout"]["metrics"]["acc1"],
        "heldout_n": records[f"{SUITE}/heldout"]["n_images"],
    }


def pretrain_half(
    work: Path, train_spec: str, test: str, steps: int, batch: int, log_every: int
) -> tuple[Path, dict]:
    """The half-class model and its open_clip export, reused while the settings are unchanged."""
    out, export = work / "half", work / "half_open_clip"
    want = {"train": train_spec, "test": test, "steps": steps, "batch": batch}
    stamp = work / "half_stamp.json"
    if (
        stamp.is_file()
        and json.loads(stamp.read_text()).get("settings") == want
        and (export / "open_clip_config.json").is_file()
    ):
        print(f"  reusing the half-class model in {out}", flush=True)
        return export, json.loads(stamp.read_text())["result"]
    result = train(
        "configs/cifar10_cpu.yaml",
        out,
        [
            f"data.train={train_spec}",
            f"data.val={test}",
            f"train.steps={steps}",
            f"train.global_batch_size={batch}",
            f"train.warmup_steps={max(1, steps // 5)}",
            f"train.log_every={log_every}",
            f"eval.suite={SUITE}",
            "monitor.tensorboard=false",
        ],
    )
    run(
        [
            sys.executable,
            "-m",
            "mmalign.cli",
            "export",
            "--model",
            str(out),
            "--format",
            "open_clip",
            "--out",
            str(export),
            "--force",
        ],
        work / "export.log",
    )
    stamp.write_text(json.dumps({"settings": want, "result": result}))
    return export, result


def finetune(
    work: Path, mode: str, export: Path, train_spec: str, test: str, steps: int, batch: int, log_every: int
) -> dict:
    return train(
        "configs/finetune_cifar10_cpu.yaml",
        work / f"ft_{mode}",
        [
            f"model.pretrained={export}",
            *MODES[mode],
            f"data.train={train_spec}",
            f"data.val={test}",
            f"train.steps={steps}",
            f"train.global_batch_size={batch}",
            f"train.warmup_steps={max(1, steps // 10)}",
            f"train.log_every={log_every}",
            "monitor.tensorboard=false",
        ],
    )


# ------------------------------------------------------------------ report


def table(before: dict, rows: dict) -> str:
    full = rows["full"]
    lines = [
        "| mode | trains | held-out top-1 (%) before → after | all-class top-1 (%) before → after | "
        "train samples/s | vs full | CPU s (run) | peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, r in rows.items():
        lines.append(
            f"| {mode} | {TRAINS[mode]} | {100 * before['heldout_acc1']:.1f} → {100 * r['heldout_acc1']:.1f} | "
            f"{100 * before['all_acc1']:.1f} → {100 * r['all_acc1']:.1f} | {r['samples_per_s']:.1f} | "
            f"{r['samples_per_s'] / full['samples_per_s']:.2f}x | {r['cpu_s']:.0f} | "
            f"{r['peak_rss_mib']:.0f} |"
        )
    return "\n".join(lines)


def public_args(argv: list[str]) -> list[str]:
    """The command line without --work / --doc / --data and their values (machine paths)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--work", "--doc", "--data"):
            skip = True
        elif not a.startswith(("--work=", "--doc=", "--data=")):
            out.append(a)
    return out


def main() -> None:
    p = parser(__doc__, write_doc=None)
    p.add_argument(
        "--full",
        action="store_true",
        help="the recipe's sizes: all 50k train / 10k test images, "
        "pretrain 200 steps and fine-tune 100 steps of 256",
    )
    p.add_argument(
        "--train-samples",
        type=int,
        help="all-class train images (default 10000, --full 50000); "
        "the half-class set takes the seen classes' share",
    )
    p.add_argument("--test-samples", type=int, help="test images scored (default 2000, --full 10000)")
    p.add_argument("--batch", type=int, help="global batch (default 128, --full 256)")
    p.add_argument("--pretrain-steps", type=int, help="half-class pretraining steps (default 80, --full 200)")
    p.add_argument("--steps", type=int, help="fine-tuning steps per mode (default 40, --full 100)")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from " + ", ".join(MODES))
    p.add_argument(
        "--data",
        default=str(ROOT.parent / "shared" / "data" / "cifar10"),
        help="folder with CIFAR-10 train.tar and test.tar (class folders)",
    )
    p.add_argument("--work", default=str(ROOT / "data" / "bench_finetune"), help="shards, runs, logs, cache")
    p.add_argument("--doc", default=str(DOC), help="the document to write the table into")
    p.add_argument("--no-doc", action="store_true", help="print the table only")
    args = p.parse_args()
    watch = LoadWatch()
    f = args.full
    n_train = args.train_samples or (50000 if f else 10000)
    n_test = args.test_samples or (10000 if f else 2000)
    batch = args.batch or (256 if f else 128)
    pre_steps = args.pretrain_steps or (200 if f else 80)
    steps = args.steps or (100 if f else 40)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown or "full" not in modes:
        p.error(f"--modes: from {', '.join(MODES)}, with full (the speed reference); got {args.modes!r}")
    log_every = max(1, min(10, steps // 4))
    work, data = Path(args.work), Path(args.data)
    work.mkdir(parents=True, exist_ok=True)

    seen, held = split_classes()
    print(f"data: seen {', '.join(seen)}; held out {', '.join(held)}", flush=True)
    per_shard = max(1, min(1000, n_train // 10))
    half = build_split(
        data / "train.tar", work / f"train_half{n_train // 2}", n_train // 2, 0, per_shard, seen
    )
    every = build_split(data / "train.tar", work / f"train_all{n_train}", n_train, 0, per_shard, None)
    test = build_split(
        data / "test.tar", work / f"test{n_test}", n_test, 1, min(1000, max(1, n_test // 2)), None
    )

    print(f"pretrain on the seen half: {pre_steps} steps x {batch}", flush=True)
    export, before = pretrain_half(work, half, test, pre_steps, batch, log_every)
    print(
        f"  before: held-out top-1 {100 * before['heldout_acc1']:.1f}%, all-class {100 * before['all_acc1']:.1f}%",
        flush=True,
    )
    rows = {}
    for mode in modes:
        print(f"fine-tune {mode}: {steps} steps x {batch} on all classes", flush=True)
        rows[mode] = r = finetune(work, mode, export, every, test, steps, batch, log_every)
        print(
            f"  held-out top-1 {100 * r['heldout_acc1']:.1f}%, all-class {100 * r['all_acc1']:.1f}%, "
            f"{r['samples_per_s']:.1f} samples/s, peak RSS {r['peak_rss_mib']:.0f} MiB",
            flush=True,
        )

    md = table(before, rows)
    cmd = command(public_args(sys.argv[1:]))
    text = (
        f"{SECTION}\n\nCommand: `{cmd.strip()}` · {datetime.date.today()} · {cpu_line()} · "
        f"tiny towers (ViT 4x128 @32px, text 4x128), fp32, AdamW.\n\n"
        f"Pretrained {pre_steps} steps x {batch} on {n_train // 2} train images of {', '.join(seen)} "
        f"(configs/cifar10_cpu.yaml), exported to open_clip format; each mode then fine-tunes from that export "
        f"for {steps} steps x {batch} on {n_train} images of all ten classes "
        f"(configs/finetune_cifar10_cpu.yaml, lr 5e-4). Held-out top-1: the {before['heldout_n']} test images of "
        f"{', '.join(held)}, scored among those five names (eval/{SUITE}.yaml); all-class top-1: {n_test} test "
        f"images among ten. frozen = both towers locked but the text projection. samples/s: mean of the log "
        f"windows after the first; CPU s and peak RSS: the whole training process (start-up and the final "
        f"evaluation included).\n\n{md}\n"
    )
    print("\n" + text)
    (work / "results.json").write_text(
        json.dumps({"before": before, "modes": rows, "markdown": text}, indent=2)
    )
    if not args.no_doc:
        write_section(Path(args.doc), text, watch, args.allow_loaded)
        print(f"wrote {SECTION!r} in {args.doc}")


if __name__ == "__main__":
    main()
