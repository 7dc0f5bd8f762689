"""bf16 weights under gradient caching: chunk gradients summed in bf16 vs in fp32.

One gradient-cached step with bf16 weights inside DeepSpeed (ZeRO-1) against a
plain fp32 full-batch reference (one forward, naive CLIP loss written here, the
same bf16-rounded initial weights and images).  "before" forces DeepSpeed's
default accumulation dtype (the weight dtype, bf16: DeepSpeed 0.19.8's behaviour
that mmalign used to inherit); "after" is what mmalign now asks for
(``data_types.grad_accum_dtype: fp32``).  Printed: the relative error of the
whole gradient (all parameters as one vector) and of the logit scale's gradient.

    .venv/bin/python bench/bf16_accum.py                       # micro towers, 16 chunks of 4 rows (CPU, seconds)
    .venv/bin/python bench/bf16_accum.py --preset tiny --chunk 16 --chunks 16 --write-doc
    .venv/bin/python bench/bf16_accum.py --preset ViT-B-16 --chunk 16 --chunks 16 --device cuda   # GPU size
"""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from docsection import write_section  # noqa: E402

SECTION = "## bf16 gradient accumulation (bench/bf16_accum.py)"


def _inputs(n: int, image_size: int, context: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, image_size, image_size, generator=g)
    tokens = torch.randint(1, 49000, (n, context), generator=g)
    tokens[:, 0] = 49406
    ends = torch.randint(3, context - 1, (n,), generator=g)
    for i, e in enumerate(ends):
        tokens[i, e] = 49407
        tokens[i, e + 1:] = 0
    return images, tokens


