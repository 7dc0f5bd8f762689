"""The one-GPU check: what only a GPU can tell us, in one short run (a script, not a test).

    python bench/gpu_check.py                 # on a CUDA machine: ~5 minutes, writes docs/benchmarks.md
    python bench/gpu_check.py --dry-run       # CPU-sized rehearsal of every part (part of `make test`)

Parts, each a row group of one table:

1. the ``-m gpu`` tests (pytest, in a child process);
2. bf16 weights under gradient caching: the relative gradient error of a cached
   step (16 chunks) with bf16 weights against the fp32 uncached full-batch
   gradient, with DeepSpeed accumulating the chunks in bf16 (its default, the
   weight dtype) and in fp32 (what mmalign now asks for);
3. the contrastive loss of one rank's 1024 rows against 65536 global columns
   (64 ranks x 1024), untiled and tiled: fwd+bwd time and peak memory;
4. training-step throughput of the GPU recipe's setting (fp32 weights + bf16
   autocast, ZeRO-1, TF32 on) with and without gradient caching: bench/gpu_step.py's
   ``Engine.step``, the step bench/gpu_vs_openclip.py compares with open_clip's, and the
   dtype the towers really produced (bf16 unless the autocast was lost).

A CUDA device is required unless ``--dry-run`` is given; the dry run uses the
micro preset and small sizes on the CPU and writes its table only where
``--doc`` says, so the script cannot rot before a GPU runs it.  A GPU run on a
loaded host leaves the doc alone and exits 3 unless ``--allow-loaded`` (bench/idle.py);
a dry run is a rehearsal, not a measurement, and always writes (its table says the load).
"""

from __future__ import annotations

import datetime
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)
import torch
import torch.nn.functional as F

from bench.harness import DOC, ROOT, LoadWatch, command, device_line, parser, write_section

SECTION = "## GPU check (bench/gpu_check.py)"


@dataclass(frozen=True)
class Sizes:
    preset: str  # the towers of parts 2 and 4
    batch: int  # local batch of parts 2 and 4
    grad_chunks: int  # chunks of the bf16 accumulation comparison
    step_chunk: int  # gradient-cache chunk of the cached throughput row
    loss_rows: int  # part 3: one rank's rows ...
    loss_cols: int  # ... against the global batch's columns
    loss_dim: int
    loss_tile: int
    steps: int  # timed steps per throughput row (after warm-up)


GPU = Sizes("ViT-B-16", 256, 16, 64, 1024, 65536, 512, 4096, 8)
DRY = Sizes("micro", 32, 16, 8, 64, 1024, 32, 256, 2)


# ------------------------------------------------------------------ helpers


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device)


def _peak_gb(device: torch.device, base: int) -> float | None:
    if device.type != "cuda":
        return None  # the CPU has no per-call peak counter worth reporting here
    return (torch.cuda.max_memory_allocated(device) - base) / 1e9


def _engine_cfg(sizes: Sizes, *overrides: str):
    from mmalign.config import load_config

    return load_config(
        None,
        [
            f"model.preset={sizes.preset}",
            f"train.global_batch_size={sizes.batch}",
            "train.warmup_steps=0",
            "train.steps=1000",
            "train.optimizer=sgd",
            "train.lr=1e-4",
            "train.weight_decay=0.0",
            *overrides,
        ],
    )


def _fmt(v, spec=".3g") -> str:
    return "-" if v is None else format(v, spec)


# -------------------------------------------------------------------- parts


def part_gpu_tests(dry_run: bool) -> list[tuple[str, str, str]]:
    """Run the -m gpu tests in a child process; one row with its summary line."""
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/run/test_gpu.py",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.strip().splitlines() if ln.strip()]
    summary = lines[-1].strip("= ") if lines else f"no output (rc {proc.returncode})"
    if proc.returncode not in (0, 5):
        print(proc.stdout[-4000:], proc.stderr[-2000:], file=sys.stderr)
    ok = proc.returncode == 0 or (dry_run and proc.returncode == 5)
    return [
        (
            "gpu tests",
            "pytest -m gpu tests/run/test_gpu.py",
            f"{summary} ({time.perf_counter() - t0:.0f} s){'' if ok else ' FAILED'}",
        )
    ]


def part_bf16_accumulation(sizes: Sizes, device: torch.device) -> list[tuple[str, str, str]]:
    """bench/bf16_accum.py's measurement at this size: a 16-chunk cached step with bf16
    weights (ZeRO-1), DeepSpeed's defaults ("before") vs what mmalign asks for ("after")."""
    from bench.bf16_accum import measure

    chunk = sizes.batch // sizes.grad_chunks
    results = measure(sizes.preset, chunk, sizes.grad_chunks, 1, 0, device.type)
    rows = []
    for label, r in results.items():
        rows.append(
            (
                "bf16 accumulation",
                f"{label}: accumulate {r['accum']}, reduce {r['comm']} ({r['optimizer']}); {sizes.preset}, "
                f"{sizes.grad_chunks} chunks x {chunk}, ZeRO-1",
                f"rel. grad error vs fp32 one pass {r['fp32']:.3g}; vs exact sum of the bf16 chunk grads "
                f"{r['exact_sum']:.3g}",
            )
        )
    return rows


