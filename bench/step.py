"""One training step, profiled: where the time goes, fp32 against bf16, mmalign against a bare loop.

The tiny towers (``tiny`` preset: ViT 4x128 on 32 px, text 4x128) at local batch 256 (``--batch``) on the CPU,
through the real step: the loop's ``mmalign.run.train._train_step`` (next batch, ``Batch.to``, the
engine's guarded ``Engine.step`` with the run's objective, the objective's after-update), DeepSpeed
ZeRO-0, AdamW, no gradient caching, on one synthetic in-memory uint8 batch (so the data wait is the
loop's own cost of taking a ready batch; the loader's throughput is bench/loader.py's).

Modes, each in this one process:

- ``mmalign fp32`` / ``mmalign bf16``: ``train.precision`` fp32 / bf16 (autocast; fp32 weights);
- ``bare fp32`` / ``bare bf16``: a plain PyTorch loop over the same towers (forward under
  autocast, the naive CLIP loss written here in fp32, ``backward``, ``torch.optim.AdamW``), the
  ceiling the engine's bf16 should approach.

Two parts:

1. **Profile** (``torch.profiler``): after warm-up steps, ``--profile-steps`` steps of each mmalign
   mode; the time is split by ``record_function`` ranges the bench puts around the engine's and
   the objective's parts (towers forward, loss, stats, finite guard, backward, optimiser step,
   logit-scale clamp, the data wait and the host-to-device copy) and, inside DeepSpeed's backward
   and step, by the autograd and optimiser events the profiler records itself (what is left there
   is DeepSpeed's own bookkeeping).
2. **Throughput**: ``--rounds`` rounds; each round times ``--steps`` steps of every mode in turn
   (A/B alternation, so a neighbour's load falls on all modes alike).  Reported: the median
   samples/s of each mode and the median of the per-round ratios bf16/fp32, by wall time and
   by this process's CPU time.

    .venv/bin/python bench/step.py                          # prints both tables, writes docs/benchmarks.md ("after")
    .venv/bin/python bench/step.py --tree OTHER --label before   # the same bench against another mmalign tree
    .venv/bin/python bench/step.py --batch 32 --rounds 1 --no-doc   # a quick check of the script
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, parser, write_section

SECTION = "## Training step profile (bench/step.py)"
MODES = ("mmalign fp32", "mmalign bf16", "bare fp32", "bare bf16")
# profile rows, in this order; the ranges are named "step/<row>"
ROWS = (
    "data wait",
    "to device",
    "towers forward",
    "loss",
    "stats",
    "finite guard",
    "towers backward",
    "DeepSpeed backward bookkeeping",
    "optimizer",
    "DeepSpeed step bookkeeping",
    "logit-scale clamp",
    "after update",
    "other",
)


# ----------------------------------------------------------------- set-up


def _synthetic(batch: int, image_size: int, context: int):
    import torch

    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (batch, 3, image_size, image_size), dtype=torch.uint8, generator=g)
    tokens = torch.randint(1, 49000, (batch, context), generator=g)
    tokens[:, 0] = 49406
    ends = torch.randint(3, context - 1, (batch,), generator=g)
    for i, e in enumerate(ends.tolist()):
        tokens[i, e] = 49407
        tokens[i, e + 1 :] = 0
    return images, tokens


def _wrap(owner, name: str, label: str) -> None:
    """``owner.name`` (a method) run inside ``record_function(label)``."""
    import functools

    from torch.profiler import record_function

    real = getattr(owner, name)
    if getattr(real, "_bench_label", None):
        return

    @functools.wraps(real)
    def labelled(*args, **kwargs):
        with record_function(label):
            return real(*args, **kwargs)

    labelled._bench_label = label
    setattr(owner, name, labelled)


def _label_parts() -> None:
    """record_function ranges around the step's parts (class-level, bench-only: nothing in the
    package changes; each wrapper costs one profiler range, nothing when not profiling)."""
    from mmalign.objective import objective as objective_mod
    from mmalign.run import engine as engine_mod

    E = engine_mod.Engine
    _wrap(E, "encode", "step/towers forward")
    _wrap(E, "_all_finite", "step/finite guard")
    _wrap(E, "_backward", "step/backward")
    _wrap(E, "clamp_logit_scale", "step/logit-scale clamp")
    O = objective_mod.Objective
    _wrap(O, "__call__", "step/loss")
    _wrap(O, "_finish_stats", "step/stats")
    _wrap(O, "after_update", "step/after update")


class _Mmalign:
    """The loop's step function on a synthetic batch, under ``train.precision`` = ``precision``."""

    def __init__(self, precision: str, batch: int, threads: int):
        import torch

        from mmalign.config import load_config
        from mmalign.data.batch import Batch
        from mmalign.models import build_model
        from mmalign.objective import build_objective
        from mmalign.run import train as train_mod
        from mmalign.run.engine import Engine

        cfg = load_config(
            None,
            [
                "model.preset=tiny",
                f"train.global_batch_size={batch}",
                "train.warmup_steps=0",
                "train.steps=1000000",
                "train.device=cpu",
                f"train.precision={precision}",
                f"train.threads={threads}",
            ],
        )
        torch.manual_seed(0)
        model = build_model(cfg.model)
        self.engine = engine = Engine(model, cfg)
        _wrap(engine.ds, "step", "step/optimizer+DeepSpeed")  # the instance: DeepSpeed's own step
        objective = build_objective(cfg, model=None)
        dtype = {"bf16": torch.bfloat16}.get(precision)

        def autocast():
            return torch.autocast("cpu", dtype=dtype, enabled=dtype is not None)

        images, tokens = _synthetic(batch, model.image_size, model.context_length)
        self.host_batch = Batch(images, tokens)
        parts = dict(
            cfg=cfg,
            out=Path("."),
            device=torch.device("cpu"),
            world=1,
            model_flops=0.0,
            model_flops_unmasked=0.0,
            embed_dim=model.embed_dim,
            tokenizer=None,
            queue=None,
            engine=engine,
            loader=None,
            probe=None,
            objective=objective,
            autocast=autocast,
            peak=None,
        )
        names = getattr(train_mod._Parts, "__dataclass_fields__", parts)
        self.parts = train_mod._Parts(**{k: v for k, v in parts.items() if k in names})
        self.tally = train_mod._Tally()
        self.train_step = train_mod._train_step
        self.runlog = _NoLog()
        self.n = 0
        self.batch = batch
        engine.train_mode()

    def __iter__(self):
        return self

    def __next__(self):
        """The loop's ``next(batches)``: a ready in-memory batch (the loader's cost is not here)."""
        from torch.profiler import record_function

        with record_function("step/data wait"):
            return self.host_batch

    def step(self) -> None:
        self.n += 1
        self.train_step(self.parts, self.n, self, self.tally, self.runlog)


