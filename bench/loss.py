"""Peak memory and fwd+bwd time of the contrastive loss (a script, not a test).

Each measurement runs in a fresh subprocess, so ``ru_maxrss`` (the child's
peak resident set) belongs to that case alone. A baseline child that only
imports torch and creates the inputs gives the floor to subtract.

    .venv/bin/python bench/loss.py                 # full run, prints the table
    .venv/bin/python bench/loss.py --write-doc     # ... and updates docs/benchmarks.md

Cases: mmalign tiled (tile = TILE), mmalign untiled, open_clip
``ClipLoss``; B in {4096, 16384, 65536}, D = 256, float32, 2 torch threads.
Cases whose B x B activations would exceed ~20 GB are skipped. A tile-size
sweep at one batch size backs the choice of TILE (the tile to set as ``loss.tile_size``
for large batches on a CPU; the config's default stays 0, untiled).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, command, parser, write_section

# Tile edge tuned here on the 2-core CPU (docs/benchmarks.md): 1024-2048 are equally fast on a
# quiet machine; under load every tile op pays a thread-synchronisation cost, so fewer, larger
# tiles win, and 2048 is the largest that keeps B = 16384 under 1 GB peak RSS. On a GPU larger
# tiles (4096-8192) should amortise kernel launches better; not measured here.
TILE = 2048

SECTION = "## Loss memory and time (bench/loss.py)"
MEMORY_LIMIT_GB = 20.0
# Untiled autograd keeps about five B x B float32 buffers alive at the peak
# (logits, scaled logits, softmax / LSE outputs, their gradients).
UNTILED_BXB_BUFFERS = 5
IMPLS = ("mmalign_tiled", "mmalign_untiled", "open_clip")


# --------------------------------------------------------------- child side
def child(impl: str, b: int, d: int, tile: int, repeats: int, warmup: int, threads: int) -> dict:
    """Run one case; ``repeats = 0`` is the baseline: imports + inputs only."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(0)
    x = F.normalize(torch.randn(b, d, generator=gen), dim=1).requires_grad_()
    y = F.normalize(torch.randn(b, d, generator=gen), dim=1).requires_grad_()
    scale = torch.tensor(1 / 0.07).requires_grad_()
    if impl == "open_clip":
        from open_clip.loss import ClipLoss

        clip = ClipLoss()
        loss_fn = lambda: clip(x, y, scale)  # noqa: E731  (open_clip takes the exponentiated scale)
    else:
        from mmalign.losses import clip_loss

        t = tile if impl == "mmalign_tiled" else None
        loss_fn = lambda: clip_loss(x, y, scale, tile_size=t)  # noqa: E731

    fwd, total, cpu = [], [], []
    for i in range(warmup + repeats if repeats else 0):
        x.grad = y.grad = scale.grad = None
        c0 = time.process_time()  # CPU seconds of this process: less sensitive to other jobs
        t0 = time.perf_counter()
        loss = loss_fn()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            total.append(t2 - t0)
            cpu.append(time.process_time() - c0)
        del loss
    return {
        "maxrss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9,  # Linux: KiB
        "fwd_s": statistics.median(fwd) if fwd else None,
        "time_s": statistics.median(total) if total else None,
        "cpu_s": statistics.median(cpu) if cpu else None,
        "times": total,
    }