def part_loss(sizes: Sizes, device: torch.device) -> list[tuple[str, str, str]]:
    """One rank's rows against the global columns: untiled vs tiled fwd+bwd."""
    from mmalign.losses.infonce import infonce_local

    g = torch.Generator().manual_seed(0)
    b, n, d = sizes.loss_rows, sizes.loss_cols, sizes.loss_dim
    img_all = F.normalize(torch.randn(n, d, generator=g), dim=1).to(device)
    txt_all = F.normalize(torch.randn(n, d, generator=g), dim=1).to(device)
    scale = torch.tensor([1 / 0.07], device=device)
    rows = []
    for name, tile in (("untiled", None), ("tiled", sizes.loss_tile)):
        times, peak = [], None
        for rep in range(3):
            leaves = [t.clone().requires_grad_(True) for t in (img_all, txt_all, scale)]
            ia, ta, s = leaves
            base = _reset_peak(device)
            _sync(device)
            t0 = time.perf_counter()
            loss, _, _ = infonce_local(ia[:b], ta[:b], ia, ta, s, tile_size=tile)
            loss.backward()
            _sync(device)
            if rep:  # the first run warms up kernels and the allocator
                times.append(time.perf_counter() - t0)
            peak = _peak_gb(device, base)
            del loss, leaves, ia, ta, s
        label = f"{name}{'' if tile is None else f' (tile {tile})'}: {b} x {n}, D={d}"
        rows.append(("loss", label, f"{min(times) * 1e3:.1f} ms fwd+bwd, peak {_fmt(peak)} GB"))
    return rows


def part_throughput(sizes: Sizes, device: torch.device) -> list[tuple[str, str, str]]:
    """Samples/s of full steps (fp32 weights, bf16 autocast, ZeRO-1, TF32 on), uncached and cached:
    bench/gpu_step.py's step, the one bench/gpu_vs_openclip.py times against open_clip."""
    from bench.gpu_step import MmalignStep, tf32_on
    from tests.harness import clip_batch

    def inputs(n, size, context):  # this check's batch: captions of random lengths (padding trimmed)
        return tuple(t.to(device) for t in clip_batch(n, 0, size, context))

    rows = []
    for chunk in (0, sizes.step_chunk):
        cfg = _engine_cfg(
            sizes,
            f"train.grad_cache_chunk_size={chunk}",
            "deepspeed.zero_stage=1",
            "train.precision=bf16",
            "train.optimizer=adamw",
            "loss.tile_size=0",
        )
        with tf32_on(device):  # train.tf32's default; restored after, so the other parts stay exact fp32
            step = MmalignStep(cfg, device, inputs)  # the engine enters train.precision's autocast itself
            for _ in range(2):
                step()
            base = _reset_peak(device)
            _sync(device)
            t0 = time.perf_counter()
            for _ in range(sizes.steps):
                step()
            _sync(device)
            sps = sizes.steps * sizes.batch / (time.perf_counter() - t0)
        label = f"{sizes.preset}, batch {sizes.batch}, " + (
            "uncached" if not chunk else f"cached, chunk {chunk}"
        )
        rows.append(
            (
                "step",
                label,
                f"{sps:.1f} samples/s, peak {_fmt(_peak_gb(device, base))} GB, "
                f"tower outputs {step.dtypes.describe()} (image / text)",
            )
        )
        step.close()
        del step
    return rows


# --------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, full=True, write_doc=None)
    p.add_argument("--dry-run", action="store_true", help="CPU-sized rehearsal (micro preset, small sizes)")
    p.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="markdown file for the table (default: docs/benchmarks.md on a GPU, none on a dry run)",
    )
    p.add_argument(
        "--parts",
        nargs="+",
        default=["tests", "bf16", "loss", "step"],
        choices=["tests", "bf16", "loss", "step"],
    )
    args = p.parse_args(argv)
    watch = LoadWatch()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print(
            "bench/gpu_check.py: no CUDA device; run with --dry-run for the CPU-sized rehearsal",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    sizes = GPU if cuda else DRY
    doc = args.doc if args.doc is not None else (DOC if cuda else None)
    started = time.perf_counter()
    rows: list[tuple[str, str, str]] = []
    parts = {
        "tests": lambda: part_gpu_tests(args.dry_run),
        "bf16": lambda: part_bf16_accumulation(sizes, device),
        "loss": lambda: part_loss(sizes, device),
        "step": lambda: part_throughput(sizes, device),
    }
    for name in args.parts:
        t0 = time.perf_counter()
        try:
            got = parts[name]()
        except Exception as e:  # one broken part must not hide the others' figures
            traceback.print_exc()
            got = [
                (
                    name,
                    "error",
                    f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''} FAILED",
                )
            ]
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.extend(got)
        for r in got:
            print(f"  {r[0]:18s} {r[1]:70s} {r[2]}", flush=True)
        print(f"  [{name}: {time.perf_counter() - t0:.0f} s]", flush=True)

    import deepspeed  # noqa: F401  (already imported by the engine; for its version only)

    where = device_line(device)
    cmd = command(argv, "gpu_check.py")
    body = "\n".join(
        [
            SECTION,
            "",
            f"Command: `{cmd}`  ",
            f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}; device: {where}; "
            f"torch {torch.__version__}, DeepSpeed {deepspeed.__version__}; whole run {time.perf_counter() - started:.0f} s.",
            "",
            "| part | case | result |",
            "|---|---|---|",
            *(f"| {a} | {b} | {c} |" for a, b, c in rows),
            "",
        ]
    )
    print(body)
    if doc is not None:
        write_section(doc, body, watch, args.allow_loaded or args.dry_run)
        print(f"wrote {doc}", file=sys.stderr)
    failed = any(r[2].endswith("FAILED") for r in rows)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
