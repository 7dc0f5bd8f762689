"""The loader's speed before and after the global order of issue 30 (a script, not a test).

Issue 30 asks that the loader's samples per worker-CPU-second at 224 px (``bench/loader.py
--size 224``) stay within 5% of what it was before the lanes (mmalign/data/stream.py), or
better.  "Before" is the commit ``b35092e`` (one stream per rank and worker), "after" is this
working tree.  The script

* checks the old commit out into a temporary git worktree (removed at the end);
* builds one set of shards for both, with the builder ``bench/loader.py --size 224`` uses
  (``loader_openclip.make_shards``: 256-px JPEGs, gradient + noise, quality 90, one caption
  line, shards of 250);
* runs, in a fresh process per run with ``PYTHONPATH`` set to the tree under test, that tree's
  ``build_train_loader``: one worker (``data.workers=1``), batch 256, resampled shards, a
  5000-sample shuffle buffer, ``train_transform(224, ...)`` with the default augmentation plus
  a horizontal flip, CLIP-BPE tokens of context 77;
* times a fixed number of batches after the warm-up ones and divides the samples by the
  worker's user + system CPU seconds over those batches (psutil, as bench/loader_openclip.py's
  ``timed`` does: the same function is used here), so a busy neighbour matters less than to
  wall-clock time;
* alternates old and new (old first in even rounds, new first in odd ones, so a drift in the
  machine's load hurts both alike) for ``--repeats`` rounds and reports each round's ratio
  new / old and their median.

    .venv/bin/python bench/loader_before_after.py                 # prints the table
    .venv/bin/python bench/loader_before_after.py --write-doc     # ... and updates docs/benchmarks.md

``--write-doc`` goes through bench/idle.py's load guard: on a loaded machine the document is
left alone (exit 3) unless ``--allow-loaded``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
from idle import LoadWatch, add_flag, write_section  # noqa: E402

DOC = ROOT / "docs" / "benchmarks.md"
SECTION = "## Loader before and after the global order (bench/loader_before_after.py)"
OLD = "b35092e"  # the last commit before the lanes (issue 30)
TARGET = 0.95  # issue 30: within 5% of the old loader's samples per worker-CPU-second, or better


# ------------------------------------------------------------------ one run (in its own process)


def case(argv: list[str]) -> None:
    """One loader run of the tree on PYTHONPATH; prints one JSON line."""
    p = argparse.ArgumentParser()
    p.add_argument("--tree")
    p.add_argument("--spec")
    p.add_argument("--size", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--batches", type=int)
    p.add_argument("--warmup", type=int)
    p.add_argument("--shuffle", type=int)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    import mmalign

    where = Path(mmalign.__file__).resolve()
    if not where.is_relative_to(Path(a.tree).resolve()):  # an installed copy would shadow the tree under test
        raise SystemExit(f"mmalign came from {where}, not from {a.tree}")
    from loader_openclip import timed  # bench/: the same timing as bench/loader.py --size 224
    from open_clip.tokenizer import SimpleTokenizer

    from mmalign.config import AugmentConfig, DataConfig
    from mmalign.data.loader import build_train_loader
    from mmalign.data.transforms import train_transform

    aug = AugmentConfig(hflip=True)  # the default augmentation (crop scale 0.85-1) plus a flip
    cfg = DataConfig(train=a.spec, mode="resampled", workers=1, shuffle_buffer=a.shuffle, augment=aug)
    loader = build_train_loader(
        cfg, train_transform(a.size, aug), SimpleTokenizer(context_length=77), a.batch, seed=0
    )
    batches = iter(loader)
    result = timed(batches, a.warmup, a.batches, a.batch)
    batches.close()  # stops the worker now
    print(json.dumps({**result, "mmalign": str(where)}), flush=True)


def run_case(tree: Path, spec: str, a) -> dict:
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--case",
        "--tree",
        str(tree),
        "--spec",
        spec,
        "--size",
        str(a.size),
        "--batch",
        str(a.batch),
        "--batches",
        str(a.batches),
        "--warmup",
        str(a.warmup),
        "--shuffle",
        str(a.shuffle),
    ]
    env = dict(os.environ, PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"the run of {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ the comparison


def uptime() -> str:
    out = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    return out[out.find("load average") :] if "load average" in out else out


def cpu_flags() -> str:
    """The bf16 matrix flags of this CPU (``grep -o 'amx_bf16\\|avx512_bf16' /proc/cpuinfo | sort -u``)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "(no /proc/cpuinfo)"
    found = sorted(set(re.findall(r"amx_bf16|avx512_bf16", text)))
    return " ".join(found) if found else "(neither amx_bf16 nor avx512_bf16)"