class _NoLog:
    def sample_keys(self, step, keys) -> None:
        pass


class _Bare:
    """The same towers in a plain loop: autocast forward, naive fp32 CLIP loss, backward, AdamW."""

    def __init__(self, precision: str, batch: int, threads: int):
        import torch

        from mmalign.config import load_config
        from mmalign.data.device import normalize_images
        from mmalign.models import build_model

        if threads:
            torch.set_num_threads(threads)
        cfg = load_config(None, ["model.preset=tiny"])
        torch.manual_seed(0)
        self.model = build_model(cfg.model)
        self.model.train()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, weight_decay=0.1)
        images, tokens = _synthetic(batch, self.model.image_size, self.model.context_length)
        self.images, self.tokens = normalize_images(images), tokens
        self.dtype = torch.bfloat16 if precision == "bf16" else None
        self.batch = batch

    def step(self) -> None:
        import torch
        import torch.nn.functional as F

        with torch.autocast("cpu", dtype=self.dtype or torch.bfloat16, enabled=self.dtype is not None):
            out = self.model(self.images, self.tokens)
        img, txt = out.image.float(), out.text.float()  # (B, D), (B, D)
        logits = out.logit_scale.float() * img @ txt.T  # (B, B)
        labels = torch.arange(img.shape[0])
        loss = (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))


def build(mode: str, batch: int, threads: int):
    kind, precision = mode.split()
    return (_Mmalign if kind == "mmalign" else _Bare)(precision, batch, threads)


# ------------------------------------------------------------------ profile


