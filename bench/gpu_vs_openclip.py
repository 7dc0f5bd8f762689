"""mmalign's training step against an open_clip_train-equivalent loop, side by side on one GPU.

    python bench/gpu_vs_openclip.py              # on a CUDA machine: ~3-4 minutes (<= 5), writes docs/benchmarks.md
    python bench/gpu_vs_openclip.py --dry-run    # CPU-sized rehearsal of every arm (part of `make test`, ~15 s)

Setting (both tools alike): ViT-B-16, 77-token context, batch 256, random inputs already on the
device (full-length captions: nothing to trim, the same FLOPs), fp32 weights + bf16 autocast,
TF32 on, AdamW lr 1e-4, betas (0.9, 0.98), eps 1e-6, weight decay 0.2 with open_clip's no-decay
rule.  The arms (tool x mode; the steps are bench/gpu_step.py's):

- mmalign: ``Engine.step`` (the step bench/gpu_check.py times too): DeepSpeed ZeRO-0 fp32,
  ``train.precision=bf16`` (the engine enters the autocast), untiled InfoNCE; compiled =
  ``train.compile=true`` (the towers, in place);
- open_clip: open_clip_train's ``train_one_epoch`` step with ``--precision amp_bf16``:
  ``open_clip.create_model`` (random init), ``ClipLoss``, AdamW over its two parameter groups,
  the logit-scale clamp; compiled = ``torch.compile(model)`` (its ``--torchcompile``).

Order: mmalign eager, open_clip eager, mmalign eager, open_clip eager, then the same compiled
(each arm built once and compiled in its first warm-up; the eager pair freed first).  A turn:
3 warm-up + 10 timed steps (synchronize + perf_counter).  After an arm's last turn, one step
under torch.profiler (device kernels) and one under ``torch.cuda.set_sync_debug_mode("warn")``
(host syncs).  A failing arm prints a FAILED row and the others still run; ``--budget-s``
(default 285) skips turns that would end past it.

Without CUDA only ``--dry-run`` runs: micro towers (mmalign's preset, built as open_clip's CLIP
too), batch 16, 1 warm-up + 2 timed steps, compiled with ``aot_eager`` (dynamo's tracing, no C++
compiler), the table written only where ``--doc`` says.  A GPU run on a loaded host prints the
table, leaves the doc alone and exits 3 unless ``--allow-loaded`` (bench/idle.py); exit 1: an
arm FAILED.
"""

from __future__ import annotations

import datetime
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)
import torch

from bench.gpu_step import (
    BETAS,
    EPS,
    LR,
    WEIGHT_DECAY,
    MmalignStep,
    OpenClipStep,
    free_device_memory,
    mmalign_config,
    tf32_on,
)
from bench.harness import DOC, LoadWatch, command, device_line, parser, write_section

SECTION = "## GPU: mmalign vs open_clip_train (bench/gpu_vs_openclip.py)"
TOOLS = ("mmalign", "open_clip")
MODES = ("eager", "compiled")
SPEEDUP_GOAL, MFU_GOAL = 1.2, 0.40
COMPILE_GUESS_S = 60.0  # inductor, ViT-B-16 forward + backward, on an H100/H200 host (rough)
# CUDA runtime calls that block the host until the device catches up (an .item(), a host copy);
# cudaDeviceSynchronize is left out: the bench's own synchronize and the profiler's end issue it.
SYNC_CALLS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpy")


@dataclass(frozen=True)
class Sizes:
    preset: str
    batch: int
    warmup: int  # warm-up steps per turn (the first one compiles a compiled arm)
    steps: int  # timed steps per turn
    backend: str  # torch.compile backend of the compiled arms


GPU = Sizes("ViT-B-16", 256, 3, 10, "inductor")
DRY = Sizes("micro", 16, 1, 2, "aot_eager")


@dataclass
class Arm:
    tool: str
    mode: str
    sps: list = field(default_factory=list)  # samples/s, one per turn
    peak_gb: list = field(default_factory=list)  # peak memory above the turn's base, per turn
    dtypes: str = "?"
    kernels: str = "-"
    syncs: str = "-"
    seconds: float = 0.0  # build + turns + probes
    failed: str | None = None
    skipped: list = field(default_factory=list)
    step_s: float | None = None  # seconds per timed step, last turn (the budget's estimate)
    probed: bool = False
    graphs: list = field(default_factory=lambda: [0, 0])  # dynamo: graphs compiled, graph breaks (its turns)
    step: object = None  # the callable while alive

    @property
    def name(self) -> str:
        return f"{self.tool} {self.mode}"