# -------------------------------------------------------------- parent side
def run_case(impl: str, b: int, args, baseline: bool = False) -> dict:
    if impl in ("mmalign_untiled", "open_clip") and not baseline:
        est_gb = UNTILED_BXB_BUFFERS * 4 * b * b / 1e9
        if est_gb > MEMORY_LIMIT_GB:
            return {"status": f"skipped (OOM: ~{est_gb:.0f} GB est.)"}
    repeats = 0 if baseline else 1 if b >= 65536 else args.repeats
    warmup = 0 if b >= 65536 or baseline else 1
    cmd = [
        sys.executable,
        __file__,
        "--child",
        impl,
        str(b),
        str(args.dim),
        str(args.tile_for.get(impl, args.tile)),
        str(repeats),
        str(warmup),
        str(args.threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"status": f"failed (rc {proc.returncode}): {proc.stderr.strip().splitlines()[-1:]}"}
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["status"] = "ok"
    out["repeats"] = repeats
    return out


def fmt(v, spec=".2f") -> str:
    return "-" if v is None else format(v, spec)


def main_table(args) -> tuple[str, list[dict]]:
    rows = []
    for b in args.sizes:
        for impl in IMPLS:
            # Baseline: the same child (same imports, same inputs) minus the loss.
            base = run_case(impl, b, args, baseline=True)
            res = run_case(impl, b, args)
            res.update(impl=impl, b=b, base_gb=base.get("maxrss_gb"))
            rows.append(res)
            print(
                f"  {impl:16s} B={b:6d} {res['status']:>10s} "
                f"rss={fmt(res.get('maxrss_gb'))} GB time={fmt(res.get('time_s'))} s",
                file=sys.stderr,
                flush=True,
            )
    lines = [
        "| implementation | B | tile | peak RSS (GB) | baseline RSS (GB) | peak - baseline (GB) | fwd (s) | fwd+bwd (s) | fwd+bwd CPU (s) | runs | status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        peak, base = r.get("maxrss_gb"), r.get("base_gb")
        extra = peak - base if peak is not None and base is not None else None
        tile = str(args.tile) if r["impl"] == "mmalign_tiled" else "-"
        lines.append(
            f"| {r['impl']} | {r['b']} | {tile} | {fmt(peak)} | {fmt(base)} | {fmt(extra)} | "
            f"{fmt(r.get('fwd_s'))} | {fmt(r.get('time_s'))} | {fmt(r.get('cpu_s'))} | "
            f"{r.get('repeats', '-')} | {r['status']} |"
        )
    return "\n".join(lines), rows


def sweep_table(args) -> str:
    lines = ["| tile | peak RSS (GB) | fwd+bwd (s) | fwd+bwd CPU (s) |", "|---:|---:|---:|---:|"]
    for t in args.sweep:
        res = run_case(
            "mmalign_tiled",
            args.sweep_b,
            argparse.Namespace(**{**vars(args), "tile_for": {"mmalign_tiled": t}}),
        )
        print(
            f"  sweep tile={t} rss={fmt(res.get('maxrss_gb'))} time={fmt(res.get('time_s'))}",
            file=sys.stderr,
            flush=True,
        )
        lines.append(
            f"| {t} | {fmt(res.get('maxrss_gb'))} | {fmt(res.get('time_s'))} | {fmt(res.get('cpu_s'))} |"
        )
    return "\n".join(lines)


def write_doc(body: str, watch: LoadWatch, allow_loaded: bool) -> None:
    write_section(DOC, f"{SECTION}\n\n{body.strip()}\n", watch, allow_loaded)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        impl, b, d, tile, repeats, warmup, threads = sys.argv[2], *map(int, sys.argv[3:9])
        print(json.dumps(child(impl, b, d, tile, repeats, warmup, threads)))
        return
    p = parser(__doc__, full=True, write_doc=f"write the results into {DOC.relative_to(ROOT)}")
    p.add_argument("--sizes", type=int, nargs="+", default=[4096, 16384, 65536])
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--tile", type=int, default=TILE)
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per case (after one warm-up); 1 at B >= 65536"
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--sweep", type=int, nargs="*", default=[512, 1024, 2048, 4096], help="tile sizes to sweep"
    )
    p.add_argument("--sweep-b", type=int, default=16384)
    p.add_argument("--note", default="", help="free text appended to the doc section")
    args = p.parse_args()
    args.tile_for = {}
    watch = LoadWatch()

    cmd = command()
    table, _ = main_table(args)
    sweep = sweep_table(args) if args.sweep else ""
    cpus = os.cpu_count()
    header = (
        f"Command: `{cmd}`  \n"
        f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}  \n"
        f"Machine: {cpus} CPU cores ({platform.processor() or platform.machine()}), torch threads = {args.threads}; "
        f"D = {args.dim}, float32, logit scale 1/0.07.  \n"
        f"Peak RSS is the child's `ru_maxrss`; each case's baseline is a child that makes the same imports "
        f"(torch, plus mmalign.losses or open_clip) and creates the inputs, then exits. "
        f"Times are the median wall-clock fwd+bwd of the timed runs (one warm-up first; a single cold run at "
        f"B = 65536); 'CPU' is the process CPU time of the same runs (2 threads, so ideally about 2x wall)."
    )
    body = f"{header}\n\n{table}\n"
    if sweep:
        body += f"\nTile-size sweep (mmalign tiled, B = {args.sweep_b}):\n\n{sweep}\n"
    if args.note:
        body += f"\n{args.note}\n"
    print(body)
    if args.write_doc:
        write_doc(body, watch, args.allow_loaded)
        print(f"wrote {DOC}", file=sys.stderr)


if __name__ == "__main__":
    main()