def _split(prof) -> dict[str, float]:
    """Seconds per row of ROWS summed over the profiled steps (CPU wall time of the main thread)."""
    events = [e for e in prof.events() if e.thread == _main_thread(prof)]
    out = dict.fromkeys(ROWS, 0.0)
    total = 0.0
    for e in events:
        if e.name == "step/one" and e.cpu_parent is None:
            total += e.cpu_time_total
    if not any(e.name.startswith("step/") and e.name != "step/one" for e in events):  # the bare loop
        out["other"] = total
        return {k: v / 1e6 for k, v in out.items()}
    labelled = 0.0

    def top(name: str) -> list:
        return [e for e in events if e.name == name and not _inside_label(e)]

    simple = {
        "step/data wait": "data wait",
        "step/towers forward": "towers forward",
        "step/loss": "loss",
        "step/finite guard": "finite guard",
        "step/logit-scale clamp": "logit-scale clamp",
        "step/after update": "after update",
        "step/to device": "to device",
    }
    for name, row in simple.items():
        for e in top(name):
            t = e.cpu_time_total
            if row == "loss":  # the stats are inside the objective's call
                stats = sum(s.cpu_time_total for s in _descendants(e) if s.name == "step/stats")
                t -= stats
                out["stats"] += stats
                labelled += stats
            out[row] += t
            labelled += t
    # DeepSpeed's backward and step: the autograd / optimiser events inside, the rest its bookkeeping
    for name, prefix, inner, rest in (
        ("step/backward", "autograd::engine", "towers backward", "DeepSpeed backward bookkeeping"),
        ("step/optimizer+DeepSpeed", "Optimizer.step#", "optimizer", "DeepSpeed step bookkeeping"),
    ):
        for e in top(name):
            part = sum(
                d.cpu_time_total
                for d in _descendants(e, stop=lambda x: x.name.startswith(prefix))
                if d.name.startswith(prefix)
            )
            out[inner] += part
            out[rest] += e.cpu_time_total - part
            labelled += e.cpu_time_total
    out["other"] = max(total - labelled, 0.0)
    return {k: v / 1e6 for k, v in out.items()}  # us -> s


def _main_thread(prof) -> int:
    for e in prof.events():
        if e.name == "step/one":
            return e.thread
    return 0


def _inside_label(e) -> bool:
    p = e.cpu_parent
    while p is not None:
        if p.name.startswith("step/") and p.name != "step/one":
            return True
        p = p.cpu_parent
    return False


def _descendants(e, stop=None):
    """Events below ``e``; below an event for which ``stop`` holds, nothing more is yielded."""
    for c in e.cpu_children:
        yield c
        if stop is None or not stop(c):
            yield from _descendants(c, stop)


def profile(runner, steps: int) -> dict[str, float]:
    from torch.profiler import ProfilerActivity, record_function
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            with record_function("step/one"):
                runner.step()
    split = {k: v / steps for k, v in _split(prof).items()}
    thread = _main_thread(prof)
    casts = [
        e
        for e in prof.events()
        if e.thread == thread
        and e.name == "aten::_to_copy"
        and not any(a.name == "aten::_to_copy" for a in _ancestors(e))
    ]
    split["_casts"] = (len(casts) / steps, sum(e.cpu_time_total for e in casts) / 1e6 / steps)
    return split


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


# --------------------------------------------------------------- throughput


def timed(runner, steps: int) -> tuple[float, float]:
    """(wall s, CPU s of this process) of ``steps`` steps."""
    t0, c0 = time.perf_counter(), _cpu()
    for _ in range(steps):
        runner.step()
    return time.perf_counter() - t0, _cpu() - c0


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def throughput(runners: dict, steps: int, rounds: int, batch: int) -> dict:
    """Per mode: lists of samples/s (wall and CPU) over the rounds, modes alternated inside each round."""
    res = {m: {"wall": [], "cpu": []} for m in runners}
    for r in range(rounds):
        order = list(runners) if r % 2 == 0 else list(reversed(list(runners)))  # ABBA: no mode always first
        for m in order:
            wall, cpu = timed(runners[m], steps)
            res[m]["wall"].append(steps * batch / wall)
            res[m]["cpu"].append(steps * batch / cpu)
        print(f"round {r + 1}: " + ", ".join(f"{m} {res[m]['wall'][-1]:.3g}/s" for m in runners), flush=True)
    return res


def ratio(res: dict, a: str, b: str, key: str) -> float:
    """Median over the rounds of samples/s of ``a`` over ``b`` (each round's pair taken side by side)."""
    return statistics.median(x / y for x, y in zip(res[a][key], res[b][key]))


# ------------------------------------------------------------------- tables


def casts_table(splits: dict[str, dict]) -> str:
    lines = [
        "| mode | profiled step (ms) | dtype casts (`aten::_to_copy`) per step | ms in them |",
        "|---|---|---|---|",
    ]
    for m, sp in splits.items():
        total = sum(v for k, v in sp.items() if k in ROWS)
        n, t = sp["_casts"]
        lines.append(f"| {m} | {total * 1e3:.1f} | {n:.0f} | {t * 1e3:.1f} |")
    return "\n".join(lines)


