"""Gradient caching: step time and peak memory against uncached steps.

Tiny towers (the `tiny` preset) on CPU through the real engine (DeepSpeed ZeRO-0,
fp32, AdamW): global batch 256..4096 with chunk 256, and uncached steps where they
fit.  Each case runs in its own process so peak RSS is that case's alone; uncached
cases get an address-space cap so a case that does not fit fails instead of
swapping the machine.

    .venv/bin/python bench/gradcache.py            # prints the table and updates docs/benchmarks.md
    .venv/bin/python bench/gradcache.py --quick    # 256 and 1024 only
"""

from __future__ import annotations

import datetime
import json
import os
import resource
import subprocess
import sys
import time

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, cpu_line, parser, write_section

SECTION = "## Gradient caching (bench/gradcache.py)"


def run_case(batch: int, chunk: int, steps: int, threads: int) -> dict:
    import torch

    torch.set_num_threads(threads)
    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    cfg = load_config(
        None,
        [
            f"train.global_batch_size={batch}",
            f"train.grad_cache_chunk_size={chunk}",
            "train.warmup_steps=0",
            f"train.steps={steps + 1}",
        ],
    )
    torch.manual_seed(0)
    engine = Engine(build_model(cfg.model), cfg)
    objective = build_objective(cfg)
    images = torch.randn(batch, 3, 32, 32)
    tokens = torch.randint(1, 49000, (batch, 32))
    tokens[:, 0], tokens[:, 20], tokens[:, 21:] = 49406, 49407, 0

    inputs = Batch(images, tokens)
    engine.step(inputs, objective)  # warm-up (allocator, DeepSpeed lazy init)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step(inputs, objective)
    step_s = (time.perf_counter() - start) / steps
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"batch": batch, "chunk": chunk, "step_s": step_s, "peak_rss_mb": peak_mb}


def child(args) -> None:
    if args.cap_gb:
        cap = int(args.cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        result = run_case(args.batch, args.chunk, args.steps, args.threads)
    except (MemoryError, RuntimeError) as e:
        result = {"batch": args.batch, "chunk": args.chunk, "error": type(e).__name__}
    print("RESULT " + json.dumps(result), flush=True)


def spawn(batch: int, chunk: int, steps: int, threads: int, cap_gb: float) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--batch",
        str(batch),
        "--chunk",
        str(chunk),
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--cap-gb",
        str(cap_gb),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return {
        "batch": batch,
        "chunk": chunk,
        "error": f"exit {proc.returncode} (did not fit in {cap_gb:g} GB?)",
    }


def table(rows: list[dict], base_rss: float) -> str:
    lines = [
        "| global batch | uncached step (s) | cached step (s) | time ratio | uncached peak RSS (MB) | "
        "cached peak RSS (MB) | cached RSS / uncached@256 |",
        "|---|---|---|---|---|---|---|",
    ]
    by_batch: dict[int, dict] = {}
    for r in rows:
        by_batch.setdefault(r["batch"], {})["cached" if r["chunk"] else "uncached"] = r

    def cell(r, key, fmt):
        if r is None:
            return "not run"
        return r["error"] if "error" in r else format(r[key], fmt)

    for batch in sorted(by_batch):
        u, c = by_batch[batch].get("uncached"), by_batch[batch].get("cached")
        ratio = (
            f"{c['step_s'] / u['step_s']:.2f}x" if u and c and "error" not in u and "error" not in c else "–"
        )
        rss_ratio = f"{c['peak_rss_mb'] / base_rss:.2f}x" if c and "error" not in c and base_rss else "–"
        lines.append(
            f"| {batch} | {cell(u, 'step_s', '.2f')} | {cell(c, 'step_s', '.2f')} | {ratio} | "
            f"{cell(u, 'peak_rss_mb', '.0f')} | {cell(c, 'peak_rss_mb', '.0f')} | {rss_ratio} |"
        )
    return "\n".join(lines)


def write_doc(text: str, watch: LoadWatch, allow_loaded: bool) -> None:
    write_section(DOC, text, watch, allow_loaded)


def main() -> None:
    p = parser(None, write_doc=None)
    p.add_argument("--child", action="store_true")
    p.add_argument("--batch", type=int)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cap-gb", type=float, default=0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--uncached-cap-gb", type=float, default=14.0)
    p.add_argument("--batches", help="comma-separated global batches (default 256,512,1024,2048,4096)")
    p.add_argument("--no-doc", action="store_true", help="print only; leave docs/benchmarks.md alone")
    args = p.parse_args()
    if args.child:
        return child(args)
    watch = LoadWatch()

    batches = (
        [int(b) for b in args.batches.split(",")]
        if args.batches
        else [256, 1024]
        if args.quick
        else [256, 512, 1024, 2048, 4096]
    )
    rows = []
    for batch in batches:
        for chunk in (0, 256):
            if chunk and batch == 256:
                chunk = 128  # caching a 256 batch in chunks of 256 is a no-op; show two chunks
            r = spawn(batch, chunk, args.steps, args.threads, args.uncached_cap_gb if not chunk else 0)
            print(r, flush=True)
            rows.append(r)
    base = next(
        (r["peak_rss_mb"] for r in rows if r["batch"] == 256 and not r["chunk"] and "error" not in r), 0
    )
    md = table(rows, base)
    print(md)
    cmd = "python bench/gradcache.py" + (" --quick" if args.quick else "")
    text = (
        f"{SECTION}\n\nCommand: `{cmd}` · {datetime.date.today()} · "
        f"{cpu_line(args.threads)} · tiny towers (ViT 4x128 @32px, text 4x128), "
        f"AdamW, fp32, DeepSpeed ZeRO-0, chunk 256 (128 at batch 256), mean of {args.steps} steps after one "
        f"warm-up step. Uncached cases run under a {args.uncached_cap_gb:g} GB address-space cap.\n\n{md}\n\n"
        "Targets: cached step time <= 1.4x uncached at the same batch; peak RSS at batch 4096 cached "
        "<= 1.3x the uncached batch-256 step.\n"
    )
    if not args.no_doc:
        write_doc(text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
