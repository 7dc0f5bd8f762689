"""``mmalign curate``'s cost: embedding throughput per CPU core, and the de-duplication step's
peak memory on a 1M-sample pool.

1. **Throughput** (pass 1, :class:`data_pipelines.curate.embed_pass.ShardEmbedder`, what
   ``mmalign curate`` runs per shard): synthetic 256 x 256 JPEG shards (random noise
   images, one caption each) embedded at 224 px by ViT-B-16 (open_clip's architecture,
   random weights: the cost does not depend on them) and by the tiny towers at their own
   32 px. Reported: samples/s of one process and samples/s per torch thread.
2. **De-duplication memory** (pass 2, :func:`data_pipelines.curate.decide.decide` with
   ``--keep-fraction 0.3 --dedupe exact,semantic``): a pool of ``--pool`` synthetic 512-d
   float16 embeddings (Gaussian directions, 1% of rows planted as near-copies of others),
   with keys, scores and sha256 hex digests as pass 1 stores them. Each measured in a fresh
   subprocess: the peak RSS during the step (VmHWM, reset just before it) and that minus the
   RSS before it (the pool's arrays are held already, as pass 1 leaves them), its wall time, plus
   whether the planted copies were found.

    python bench/curate_speed.py --write-doc            # ~10 min on 2 cores
    python bench/curate_speed.py --quick                # seconds
"""

from __future__ import annotations

import argparse
import datetime
import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)
import numpy as np

from bench.harness import (
    DOC,
    ROOT,
    LoadWatch,
    command,
    cpu_line,
    parser,
    reset_peak,
    status_mb,
    write_section,
)

SECTION = "## mmalign curate: throughput and de-duplication memory (bench/curate_speed.py)"