def build(tool: str, mode: str, sizes: Sizes, device: torch.device):
    """One arm's step callable (``.dtypes``, ``.close()``) on its own fixed batch (full_captions, seed 0:
    the same draw for both tools)."""
    compiled = mode == "compiled"
    if tool == "mmalign":
        extra = ["train.compile=true", f"train.compile_backend={sizes.backend}"] if compiled else []
        return MmalignStep(
            mmalign_config(sizes.preset, sizes.batch, f"train.device={device.type}", *extra), device
        )
    return OpenClipStep(sizes.preset, sizes.batch, device, sizes.backend if compiled else None)


# ------------------------------------------------------------------ measurements


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_turn(arm: Arm, sizes: Sizes, device: torch.device) -> None:
    """Warm-up, then the timed steps: samples/s and the peak memory above the start (weights,
    optimiser state and whatever else is resident then)."""
    for _ in range(sizes.warmup):
        arm.step()
    _sync(device)
    base = 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    for _ in range(sizes.steps):
        arm.step()
    _sync(device)
    arm.step_s = (time.perf_counter() - t0) / sizes.steps
    arm.sps.append(sizes.batch / arm.step_s)
    if device.type == "cuda":
        arm.peak_gb.append((torch.cuda.max_memory_allocated(device) - base) / 1e9)


def kernels_per_step(step, device: torch.device) -> tuple[str, int | None]:
    """(device kernels of one step, the CUDA sync calls the profiler saw) on CUDA; on the CPU
    (a rehearsal of the same code) the top-level aten ops and None."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        step()
        _sync(device)  # the step's kernels finish inside the window
    events = prof.events()
    if not cuda:

        def top(e):
            p = e.cpu_parent
            while p is not None:
                if p.name.startswith("aten::"):
                    return False
                p = p.cpu_parent
            return True

        return f"{sum(1 for e in events if e.name.startswith('aten::') and top(e))} CPU ops", None
    device_events = [e for e in events if getattr(e, "device_type", None) == DeviceType.CUDA]
    kernels = sum(1 for e in device_events if not e.name.startswith(("Memcpy", "Memset")))
    syncs = sum(1 for e in events if e.name in SYNC_CALLS)
    return (str(kernels) if kernels else "? (no device events: CUPTI unavailable?)"), syncs


def host_syncs_per_step(step, device: torch.device) -> int | None:
    """Synchronising CUDA calls of one step, as torch's sync debug mode reports them (warnings;
    the autograd engine replays its threads' warnings in the caller's). None on the CPU."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    _sync(device)
    return sum(1 for w in got if "synchroniz" in str(w.message))


def probes(arm: Arm, device: torch.device) -> None:
    """Kernels and host syncs per step (one extra step each); a probe failure is noted, not fatal."""
    try:
        kernels, seen = kernels_per_step(arm.step, device)
        arm.kernels = kernels
    except Exception as e:  # the profiler, not the step, can fail (CUPTI in a container)
        arm.kernels, seen = f"? ({type(e).__name__})", None
    try:
        syncs = host_syncs_per_step(arm.step, device)
        arm.syncs = (
            "-" if syncs is None else f"{syncs}" + ("" if seen is None else f" (profiler: {seen} sync calls)")
        )
    except Exception as e:
        arm.syncs = f"? ({type(e).__name__})"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def run_phase(
    arms: list[Arm], sizes: Sizes, device: torch.device, turns: int, started: float, budget: float
) -> None:
    """``turns`` rounds over ``arms`` (A B A B ...), each arm built at its first turn; then all freed."""
    for turn in range(turns):
        for arm in arms:
            if arm.failed:
                continue
            t0 = time.perf_counter()
            # a turn that would end past the budget is skipped: its guess is the last turn's step time,
            # or for a compiled arm not built yet (on CUDA) a minute of inductor compilation
            guess = (
                arm.step_s * (sizes.warmup + sizes.steps + 2) + 5
                if arm.step_s is not None
                else COMPILE_GUESS_S
                if arm.mode == "compiled" and device.type == "cuda"
                else 0.0
            )
            run = t0 - started + guess <= budget
            if not run:
                arm.skipped.append(f"turn {turn + 1} skipped (time budget {budget:.0f} s)")
            dynamo0 = _dynamo_counts()
            try:
                if run and arm.step is None:
                    arm.step = build(arm.tool, arm.mode, sizes, device)
                if run:
                    timed_turn(arm, sizes, device)
                    arm.dtypes = arm.step.dtypes.describe()
                if (turn == turns - 1 or not run) and arm.sps and not arm.probed:
                    probes(arm, device)
                    arm.probed = True
            except Exception as e:  # one arm's failure (OOM, a compiler error) must not end the run
                traceback.print_exc()
                arm.failed = _first_line(e)
                _close(arm)
            arm.graphs = [a + b - c for a, b, c in zip(arm.graphs, _dynamo_counts(), dynamo0)]
            arm.seconds += time.perf_counter() - t0
            print(
                f"  [{arm.name}, turn {turn + 1}: {time.perf_counter() - t0:.0f} s, "
                f"{arm.sps[-1] if run and arm.sps and not arm.failed else 0:.1f} samples/s; whole run "
                f"{time.perf_counter() - started:.0f} s]",
                flush=True,
            )
    for arm in arms:
        _close(arm)