def _naive_clip_loss(img, txt, scale):
    import torch
    import torch.nn.functional as F

    logits = scale * img @ txt.T  # (B, B)
    labels = torch.arange(img.shape[0], device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def measure(preset: str, chunk: int, chunks: int, stage: int, seed: int, device: str) -> dict:
    """Relative gradient errors (whole vector, logit scale) of one cached bf16-weight step, per accumulation dtype."""
    import torch

    from mmalign import engine as eng
    from mmalign.config import load_config
    from mmalign.losses import build_loss
    from mmalign.models import build_model

    batch = chunk * chunks
    overrides = [f"model.preset={preset}", f"train.global_batch_size={batch}", f"train.grad_cache_chunk_size={chunk}",
                 "train.optimizer=sgd", "train.lr=0.1", "train.steps=1", "train.warmup_steps=0",
                 f"train.device={device}", f"deepspeed.zero_stage={stage}", "deepspeed.precision=bf16"]
    cfg = load_config(None, overrides)
    torch.manual_seed(seed)
    model = build_model(cfg.model).to(device)
    with torch.no_grad():  # the reference starts from the very weights the bf16 engine holds
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    initial = copy.deepcopy(model.state_dict())
    images, tokens = _inputs(batch, model.image_size, model.context_length, seed + 1)
    images, tokens = images.bfloat16().float().to(device), tokens.to(device)

    refs = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        # uncached, full batch; in bf16 the same arithmetic as the engine's chunks but each
        # weight gradient is one reduction over the whole batch (no accumulation across chunks)
        ref_model = copy.deepcopy(model).to(dtype)
        out = ref_model(images.to(dtype), tokens)
        _naive_clip_loss(out["image_features"].float(), out["text_features"].float(),
                         out["logit_scale"].float()).backward()
        refs[name] = {n: p.grad.detach().float().cpu() for n, p in ref_model.named_parameters()}

    plain = eng.ds_config
    results = {}
    loss_fn = build_loss(cfg.loss)
    for label, dtype in (("before", "bf16"), ("after", None)):
        def forced(c, plan, dtype=dtype):
            conf = plain(c, plan)
            if dtype is not None:  # DeepSpeed's default: accumulate in the weight dtype
                conf["data_types"] = {"grad_accum_dtype": dtype}
            return conf

        eng.ds_config = forced
        try:
            model.load_state_dict(initial)
            model.zero_grad(set_to_none=True)
            engine = eng.Engine(copy.deepcopy(model), cfg)
            accum = engine.ds_config.get("data_types", {}).get("grad_accum_dtype", "bf16")
            grads = {}
            engine.step(images, tokens, lambda o: loss_fn(o["image_features"], o["text_features"], o["logit_scale"]),
                        before_update=lambda: grads.update(engine.full_grads()))
        finally:
            eng.ds_config = plain
        results[label] = {"accum": accum, "optimizer": type(engine.ds.optimizer).__name__,
                          "per_tensor": {n: float((grads[n] - refs["fp32"][n]).norm() / refs["fp32"][n].norm().clamp_min(1e-30)) for n in refs["fp32"]}}
        for name, ref in refs.items():
            diff = torch.linalg.vector_norm(torch.stack([(grads[n] - ref[n]).norm() for n in ref]))
            norm = torch.linalg.vector_norm(torch.stack([ref[n].norm() for n in ref]))
            results[label][f"err_vs_{name}"] = float(diff / norm)
        ref = refs["fp32"]
        results[label]["scale_err_vs_fp32"] = float((grads["logit_scale"] - ref["logit_scale"]).norm()
                                                    / ref["logit_scale"].norm())
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--chunk", type=int, default=4, help="rows per chunk")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument("--stage", type=int, default=1, help="ZeRO stage (>= 1: ZeRO-0 cannot accumulate bf16 in fp32)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--write-doc", action="store_true", help="record the table in docs/benchmarks.md")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    rows = []
    for seed in args.seeds:
        res = measure(args.preset, args.chunk, args.chunks, args.stage, seed, args.device)
        rows.append((seed, res))
        b, a = res["before"], res["after"]
        print(f"seed {seed}: before ({b['accum']} accumulation, {b['optimizer']}) rel grad err "
              f"{b['rel_grad_err']:.2e}, logit-scale {b['rel_scale_grad_err']:.2e} | after ({a['accum']}, "
              f"{a['optimizer']}) {a['rel_grad_err']:.2e}, logit-scale {a['rel_scale_grad_err']:.2e} | "
              f"ratio {b['rel_grad_err'] / a['rel_grad_err']:.1f}x", flush=True)
    load_after = os.getloadavg()
    if not args.write_doc:
        return
    cmd = "python bench/bf16_accum.py " + " ".join(sys.argv[1:])
    uptime = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    lines = [
        SECTION, "",
        f"Command: `{cmd}` · {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC · "
        f"{platform.machine()}, {os.cpu_count()} CPU cores, {args.threads} torch threads, device {args.device} · "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after (`uptime`: {uptime.split('load average:')[-1].strip()})",
        "",
        f"One gradient-cached step, `{args.preset}` towers, {args.chunks} chunks x {args.chunk} rows, bf16 weights in "
        f"DeepSpeed ZeRO-{args.stage}, SGD, against a plain fp32 full-batch forward/backward of the naive CLIP loss "
        "from the same bf16-rounded weights and images. Relative error = ||g - g_ref|| / ||g_ref|| over all "
        "parameters as one vector (and for the logit scale alone). *before*: DeepSpeed's default accumulation "
        "dtype (the weight dtype, bf16); *after*: `data_types.grad_accum_dtype: fp32`, which mmalign now emits "
        "for bf16/fp16 weights at ZeRO >= 1.",
        "",
        "| seed | accumulation | DeepSpeed optimizer | rel. grad error | rel. logit-scale grad error |",
        "|---:|---|---|---:|---:|",
    ]
    for seed, res in rows:
        for label in ("before", "after"):
            r = res[label]
            lines.append(f"| {seed} | {label}: {r['accum']} | {r['optimizer']} | {r['rel_grad_err']:.2e} | "
                         f"{r['rel_scale_grad_err']:.2e} |")
    write_section(ROOT / "docs" / "benchmarks.md", "\n".join(lines) + "\n")
    print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