def _shard(path: Path, n: int, size: int, seed: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(
                buf, format="JPEG", quality=90
            )
            for ext, data in (("jpg", buf.getvalue()), ("txt", f"a photo of thing number {i}".encode())):
                info = tarfile.TarInfo(f"{i:09d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def throughput(work: Path, preset: str, n: int, batch: int) -> dict:
    import torch

    from data_pipelines.curate.embed_pass import ShardEmbedder
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained
    from mmalign.models.load import load

    model_dir = work / f"model_{preset}"
    if not (model_dir / "model.safetensors").is_file():
        torch.manual_seed(0)
        model = build_model(ModelConfig(preset=preset))
        save_pretrained(model, model_dir, preprocess=preprocess_cfg(model.image_size))
    loaded = load(model_dir)
    shard = work / f"speed_{n}.tar"
    if not shard.is_file():
        _shard(shard, n, 256, 0)
    embedder = ShardEmbedder(loaded, batch_size=batch)
    out = work / f"out_{preset}"
    embedder.embed(str(shard), 0, out)  # warm-up (first calls allocate)
    start, cpu0 = time.perf_counter(), time.process_time()
    stats = embedder.embed(str(shard), 0, out)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
    threads = torch.get_num_threads()
    return {
        "preset": preset,
        "image_size": loaded.model.image_size,
        "samples": stats["readable"],
        "seconds": round(seconds, 2),
        "samples_per_s": stats["readable"] / seconds,
        "threads": threads,
        "per_thread": stats["readable"] / seconds / threads,
        "cpu_seconds": round(cpu, 2),
        "per_cpu_second": stats["readable"] / cpu,
    }


def dedupe_memory(n: int, dim: int, seed: int) -> dict:
    """One process, one step: the pool arrays as pass 1 leaves them, then decide()."""
    import pandas as pd

    from data_pipelines.curate.decide import Policies, Pool, decide

    rng = np.random.default_rng(seed)
    image = np.empty((n, dim), dtype=np.float16)  # (N, D): what pass 1 stores
    for s in range(0, n, 65536):  # made in blocks: the synthetic data's own peak stays small
        block = rng.standard_normal((min(65536, n - s), dim), dtype=np.float32)
        image[s : s + block.shape[0]] = block / np.linalg.norm(block, axis=1, keepdims=True)
    planted = rng.choice(n, size=n // 100, replace=False)
    sources = rng.choice(np.setdiff1d(np.arange(n), planted), size=planted.size, replace=False)
    near = image[sources].astype(np.float32) + 0.05 / np.sqrt(dim) * rng.standard_normal(
        (planted.size, dim), dtype=np.float32
    )
    image[planted] = near / np.linalg.norm(near, axis=1, keepdims=True)
    frame = pd.DataFrame(
        {
            "key": [f"{i:09d}" for i in range(n)],
            "clip_score": rng.uniform(0, 0.4, n).astype(np.float32),
            "image_sha256": [f"{i:064x}" for i in range(n)],
        }
    )
    before = reset_peak()  # RSS once the set-up's freed memory is handed back; VmHWM from here
    start = time.perf_counter()
    dec = decide(
        Pool(frame=frame, image=image),
        Policies(keep_fraction=0.3, dedupe=("exact", "semantic"), dedupe_eps=0.05),
    )
    seconds = time.perf_counter() - start
    groups = dec.groups["semantic"]
    found = float(np.mean(groups[planted] == groups[sources]))
    return {
        "pool": n,
        "dim": dim,
        "clusters": dec.clusters,
        "seconds": round(seconds, 1),
        "rss_before_mb": round(before),
        "peak_rss_mb": round(status_mb("VmHWM")),
        "step_mb": round(status_mb("VmHWM") - before),
        "embeddings_mb": round(image.nbytes / 2**20),
        "planted_found": found,
        "kept": int(dec.keep.sum()),
    }


def main() -> None:
    p = parser(__doc__, write_doc="")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pool", type=int, default=1_000_000, help="synthetic pool for the memory part")
    p.add_argument("--samples", type=int, default=256, help="images per throughput run")
    p.add_argument("--work", default=str(ROOT / "data" / "bench_curate_speed"))
    p.add_argument(
        "--parts",
        default="throughput,memory",
        help="throughput and/or memory; a part not run is taken from WORK/results.json (an earlier run)",
    )
    p.add_argument("--_memory", type=int, help=argparse.SUPPRESS)  # the subprocess of part 2
    args = p.parse_args()
    if args._memory:
        print(json.dumps(dedupe_memory(args._memory, 512, 0)))
        return
    watch = LoadWatch()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    parts = {x.strip() for x in args.parts.split(",") if x.strip()}
    saved_file = work / "results.json"
    saved = json.loads(saved_file.read_text()) if saved_file.is_file() else {}
    load_note = f"load {watch.start:.1f} at the start of this run"
    if "throughput" in parts:
        n_img = 32 if args.quick else args.samples
        rows = [throughput(work, "tiny", n_img, 64)]
        print(rows[-1], flush=True)
        rows.append(throughput(work, "ViT-B-16", 8 if args.quick else min(n_img, 64), 32))
        print(rows[-1], flush=True)
        saved["throughput"] = {"rows": rows, "note": load_note}
    if "memory" in parts:
        pools = [20_000] if args.quick else [100_000, args.pool]
        mem = []
        for n in pools:
            proc = subprocess.run(
                [sys.executable, __file__, "--_memory", str(n)], capture_output=True, text=True
            )
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])
            mem.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(mem[-1], flush=True)
        saved["memory"] = {"rows": mem, "note": load_note}
    saved_file.write_text(json.dumps(saved, indent=1))
    if "throughput" not in saved or "memory" not in saved:
        return
    rows, mem = saved["throughput"]["rows"], saved["memory"]["rows"]
    import torch

    cmd = command()
    env = f"{datetime.date.today().isoformat()} · {cpu_line()}, torch {torch.__version__}, fp32"
    lines = [
        SECTION,
        "",
        f"Command: `{cmd}` · {env}",
        "",
        "**Embedding (pass 1)**: one process, synthetic 256 px JPEGs decoded, resized and embedded with "
        f"one caption each (random weights; the cost does not depend on them); {saved['throughput']['note']}.",
        "",
        "| towers | input | samples | samples/s (wall) | torch threads | samples per CPU-second (per core) |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['preset']} | {r['image_size']} px | {r['samples']} | {r['samples_per_s']:.1f} | "
            f"{r['threads']} | {r['per_cpu_second']:.1f} |"
        )
    lines += [
        "",
        "Samples per CPU-second (this process's CPU time) is what one free core gives; the wall rate "
        "also counts waiting for the cores when other jobs share them.",
    ]
    lines += [
        "",
        "**De-duplication (pass 2)**: `--keep-fraction 0.3 --dedupe exact,semantic --dedupe-eps 0.05`, "
        "automatic clusters (one per 5000 samples) and k-means sample (256 rows per cluster); synthetic "
        "512-d float16 embeddings with 1% planted near-copies; each pool in a fresh process; "
        f"{saved['memory']['note']} (memory does not depend on the load; wall time does).",
        "",
        "| pool | clusters | wall (s) | RSS before (MB) | peak RSS (MB) | step's own (MB) | embeddings (MB) | "
        "planted copies found |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for m in mem:
        lines.append(
            f"| {m['pool']:,} | {m['clusters']} | {m['seconds']} | {m['rss_before_mb']} | "
            f"{m['peak_rss_mb']} | {m['step_mb']} | {m['embeddings_mb']} | "
            f"{100 * m['planted_found']:.1f}% |"
        )
    text = "\n".join(lines)
    print("\n" + text)
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