def profile_table(splits: dict[str, dict]) -> str:
    splits = {m: v for m, v in splits.items() if m.startswith("mmalign")}
    modes = list(splits)
    lines = [
        "| part of the step | "
        + " | ".join(f"{m} (ms)" for m in modes)
        + " | "
        + " | ".join(f"{m} (%)" for m in modes)
        + " |",
        "|---|" + "---|" * (2 * len(modes)),
    ]
    totals = {m: sum(v for k, v in splits[m].items() if k in ROWS) for m in modes}
    for row in ROWS:
        ms = " | ".join(f"{splits[m][row] * 1e3:.1f}" for m in modes)
        pct = " | ".join(f"{100 * splits[m][row] / totals[m]:.1f}" for m in modes)
        lines.append(f"| {row} | {ms} | {pct} |")
    lines.append(
        "| **step** | "
        + " | ".join(f"**{totals[m] * 1e3:.1f}**" for m in modes)
        + " | "
        + " | ".join("100" for _ in modes)
        + " |"
    )
    return "\n".join(lines)


def throughput_table(res: dict) -> str:
    lines = [
        "| mode | samples/s (wall), median | samples/s (CPU time), median | bf16 / fp32 (wall) | "
        "bf16 / fp32 (CPU time) |",
        "|---|---|---|---|---|",
    ]
    for m in res:
        kind, precision = m.split()
        if precision == "bf16" and f"{kind} fp32" in res:
            rw, rc = ratio(res, m, f"{kind} fp32", "wall"), ratio(res, m, f"{kind} fp32", "cpu")
            rel = f"**{rw:.2f}x** | {rc:.2f}x"
        else:
            rel = "– | –"
        lines.append(
            f"| {m} | {statistics.median(res[m]['wall']):.3g} | {statistics.median(res[m]['cpu']):.3g} "
            f"| {rel} |"
        )
    if "mmalign fp32" in res and "bare fp32" in res:
        lines.append("")
        lines.append(
            "mmalign / bare loop (wall, median of the rounds): fp32 "
            f"{ratio(res, 'mmalign fp32', 'bare fp32', 'wall'):.2f}x"
            + (f", bf16 {ratio(res, 'mmalign bf16', 'bare bf16', 'wall'):.2f}x" if "bare bf16" in res else "")
        )
    return "\n".join(lines)


def _tree_commit(tree: Path) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(tree), "log", "-1", "--format=%h %s"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        return out[:60] or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def write_doc(label: str, body: str, watch: LoadWatch, allow_loaded: bool) -> None:
    """This label's subsection of the step-profile section (the other label's kept), through the
    idle guard: refused (exit 3) when the machine was loaded, unless ``allow_loaded``."""
    doc = DOC
    watch.stop()  # the note of this label's subsection reads the end load
    current = doc.read_text() if doc.is_file() else ""
    start = current.find(SECTION + "\n")
    old = ""
    if start >= 0:
        nxt = current.find("\n## ", start + len(SECTION))
        old = current[start : nxt if nxt >= 0 else len(current)]
    subs = {}
    for name in ("before", "after"):
        head = f"### {name}"
        i = old.find(head)
        if i >= 0:
            j = old.find("\n### ", i + len(head))
            subs[name] = old[i : j if j >= 0 else len(old)].strip("\n")
    subs[label] = f"### {label}\n\n{watch.note()}\n\n{body}".strip("\n")
    intro = (
        f"{SECTION}\n\nCommand: `python bench/step.py` (`--tree DIR --label before` runs it against another "
        "checkout). Tiny towers (ViT 4x128 @32px, text 4x128), one synthetic in-memory batch, "
        "DeepSpeed ZeRO-0 fp32 weights, AdamW, no gradient caching, through the loop's step function "
        "(`mmalign.run.train._train_step`). `mmalign bf16` is `train.precision: bf16` (autocast); `bare` is a "
        "plain PyTorch loop over the same towers (autocast forward, naive fp32 CLIP loss, backward, AdamW). "
        "Profile: torch.profiler, ms per step of the main thread (towers backward = the autograd events "
        "inside DeepSpeed's backward; optimizer = `Optimizer.step` inside DeepSpeed's step; the rest of "
        "either is DeepSpeed's bookkeeping). Throughput: every mode in turn in each round (ABBA), "
        "medians over the rounds; the ratio is the median of the per-round ratios. bf16 pays only where "
        "the CPU multiplies bf16 natively (avx512_bf16 or AMX; a GPU): on an AVX2-only CPU oneDNN converts, "
        "a bf16 matmul is several times slower than fp32 and so is every bf16 loop, the bare one too; each "
        "table's last line (one bare matmul, bf16 over fp32) says which case it was taken in. bf16 quality at "
        "equal steps (not yet run here): `mmalign train --config configs/cifar10_cpu.yaml --set "
        "train.precision=P --set output=runs/cifar10_P` for P in fp32 and bf16, then compare the zero-shot "
        "top-1 in the two `eval.json` (target: within 1 point).\n"
    )
    text = intro + "".join(f"\n{subs[n]}\n" for n in ("before", "after") if n in subs)
    write_section(doc, text, watch, allow_loaded, note=False)  # refuses (exit 3) when loaded
    print(f"wrote the '{label}' table of docs/benchmarks.md", flush=True)