def git(*args: str) -> str:  # read-only queries, and the worktree add of the old commit
    return subprocess.run(
        ["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True
    ).stdout.strip()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", default=OLD, help="the commit before the change (default %(default)s)")
    p.add_argument(
        "--n", type=int, default=3000, help="JPEGs in the shards (bench/loader.py --size 224's default)"
    )
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=8, help="timed batches per run")
    p.add_argument(
        "--warmup", type=int, default=2, help="batches before the timed ones (worker start, buffer fill)"
    )
    p.add_argument(
        "--shuffle", type=int, default=5000, help="data.shuffle_buffer (bench/loader.py --size 224's)"
    )
    p.add_argument("--repeats", type=int, default=3, help="rounds of one old and one new run")
    p.add_argument("--write-doc", action="store_true")
    add_flag(p)
    args = p.parse_args()
    watch = LoadWatch()
    command = (
        "python bench/loader_before_after.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    ).strip()
    load_before, flags = uptime(), cpu_flags()
    print(f"before: {load_before}", flush=True)
    print(f"CPU flags: {flags}", flush=True)
    old_commit = git("rev-parse", "--short", args.old)
    head = git("rev-parse", "--short", "HEAD")
    dirty = bool(git("--no-optional-locks", "status", "--porcelain", "--", "mmalign"))
    from loader_openclip import make_shards

    tmp = Path(tempfile.mkdtemp(prefix="mmalign-before-after-"))
    old_tree = tmp / "old"
    rounds: list[dict] = []
    try:
        git("worktree", "add", "--detach", str(old_tree), args.old)
        shards = tmp / "shards"
        shards.mkdir()
        spec, jpeg_bytes = make_shards(shards, args.n, per_shard=250)
        print(
            f"{args.n} JPEGs of 256 px, mean {jpeg_bytes / 1024:.1f} KiB; old = {old_commit}, new = this tree "
            f"({head}{' + uncommitted changes' if dirty else ''})",
            flush=True,
        )
        trees = {"old": old_tree, "new": ROOT}
        for i in range(args.repeats):
            got = {}
            for which in ("old", "new") if i % 2 == 0 else ("new", "old"):
                got[which] = run_case(trees[which], spec, args)
            ratio = got["new"]["cpu_rate"] / got["old"]["cpu_rate"]
            rounds.append({**got, "ratio": ratio, "load": os.getloadavg()[0]})
            print(
                f"round {i + 1}: old {got['old']['cpu_rate']:.0f}, new {got['new']['cpu_rate']:.0f} samples per "
                f"worker-CPU-second, new/old {ratio:.3f} (wall {got['old']['rate']:.0f} / {got['new']['rate']:.0f} "
                f"samples/s; load {rounds[-1]['load']:.1f})",
                flush=True,
            )
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old_tree)],
            capture_output=True,
            text=True,
        )
        shutil.rmtree(tmp, ignore_errors=True)
    load_after = uptime()
    median = statistics.median(r["ratio"] for r in rounds)
    print(f"median new/old: {median:.3f} (target >= {TARGET})")
    print(f"after: {load_after}")

    import torch

    table = [
        "| round | first | old samples per worker-CPU-s | new | new / old | old samples/s (wall) | new | "
        "load at end of round |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(rounds):
        table.append(
            f"| {i + 1} | {'old' if i % 2 == 0 else 'new'} | {r['old']['cpu_rate']:.0f} | "
            f"{r['new']['cpu_rate']:.0f} | {r['ratio']:.3f} | {r['old']['rate']:.0f} | {r['new']['rate']:.0f} | "
            f"{r['load']:.1f} |"
        )
    verdict = "met" if median >= TARGET else "**not met**"
    body = (
        f"Command: `{command}` · {datetime.date.today()} · {platform.machine()}, {os.cpu_count()} CPU cores "
        f"(bf16 flags: {flags}) · torch {torch.__version__} · old = {old_commit} (one stream per rank and "
        f"worker), new = {head}{' with uncommitted changes' if dirty else ''} (lanes) · data: {args.n} generated "
        f"256x256 JPEGs (mean {jpeg_bytes / 1024:.1f} KiB, shards of 250, bench/loader.py --size 224's builder) · "
        f"one worker, batch {args.batch}, resampled shards, shuffle buffer {args.shuffle}, random-resized-crop "
        f"(scale 0.85-1) to {args.size} px + flip, CLIP-BPE context 77; {args.batches} timed batches after "
        f"{args.warmup} warm-up batches per run, each run in its own process, old and new alternating for "
        f"{args.repeats} rounds. Samples per worker-CPU-second: samples over the worker's user + system CPU "
        f"seconds during the timed batches. Load: {load_before} before, {load_after} after.\n\n"
        + "\n".join(table)
        + f"\n\nMedian new / old: {median:.3f}. Issue 30's goal (>= {TARGET} of the old loader's samples per "
        f"worker-CPU-second): {verdict}.\n"
    )
    print()
    print("\n".join(table))
    if args.write_doc:
        write_section(DOC, f"{SECTION}\n\n{body.strip()}\n", watch, args.allow_loaded)
        print(f"\nwrote {DOC}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--case"]:
        case(sys.argv[2:])
    else:
        main()
