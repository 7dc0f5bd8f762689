"""ViT-B-16 training throughput and MFU at bf16 on one GPU (needs CUDA).

Runs the real engine (DeepSpeed ZeRO-1, bf16 weights, bf16 autocast, tiled local
loss) on random inputs and reports samples/s and model FLOP utilisation against
the GPU's dense bf16 peak.

    python bench/gpu_throughput.py --batch 256 --steps 10
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="ViT-B-16")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--chunk", type=int, default=0, help="gradient-cache chunk (0 = off)")
    p.add_argument("--steps", type=int, default=10)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/gpu_throughput.py needs a CUDA device")

    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine
    from mmalign.run.monitors import forward_flops_per_sample, peak_tflops

    cfg = load_config(
        None,
        [
            f"model.preset={args.model}",
            f"train.global_batch_size={args.batch}",
            f"train.grad_cache_chunk_size={args.chunk}",
            "train.warmup_steps=0",
            f"train.steps={args.steps + 3}",
            "deepspeed.zero_stage=1",
            "deepspeed.precision=bf16",
            "train.precision=bf16",
            "loss.tile_size=1024",
        ],
    )
    model = build_model(cfg.model)
    flops = 3 * forward_flops_per_sample(model, model.image_size, model.context_length)
    engine = Engine(model.cuda(), cfg)
    objective = build_objective(cfg)
    images = torch.randn(args.batch, 3, model.image_size, model.image_size, device="cuda")
    tokens = torch.randint(1, 49000, (args.batch, model.context_length), device="cuda")
    tokens[:, 0], tokens[:, 20], tokens[:, 21:] = 49406, 49407, 0

    def autocast():
        return torch.autocast("cuda", dtype=torch.bfloat16)

    def step():
        engine.step(Batch(images, tokens), objective, autocast)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.steps):
        step()
    torch.cuda.synchronize()
    sps = args.batch * args.steps / (time.perf_counter() - start)
    peak = peak_tflops(torch.device("cuda"), 0.0)
    tflops = sps * flops / 1e12
    print(
        f"| {args.model} | {torch.cuda.get_device_name()} | batch {args.batch} | {sps:.0f} samples/s | "
        f"{tflops:.1f} TFLOP/s | MFU {tflops / peak:.1%} |"
        if peak
        else f"{sps:.0f} samples/s, {tflops:.1f} TFLOP/s"
    )
    print(f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


if __name__ == "__main__":
    main()