def matmul_ratio(reps: int = 5) -> float:
    """bf16 over fp32 matmul throughput on this CPU (CPU time), at the towers' shape: the
    (B x 65 tokens, 128) @ (128, 512) MLP input projection at batch 256, alternated."""
    import torch

    x, w = torch.randn(256 * 65, 128), torch.randn(512, 128)
    pairs = {torch.float32: (x, w), torch.bfloat16: (x.bfloat16(), w.bfloat16())}
    spent = {dt: [] for dt in pairs}
    for _ in range(reps):
        for dt, (a, b) in pairs.items():
            c0 = _cpu()
            for _ in range(3):
                a @ b.T
            spent[dt].append(_cpu() - c0)
    return statistics.median(f / b for f, b in zip(spent[torch.float32], spent[torch.bfloat16]))


def _has_cpu_flag(flag: str) -> bool:
    """Whether /proc/cpuinfo lists ``flag`` (bf16 matmuls are native only with avx512_bf16 / AMX;
    without them oneDNN converts, and bf16 is slower than fp32)."""
    try:
        return flag in Path("/proc/cpuinfo").read_text(errors="ignore").split()
    except OSError:
        return False


# --------------------------------------------------------------------- main


def main() -> None:
    p = parser(__doc__, write_doc=None)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=3, help="timed steps per mode per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--profile-steps", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--tree", default=str(ROOT), help="the mmalign checkout to import (default: this one)")
    p.add_argument("--label", default="after", choices=["before", "after"], help="the doc table to write")
    p.add_argument("--no-doc", action="store_true")
    args = p.parse_args()
    watch = LoadWatch()
    tree = Path(args.tree).resolve()
    _bootstrap.put_first(tree)  # mmalign from --tree, not from this checkout
    import torch

    import mmalign

    if Path(mmalign.__file__).resolve().parents[1] != tree:
        raise SystemExit(f"mmalign imported from {mmalign.__file__}, not from --tree {tree}")
    if args.threads:
        torch.set_num_threads(args.threads)
    _label_parts()
    from torch.profiler import record_function

    from mmalign.data.batch import Batch

    real_to = Batch.to

    def labelled_to(self, device):
        with record_function("step/to device"):
            return real_to(self, device)

    Batch.to = labelled_to
    modes = args.modes.split(",")
    runners = {m: build(m, args.batch, args.threads) for m in modes}
    for _m, r in runners.items():
        for _ in range(args.warmup):
            r.step()
    splits = {m: profile(r, args.profile_steps) for m, r in runners.items()}
    res = throughput(runners, args.steps, args.rounds, args.batch)
    prof_md, thr_md = profile_table(splits) + "\n\n" + casts_table(splits), throughput_table(res)
    thr_md += (
        f"\n\nbf16 / fp32 throughput of one bare matmul at the towers' shape (CPU time, median of 5): "
        f"{matmul_ratio():.2f}x"
    )
    where = (
        f"{platform.machine()}, {os.cpu_count()} CPU cores ({torch.backends.cpu.get_cpu_capability()}, "
        f"avx512_bf16: {'yes' if _has_cpu_flag('avx512_bf16') else 'no'}, amx_bf16: "
        f"{'yes' if _has_cpu_flag('amx_bf16') else 'no'}), torch {torch.__version__}"
    )
    print(prof_md)
    print()
    print(thr_md)
    body = (
        f"{datetime.date.today()} · {where} · mmalign at `{_tree_commit(tree)}` · batch {args.batch}, "
        f"{args.profile_steps} profiled steps after {args.warmup} warm-up steps, {args.rounds} rounds of "
        f"{args.steps} steps per mode.\n\n{prof_md}\n\n{thr_md}\n"
    )
    if not args.no_doc:
        write_doc(args.label, body, watch, args.allow_loaded)
    else:
        watch.stop()
        print(f"({watch.describe()})")


if __name__ == "__main__":
    main()
