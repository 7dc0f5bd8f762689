"""torch.compile of the towers (``train.compile``): step time against eager, and compile time.

Tiny towers (the `tiny` preset: ViT 4x128 @32px, text 4x128) through the real engine
(DeepSpeed ZeRO-0, fp32, AdamW, no gradient caching) on one batch repeated.  Each case runs in
its own process with an empty inductor cache (a warm on-disk cache would hide the compile
time).  The first step carries the compilation: it is reported apart, as the first step's time
less the eager first step's; the step time is the mean of ``--steps`` steps after
``--warmup`` further steps.

    .venv/bin/python bench/compile.py                 # prints the table and updates docs/benchmarks.md
    .venv/bin/python bench/compile.py --device cuda   # on a GPU (batch 256 there by default)
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, cpu_line, parser, write_section

SECTION = "## torch.compile of the towers (bench/compile.py)"


def run_case(backend: str, batch: int, steps: int, warmup: int, threads: int, device: str) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    compiled = backend != "eager"
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            f"train.global_batch_size={batch}",
            "train.warmup_steps=0",
            f"train.steps={steps + warmup + 1}",
            f"train.device={device}",
            f"train.compile={str(compiled).lower()}",
            f"train.compile_backend={backend}",
        ],
    )
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    engine = Engine(model, cfg)
    objective = build_objective(cfg)
    images = torch.randn(batch, 3, 32, 32)
    tokens = torch.randint(1, 49000, (batch, 32))
    tokens[:, 0], tokens[:, 20], tokens[:, 21:] = 49406, 49407, 0
    inputs = Batch(images, tokens).to(device)

    def step() -> float:
        start = time.perf_counter()
        engine.step(inputs, objective)
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    first = step()  # compiles the forward and the backward graphs when compiled
    for _ in range(warmup):
        step()
    times = [step() for _ in range(steps)]
    return {"backend": backend, "first_s": first, "step_s": sum(times) / len(times), "min_s": min(times)}


def spawn(backend: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        backend,
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
    ]
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, PYTHONPATH=str(ROOT), TORCHINDUCTOR_CACHE_DIR=cache)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return {"backend": backend, "error": f"exit {proc.returncode}: {tail[:120]}"}


def table(rows: list[dict]) -> str:
    eager = next((r for r in rows if r["backend"] == "eager" and "error" not in r), None)
    lines = [
        "| towers | step (s), mean | step (s), min | speed-up vs eager | first step (s) | compile time (s) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['backend']} | {r['error']} | | | | |")
            continue
        speed = f"{eager['step_s'] / r['step_s']:.2f}x" if eager else "–"
        comp = "–" if r["backend"] == "eager" or not eager else f"{r['first_s'] - eager['first_s']:.0f}"
        name = "eager" if r["backend"] == "eager" else f"compiled ({r['backend']})"
        lines.append(
            f"| {name} | {r['step_s']:.3f} | {r['min_s']:.3f} | {speed} | {r['first_s']:.1f} | {comp} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, write_doc=None)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--batch", type=int, default=0, help="global batch (default 64 on CPU, 256 on a GPU)")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="steps after the first (compiling) one, not timed")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--backends", default="eager,inductor")
    p.add_argument("--no-doc", action="store_true")
    p.add_argument("--child", default="")
    args = p.parse_args()
    args.batch = args.batch or (256 if args.device == "cuda" else 64)
    if args.child:
        result = run_case(args.child, args.batch, args.steps, args.warmup, args.threads, args.device)
        print("RESULT " + json.dumps(result), flush=True)
        return
    watch = LoadWatch()
    rows = []
    for backend in args.backends.split(","):
        rows.append(spawn(backend, args))
        print(rows[-1], flush=True)
    md = table(rows)
    print(md)
    if args.device == "cuda":
        import torch

        where = torch.cuda.get_device_name(0)
    else:
        where = cpu_line()
    heading = SECTION if args.device == "cpu" else SECTION.replace(")", ", GPU)")
    text = (
        f"{heading}\n\nCommand: `python bench/compile.py"
        f"{' --device cuda' if args.device == 'cuda' else ''}` · {datetime.date.today()} · {where} · "
        f"tiny towers (ViT 4x128 @32px, text 4x128), global batch {args.batch}, uncached, AdamW, fp32, "
        f"DeepSpeed ZeRO-0; `train.compile: true` compiles each tower's forward in place (the loss stays "
        f"eager). Step time: mean and min of {args.steps} steps after {args.warmup + 1} warm-up steps. "
        f"Compile time: the first step's time less eager's first step, cold inductor cache.\n\n{md}\n"
    )
    if not args.no_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
