"""Retrieval evaluation at scale: mmalign's Recall@k vs clip_benchmark's, time and peak RSS.

    python bench/eval.py                       # 50k images x 250k captions, D=256, and a 5k x 25k check
    python bench/eval.py --write-doc           # also rewrite the section in docs/benchmarks.md

Random normalised embeddings stand in for a model (5 captions per image, each a noisy
copy of its image's embedding, so the recalls are neither 0 nor 1).  Each side runs in
its own subprocess, so peak RSS (ru_maxrss) is that side's alone; the embeddings
themselves are part of it on both sides and reported separately as the baseline.
clip_benchmark's ``zeroshot_retrieval.evaluate`` gets a stand-in model whose
``encode_image``/``encode_text`` look the rows up, so only its retrieval code is timed;
it builds the full (captions x images) score matrix, so it runs under an address-space
cap (``--cap-gb``) and a failure to allocate is reported, not fatal to the machine.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)
import torch
import torch.nn.functional as F

from bench.harness import DOC, LoadWatch, cpu_line, parser, write_section

KS = [1, 5, 10]
SECTION = "## Retrieval evaluation at scale (bench/eval.py)"


def make_embeddings(n_images: int, n_captions: int, dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = F.normalize(torch.randn(n_images, dim, generator=g), dim=-1)  # (N, D)
    owner = torch.arange(n_captions) % n_images  # (M,)
    texts = F.normalize(images[owner] + 0.25 * torch.randn(n_captions, dim, generator=g), dim=-1)  # (M, D)
    return images, texts, owner


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_side(side: str, n_images: int, n_captions: int, dim: int, cap_gb: float) -> dict:
    images, texts, owner = make_embeddings(n_images, n_captions, dim)
    baseline = _rss_mb()
    if cap_gb > 0:
        cap = int(cap_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        if side == "mmalign":
            from mmalign.evaluation.retrieval import recall_at_k

            metrics = recall_at_k(images, texts, owner, ks=KS)
        else:
            metrics = _clip_benchmark(images, texts, owner)
        error = None
    except (MemoryError, RuntimeError) as e:  # the allocation of the full matrix under the cap
        metrics, error = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return {
        "side": side,
        "images": n_images,
        "captions": n_captions,
        "dim": dim,
        "wall_s": time.perf_counter() - t0,
        "cpu_s": time.process_time() - c0,
        "peak_rss_mb": _rss_mb(),
        "baseline_rss_mb": baseline,
        "metrics": metrics,
        "error": error,
    }


def _clip_benchmark(images, texts, owner):
    from clip_benchmark.metrics import zeroshot_retrieval

    class Lookup:  # the model protocol: "images" are row ids, tokens are caption ids
        def encode_image(self, ids):
            return images[ids]

        def encode_text(self, ids):
            return texts[ids]

    captions_of = [[] for _ in range(images.shape[0])]
    for j, i in enumerate(owner.tolist()):
        captions_of[i].append(str(j))

    def loader(batch=1024):
        for s in range(0, images.shape[0], batch):
            ids = torch.arange(s, min(s + batch, images.shape[0]))
            yield ids, [captions_of[i] for i in ids.tolist()]

    def tokenizer(strings):
        return torch.tensor([int(x) for x in strings])

    return zeroshot_retrieval.evaluate(Lookup(), loader(), tokenizer, "cpu", amp=False, recall_k_list=KS)


def child(side: str, args, n_images: int, n_captions: int) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        side,
        "--images",
        str(n_images),
        "--captions",
        str(n_captions),
        "--dim",
        str(args.dim),
        "--cap-gb",
        str(args.cap_gb),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
        return {
            "side": side,
            "images": n_images,
            "captions": n_captions,
            "dim": args.dim,
            "error": f"exit {proc.returncode}: {tail[:120]}",
        }
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: list[dict]) -> str:
    lines = [
        "| images x captions | side | wall (s) | CPU (s) | peak RSS (MB) | of which embeddings (MB) | R@1 t->i / i->t | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        m = r.get("metrics")
        recall = f"{m['image_retrieval_recall@1']:.4f} / {m['text_retrieval_recall@1']:.4f}" if m else "-"
        ok = "ok" if m else (r.get("error") or "failed")
        fmt = lambda k: f"{r[k]:.0f}" if isinstance(r.get(k), float) else "-"  # noqa: E731
        lines.append(
            f"| {r['images']:,} x {r['captions']:,} | {r['side']} | {fmt('wall_s')} | {fmt('cpu_s')} | "
            f"{fmt('peak_rss_mb')} | {fmt('baseline_rss_mb')} | {recall} | {ok} |"
        )
    return "\n".join(lines)


def write_doc(text: str, watch: LoadWatch, allow_loaded: bool) -> None:
    write_section(DOC, text, watch, allow_loaded)


def main() -> int:
    p = parser(__doc__.splitlines()[0], write_doc="")
    p.add_argument("--images", type=int, default=50_000)
    p.add_argument("--captions", type=int, default=250_000)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument(
        "--check-scale", type=int, default=10, help="also run both sides at 1/N the size (0: skip)"
    )
    p.add_argument("--cap-gb", type=float, default=12.0, help="address-space cap per side (0: none)")
    p.add_argument("--sides", default="mmalign,clip_benchmark")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(run_side(args.child, args.images, args.captions, args.dim, args.cap_gb)))
        return 0
    watch = LoadWatch()
    sizes = [(args.images, args.captions)]
    if args.check_scale:
        sizes.insert(0, (args.images // args.check_scale, args.captions // args.check_scale))
    results = []
    for n, m in sizes:
        for side in args.sides.split(","):
            results.append(child(side, args, n, m))
            print(json.dumps(results[-1]), flush=True)
    out = table(results)
    print(out)
    if args.write_doc:
        cmd = "python bench/eval.py " + " ".join(a for a in sys.argv[1:] if a != "--write-doc")
        head = (
            f"{SECTION}\n\nCommand: `{cmd.strip()} --write-doc` · {time.strftime('%Y-%m-%d')} · "
            f"{cpu_line()}, torch {torch.__version__} · "
            f"random normalised embeddings, D={args.dim}, 5 captions per image, ks {KS}; each side in its own "
            f"subprocess under a {args.cap_gb:g} GB address-space cap.\n\n"
            "mmalign computes each (caption block x images) score block once and keeps only ranks and a running "
            "top-k per image (memory O(block x images + k x images)); clip_benchmark 1.6.2's "
            "`zeroshot_retrieval.evaluate` builds the full captions x images matrix plus a boolean positives "
            "matrix of the same shape.\n\n"
        )
        write_doc(head + out + "\n", watch, args.allow_loaded)
    return 0


if __name__ == "__main__":
    sys.exit(main())
