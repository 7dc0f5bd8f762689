"""bf16 weights under gradient caching: chunk gradients summed in bf16 vs in fp32.

One gradient-cached step with bf16 weights inside DeepSpeed (ZeRO-1) against a
plain fp32 full-batch reference (one forward, the tests' naive CLIP loss from tests/harness, the
same bf16-rounded initial weights and images) and against the same bf16 chunk
gradients summed exactly.  "before" is DeepSpeed 0.19.8's default (accumulate and
reduce in the weight dtype, what mmalign used to inherit); "after" is what
mmalign now asks for (``grad_accum_dtype`` and ``communication_data_type`` fp32).

    .venv/bin/python bench/bf16_accum.py                       # micro towers, 16 chunks of 4 rows (CPU, seconds)
    .venv/bin/python bench/bf16_accum.py --preset tiny --chunk 16 --chunks 16 --write-doc
    .venv/bin/python bench/bf16_accum.py --preset ViT-B-16 --chunk 16 --chunks 16 --device cuda   # GPU size
"""

from __future__ import annotations

import copy
import datetime

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, LoadWatch, command, cpu_line, parser, write_section

SECTION = "## bf16 gradient accumulation (bench/bf16_accum.py)"


def measure(preset: str, chunk: int, chunks: int, stage: int, seed: int, device: str) -> dict:
    """Relative gradient errors of one cached bf16-weight step against the fp32 full-batch
    gradient and against the exactly summed bf16 chunk gradients, per DeepSpeed config."""
    import torch

    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run import engine as eng
    from tests.harness import clip_batch, naive_clip_loss
    from tests.harness.reference import bf16_chunks_summed_exactly

    batch = chunk * chunks
    cfg = load_config(
        None,
        [
            f"model.preset={preset}",
            f"train.global_batch_size={batch}",
            f"train.grad_cache_chunk_size={chunk}",
            "train.optimizer=sgd",
            "train.lr=0.1",
            "train.steps=1",
            "train.warmup_steps=0",
            f"train.device={device}",
            f"deepspeed.zero_stage={stage}",
            "deepspeed.precision=bf16",
        ],
    )
    torch.manual_seed(seed)
    model = build_model(cfg.model).to(device)
    with torch.no_grad():  # every side starts from the very weights the bf16 engine holds
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    images, tokens = clip_batch(batch, seed + 1, model.image_size, model.context_length)
    images, tokens = images.bfloat16().float().to(device), tokens.to(device)

    ref_model = copy.deepcopy(model)
    out = ref_model(images, tokens)  # fp32, uncached, full batch
    naive_clip_loss(out.image, out.text, out.logit_scale).backward()
    refs = {
        "fp32": {n: p.grad.detach().float().cpu() for n, p in ref_model.named_parameters()},
        "exact_sum": bf16_chunks_summed_exactly(model, images, tokens, chunk),
    }
    del ref_model

    generated = eng.ds_config
    objective = build_objective(cfg)
    results = {}
    for label, deepspeed_defaults in (("before", True), ("after", False)):

        def config(c, plan, stage=None, *, deepspeed_defaults=deepspeed_defaults):
            conf = generated(c, plan, stage)
            if deepspeed_defaults:  # DeepSpeed's defaults: accumulate and reduce in the weight dtype
                conf.pop("data_types", None)
                conf.pop("communication_data_type", None)
            return conf

        eng.ds_config = config
        try:
            engine = eng.Engine(copy.deepcopy(model), cfg)
        finally:
            eng.ds_config = generated
        grads: dict = {}
        engine.step(Batch(images, tokens), objective, before_update=lambda: grads.update(engine.full_grads()))  # noqa: F821 (bound above; deleted at the loop end)
        accum, comm = engine.ds.get_data_types()[1], engine.ds.communication_data_type
        results[label] = {
            "accum": str(accum).removeprefix("torch."),
            "comm": str(comm).removeprefix("torch."),
            "optimizer": type(engine.ds.optimizer).__name__,
        }
        for name, ref in refs.items():
            diff = torch.linalg.vector_norm(torch.stack([(grads[n] - ref[n]).norm() for n in ref]))
            results[label][name] = float(
                diff / torch.linalg.vector_norm(torch.stack([r.norm() for r in ref.values()]))
            )
        del engine
    return results


def main() -> None:
    ap = parser(__doc__, write_doc="record the table in docs/benchmarks.md")
    ap.add_argument("--preset", default="micro")
    ap.add_argument("--chunk", type=int, default=4, help="rows per chunk")
    ap.add_argument("--chunks", type=int, default=16)
    ap.add_argument(
        "--stage", type=int, default=1, help="ZeRO stage (>= 1: ZeRO-0 cannot accumulate bf16 in fp32)"
    )
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    watch = LoadWatch()
    rows = []
    for seed in args.seeds:
        res = measure(args.preset, args.chunk, args.chunks, args.stage, seed, args.device)
        rows.append((seed, res))
        for label in ("before", "after"):
            r = res[label]
            print(
                f"seed {seed} {label}: accumulate {r['accum']}, reduce {r['comm']} ({r['optimizer']}): "
                f"rel. grad error vs fp32 {r['fp32']:.2e}, vs exact chunk sum {r['exact_sum']:.2e}",
                flush=True,
            )
    watch.stop()
    if not args.write_doc:
        return
    cmd = command()
    lines = [
        SECTION,
        "",
        f"Command: `{cmd}` · {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC · "
        f"{cpu_line(args.threads)}, device {args.device}",
        "",
        f"One gradient-cached step, `{args.preset}` towers, {args.chunks} chunks x {args.chunk} rows, bf16 weights in "
        f"DeepSpeed ZeRO-{args.stage}, 1 rank. Relative error = ||g - g_ref|| / ||g_ref|| over all parameters as one "
        "vector, against (a) a plain fp32 full-batch forward/backward of the naive CLIP loss from the same "
        "bf16-rounded weights and images, and (b) the same bf16 chunk backwards (GradCache written out) with their "
        "gradients summed in float64, which isolates the accumulation. *before*: DeepSpeed's defaults (accumulate "
        "and reduce in the weight dtype; the reduce rounds the sum to bf16 even on one rank); *after*: "
        "`data_types.grad_accum_dtype: fp32` and `communication_data_type: fp32`, which mmalign now emits for "
        "bf16/fp16 weights.",
        "",
        "| seed | run | accumulate / reduce | DeepSpeed optimizer | vs fp32 full batch | vs exact chunk sum |",
        "|---:|---|---|---|---:|---:|",
    ]
    for seed, res in rows:
        for label in ("before", "after"):
            r = res[label]
            lines.append(
                f"| {seed} | {label} | {r['accum']} / {r['comm']} | {r['optimizer']} | {r['fp32']:.2e} | "
                f"{r['exact_sum']:.2e} |"
            )
    lines += [
        "",
        "Reading: bf16 weights' own forward/backward arithmetic is ~1-2% off the fp32 gradient whatever "
        "the accumulation, so against fp32 the fp32 accumulation gains a few percent of that error at 16 "
        "chunks; against the exact sum of the same chunk gradients the accumulation error drops from ~4e-3 "
        "(bf16 sums) to <= 3e-6 (fp32 sums). The GPU recipes use fp32 weights with bf16 autocast (open_clip's "
        "choice), where every sum is fp32 anyway.",
    ]
    print("\n".join(lines))
    write_section(DOC, "\n".join(lines) + "\n", watch, args.allow_loaded)
    print("wrote docs/benchmarks.md")


if __name__ == "__main__":
    main()