def _dynamo_counts() -> tuple[int, int]:
    """(graphs compiled, graph breaks) so far in this process, from dynamo's counters."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"]), int(sum(counters["graph_break"].values()))


def _close(arm: Arm) -> None:
    if arm.step is not None:
        try:
            arm.step.close()
        finally:
            arm.step = None
    free_device_memory()


# ------------------------------------------------------------------ the table


def _peak_tflops(device: torch.device) -> float | None:
    """The device's dense bf16 peak (mmalign.run.monitors), None where unknown (a CPU)."""
    from mmalign.run.monitors import peak_tflops

    try:
        try:
            return peak_tflops(device, 0.0, dtype="bf16")
        except TypeError:  # before monitors.peak_tflops took a dtype: its one peak is the bf16 one
            return peak_tflops(device, 0.0)
    except Exception as e:  # no MFU column is better than no table
        print(f"  peak TFLOP/s unknown ({_first_line(e)}): MFU not reported", flush=True)
        return None


def count_flops(sizes: Sizes, device: torch.device) -> float | None:
    """Training FLOPs per sample of the architecture (mmalign.run.monitors, on the device): the same
    number for both tools, whose towers are the same."""
    from mmalign.models import build_model
    from mmalign.run.monitors import train_flops_per_sample

    cfg = mmalign_config(sizes.preset, sizes.batch, f"train.device={device.type}")
    model = build_model(cfg.model).to(device)
    try:
        return train_flops_per_sample(model, model.image_size, model.context_length)
    finally:
        del model
        free_device_memory()


def _mean(xs: list) -> float | None:
    return statistics.mean(xs) if xs else None


