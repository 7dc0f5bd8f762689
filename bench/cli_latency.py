"""CLI latency: how long `mmalign --help`, every sub-command's `--help`, `mmalign models`, the
one-line usage errors, `mmalign.load` and a `Searcher` take from a cold process.

    python bench/cli_latency.py                  # the table, 5 runs of each (median)
    python bench/cli_latency.py --repeats 1      # a quick look
    python bench/cli_latency.py --write-doc      # also rewrite the section in docs/benchmarks.md

Each command runs as a user types it (the ``mmalign`` console script next to this Python), in
a fresh process, ``--repeats`` times; the table gives the median wall time against its goal
(issue 39): 2 s for a help text, ``models`` or a usage error; 3 s beyond ``import torch`` for
loading a small (micro) model with ``mmalign.load`` and for constructing a ``Searcher`` over a
small index with that model (measured inside the process, after ``import torch``, whose median
time is shown beside them). The model is a seeded random init: weights do not change the time.
tests/cli/test_cli_latency.py holds the same commands to 3x these goals and checks that none of the
fast ones imports torch or another heavy library.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, command, parser, write_section

HELP_GOAL, LOAD_GOAL = 2.0, 3.0

# a cold process: import torch, then the timed part; prints [torch seconds, timed seconds]
LOAD_CODE = """
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
%s
t2 = time.perf_counter()
print(json.dumps([t1 - t0, t2 - t1]))
"""
LOAD = "import mmalign; mmalign.load(sys.argv[1])"
SEARCHER = "from mmalign.search.searcher import Searcher; Searcher(sys.argv[2], sys.argv[1])"


def mmalign_cmd() -> list[str]:
    script = Path(sys.executable).parent / "mmalign"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "mmalign.cli"]


def help_commands() -> list[list[str]]:
    """`--help` of mmalign, of each sub-command (data_pipelines' too) and of their own sub-commands."""
    from mmalign.cli import build_parser

    def subs(parser):
        return next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})

    found = [["--help"]]
    for name, p in subs(build_parser()).items():
        found.append([name, "--help"])
        found += [[name, inner, "--help"] for inner in subs(p)]
    return found


def usage_errors(tmp: Path) -> list[list[str]]:
    missing = str(tmp / "missing")
    return [
        ["train", "--config", f"{missing}.yaml"],
        ["train", "--set", "train.stepz=3"],
        ["train", "--set", f"data.train={missing}/00000.tar"],
        ["eval", "--model", missing],
        ["export", "--model", missing, "--format", "hf", "--out", str(tmp / "o")],
        ["search", "--index", missing, "--model", missing, "--text", "a cat"],
        ["mine", "--data", str(tmp), "--model", missing, "--out", str(tmp / "o")],
        ["curate", "--data", missing, "--model", missing, "--out", str(tmp / "o")],
        ["shards", "imagefolder", "--input", missing, "--out", str(tmp / "o")],
        [
            "tokenizer",
            "train",
            "--data",
            f"{missing}/0.tar",
            "--vocab-size",
            "64",
            "--out",
            str(tmp / "t.model"),
        ],
    ]


def wall(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT, timeout=600)
    return time.perf_counter() - start


def timed_inside(code: str, *args: str) -> tuple[float, float]:
    res = subprocess.run(
        [sys.executable, "-c", LOAD_CODE % code, *args], capture_output=True, text=True, cwd=ROOT, timeout=600
    )
    if res.returncode:
        raise SystemExit(f"bench/cli_latency.py: {code!r} failed: {res.stderr.strip().splitlines()[-1:]}")
    torch_s, part_s = json.loads(res.stdout.splitlines()[-1])
    return torch_s, part_s


def small_corpus(work: Path) -> tuple[str, str]:
    """A micro model and an index of a few images (tests/harness/searchdata.py's corpus)."""
    from tests.harness.searchdata import build_corpus

    if not (work / "idx" / "index.json").is_file():
        build_corpus(work)
    return str(work / "model"), str(work / "idx")


def cpu_line() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next(ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name"))
    except (OSError, StopIteration):
        model = platform.processor() or platform.machine()
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    bf16 = ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no avx512_bf16 / amx_bf16"
    return f"{model} ({bf16})"


def markdown(rows: list[tuple[str, float, str, bool]], repeats: int, cmd: str, env: str) -> str:
    met = sum(r[3] for r in rows)
    lines = [
        "## CLI latency from a cold process (bench/cli_latency.py)",
        "",
        f"`{cmd}` · {env} · median of {repeats} run(s) each · {met} of {len(rows)} goals met",
        "",
        "| command | median s | goal | met |",
        "|---|---:|---|---|",
    ]
    lines += [f"| `{name}` | {s:.2f} | {goal} | {'met' if ok else 'not met'} |" for name, s, goal, ok in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = parser(__doc__, write_doc="")
    p.add_argument("--repeats", type=int, default=5, help="runs of each command (the median is reported)")
    p.add_argument(
        "--work",
        default=str(ROOT / "data" / "bench_cli_latency"),
        help="folder for the small model and index (made once)",
    )
    args = p.parse_args()
    watch = LoadWatch()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model, index = small_corpus(work)
    base = mmalign_cmd()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for argv in help_commands() + [["models"], ["models", "--all"]] + usage_errors(Path(tmp)):
            s = statistics.median(wall(base + argv) for _ in range(args.repeats))
            shown = " ".join(a.replace(tmp, "TMP") for a in ["mmalign", *argv])
            rows.append((shown, s, f"<= {HELP_GOAL:g} s", s <= HELP_GOAL))
            print(f"{s:6.2f} s  {shown}", flush=True)
    torch_times = []
    for name, code, extra in (
        ("mmalign.load(micro model)", LOAD, ()),
        ("Searcher(index, micro model)", SEARCHER, (index,)),
    ):
        pairs = [timed_inside(code, model, *extra) for _ in range(args.repeats)]
        torch_times += [t for t, _ in pairs]
        s = statistics.median(part for _, part in pairs)
        rows.append((f"{name}, after import torch", s, f"<= {LOAD_GOAL:g} s beyond torch", s <= LOAD_GOAL))
        print(f"{s:6.2f} s  {name} (beyond import torch)", flush=True)
    rows.append(("python -c 'import torch' (for reference)", statistics.median(torch_times), "-", True))
    import torch

    env = (
        f"{datetime.date.today().isoformat()} · {cpu_line()}, {os.cpu_count()} CPU cores · "
        f"torch {torch.__version__}"
    )
    cmd = command()
    text = markdown(rows, args.repeats, cmd, env)
    print("\n" + text)
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