def arm_row(arm: Arm, flops: float | None, peak: float | None) -> str:
    if arm.failed:
        return f"| {arm.tool} | {arm.mode} | FAILED: {arm.failed} | - | - | - | - | - | - | - |"
    if not arm.sps:
        why = "; ".join(arm.skipped) or "not run"
        return f"| {arm.tool} | {arm.mode} | SKIPPED ({why}) | - | - | - | - | - | - | - |"
    sps = _mean(arm.sps)
    tflops = None if flops is None else sps * flops / 1e12
    mfu = None if tflops is None or not peak else tflops / peak
    turns = ", ".join(f"{s:.1f}" for s in arm.sps)
    mem = f"{max(arm.peak_gb):.2f} GB" if arm.peak_gb else "-"
    note = f"{arm.seconds:.0f} s with build"
    if arm.mode == "compiled":
        note += f" and compile; dynamo: {arm.graphs[0]} graph(s), {arm.graphs[1]} graph break(s)"
    note = "; ".join([note, *arm.skipped])
    return (
        f"| {arm.tool} | {arm.mode} | {sps:.1f} ({turns}) | {_fmt(tflops, '.3g')} | "
        f"{'-' if mfu is None else f'{100 * mfu:.1f}%'} | {mem} | {arm.dtypes} | {arm.kernels} | {arm.syncs} | "
        f"{note} |"
    )


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _times(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


def comparison(arms: dict, flops: float | None, peak: float | None, cuda: bool) -> list[str]:
    """The ratios at equal settings, each tool's best, and the two goals (judged on a GPU only)."""

    def sps(tool, mode):
        a = arms.get((tool, mode))
        return _mean(a.sps) if a is not None and not a.failed else None

    def goal(ok: bool | None, what: str) -> str:
        if not cuda:
            return f"{what}: not judged (CPU dry run)"
        return f"{what}: {'not measured' if ok is None else ('met' if ok else 'not met')}"

    lines = [
        "| comparison | mmalign (samples/s) | open_clip (samples/s) | mmalign / open_clip | goal |",
        "|---|---|---|---|---|",
    ]
    for mode in MODES:
        m, o = sps("mmalign", mode), sps("open_clip", mode)
        r = m / o if m and o else None
        lines.append(
            f"| {mode} vs {mode} | {_fmt(m, '.1f')} | {_fmt(o, '.1f')} | {_times(r)} | "
            f"{goal(None if r is None else r >= SPEEDUP_GOAL, f'>= {SPEEDUP_GOAL}x')} |"
        )
    best = {t: max(((sps(t, md), md) for md in MODES if sps(t, md)), default=(None, None)) for t in TOOLS}
    (bm, mm), (bo, mo) = best["mmalign"], best["open_clip"]
    r = bm / bo if bm and bo else None
    lines.append(
        f"| best vs best | {_fmt(bm, '.1f')} ({mm or '-'}) | {_fmt(bo, '.1f')} ({mo or '-'}) | "
        f"{_times(r)} | - |"
    )
    mfu = None if bm is None or flops is None or not peak else bm * flops / 1e12 / peak
    what = f">= {100 * MFU_GOAL:.0f}% of the bf16 dense peak ({_fmt(peak, '.0f')} TFLOP/s)"
    lines.append(
        f"| mmalign MFU (best arm) | {'-' if mfu is None else f'{100 * mfu:.1f}%'} | - | - | "
        f"{goal(None if mfu is None else mfu >= MFU_GOAL, what)} |"
    )
    return lines


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, full=True, write_doc=None)
    p.add_argument("--dry-run", action="store_true", help="CPU-sized rehearsal (micro towers, batch 16)")
    p.add_argument(
        "--doc",
        type=Path,
        default=None,
        help="markdown file for the table (default: docs/benchmarks.md on a GPU, none on a dry run)",
    )
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--turns", type=int, default=2, help="turns per arm, alternating the tools")
    p.add_argument("--steps", type=int, default=None, help="timed steps per turn (default 10; dry run 2)")
    p.add_argument("--budget-s", type=float, default=285.0, help="skip later turns that would end past this")
    args = p.parse_args(argv)
    watch = LoadWatch()
    started = time.perf_counter()
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print(
            "bench/gpu_vs_openclip.py: no CUDA device; run with --dry-run for the CPU-sized rehearsal",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    sizes = GPU if cuda else DRY
    if args.steps:
        sizes = Sizes(sizes.preset, sizes.batch, sizes.warmup, max(1, args.steps), sizes.backend)
    doc = args.doc if args.doc is not None else (DOC if cuda else None)

    with tf32_on(device):  # both arms: TF32 for the fp32 matmuls autocast leaves (mmalign.run.tf32)
        flops = None
        try:
            flops = count_flops(sizes, device)
        except Exception as e:
            traceback.print_exc()
            print(f"  FLOP count failed ({_first_line(e)}): TFLOP/s and MFU not reported", flush=True)
        peak = _peak_tflops(device)
        print(
            f"  [set-up: {time.perf_counter() - started:.0f} s; {_fmt(flops and flops / 1e9, '.2f')} GFLOP per "
            f"training sample, peak {_fmt(peak, '.0f')} TFLOP/s]",
            flush=True,
        )
        arms: dict[tuple[str, str], Arm] = {}
        for mode in args.modes:
            phase = [Arm(tool, mode) for tool in TOOLS]
            arms.update({(a.tool, a.mode): a for a in phase})
            run_phase(phase, sizes, device, args.turns, started, args.budget_s)

    import deepspeed
    import open_clip

    where = device_line(device)
    cmd = command(argv, "gpu_vs_openclip.py")
    body = "\n".join(
        [
            SECTION,
            "",
            f"Command: `{cmd}`  ",
            f"Date: {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M UTC}; device: {where}; torch "
            f"{torch.__version__}, open_clip_torch {open_clip.__version__}, DeepSpeed {deepspeed.__version__}; whole run "
            f"{time.perf_counter() - started:.0f} s.  ",
            f"Setting: {sizes.preset}, batch {sizes.batch}, full-length captions, fp32 weights + bf16 autocast, TF32 "
            f"{'on' if cuda else 'on (a no-op on the CPU)'}, AdamW lr {LR:g} betas {BETAS} eps {EPS:g} wd "
            f"{WEIGHT_DECAY:g} (open_clip's no-decay groups); "
            f"{args.turns} turns per arm alternating the tools, {sizes.warmup} warm-up + {sizes.steps} timed steps "
            f"each; compiled = torch.compile ({sizes.backend}). FLOPs: "
            f"{_fmt(flops and flops / 1e9, '.3g')} GFLOP per training sample (mmalign.run.monitors, both tools); "
            f"MFU over {_fmt(peak, '.0f')} TFLOP/s (bf16 dense).",
            "",
            "| tool | mode | samples/s (per turn) | TFLOP/s | MFU | peak memory above base | tower output dtype "
            "(image / text) | kernels / step | host syncs / step | notes |",
            "|---|---|---|---|---|---|---|---|---|---|",
            *(arm_row(a, flops, peak) for a in arms.values()),
            "",
            *comparison(arms, flops, peak, cuda),
            "",
        ]
    )
    print(body, flush=True)
    if doc is not None:
        write_section(doc, body, watch, args.allow_loaded or args.dry_run)  # exit 3 when loaded (a GPU run)
        print(f"wrote {doc}", file=sys.stderr)
    return 1 if any(a.failed for a in arms.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
