"""Perceptual de-duplication at scale: grouping 100k and 1M pools by pHash (multi-index hashing
over the Hamming space), wall time and peak memory, on synthetic and on real image hashes.

The step measured is :func:`data_pipelines.curate.perceptual.perceptual_groups` (every pair
within the radius by :func:`mmalign.data.hamming.near_pairs`, then the non-chaining greedy
groups), each pool in a fresh process: its peak RSS during the step (VmHWM, reset just before
it), the RSS before it (the pool's hashes, as pass 1 leaves them), its wall time, the substring
count chosen, the candidates checked and the pairs found. Pools:

- **synthetic**: each image a uniform random 64-bit hash; its crop views that hash with
  ``--view-bits`` random bits flipped (real crop views sit a few bits from the whole view), its
  mirror an independent random hash; 1% of the rows are planted copies of another row (its
  views with 0..radius bits flipped), whose recovery is reported;
- **cifar**: the real hashes of the CIFAR-10 curation pool (``bench/curate_cifar10.py``'s
  ``data/bench_curate_cifar10/pool/*.tar``, hashed once by ``phash.hash_images`` and cached in
  WORK), whose bits are correlated as real images' are; and **cifar x R**: that pool replicated
  to ~1M rows, each replica XORed with its own random 64-bit mask (which keeps every distance
  and bucket collision inside a replica, so the correlations stay) and each row with one
  random bit flipped in all its hashes.

    python bench/perceptual_scale.py --write-doc         # minutes per 1M pool on 2 cores
    python bench/perceptual_scale.py --quick             # seconds
"""

from __future__ import annotations

import argparse
import glob
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
    table,
    today,
    write_section,
)

SECTION = "## Perceptual de-duplication at scale (bench/perceptual_scale.py)"
CIFAR_POOL = ROOT / "data" / "bench_curate_cifar10" / "pool"


def _flip(h: np.ndarray, k: int, rng) -> np.ndarray:
    """(n,) uint64 with k random bits flipped each (a bit may be drawn twice: at most k)."""
    out = h.copy()
    for _ in range(k):
        out ^= np.uint64(1) << rng.integers(0, 64, h.shape, dtype=np.uint64)
    return out


def synthetic(n: int, radius: int, view_bits: int, seed: int = 0):
    """(query, index, planted copy rows, their sources) as the module docstring says."""
    from mmalign.data import phash

    rng = np.random.default_rng(seed)
    base = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    query = np.empty((n, phash.QUERIES, 1), np.uint64)
    query[:, 0, 0] = base
    query[:, 1, 0] = rng.integers(0, 2**64, n, dtype=np.uint64, endpoint=False)
    index = np.empty((n, phash.VIEWS, 1), np.uint64)
    index[:, 0, 0] = base
    for v in range(1, phash.VIEWS):
        index[:, v, 0] = _flip(base, view_bits, rng)
    planted = rng.choice(n, size=n // 100, replace=False)
    sources = rng.choice(np.setdiff1d(np.arange(n), planted), size=planted.size, replace=False)
    noise = np.zeros(planted.size, np.uint64)
    for t in range(planted.size):  # 0..radius bits, the same for every hash of the copy
        noise[t] = _flip(np.zeros(1, np.uint64), int(t % (radius + 1)), rng)[0]
    query[planted] = query[sources] ^ noise[:, None, None]
    index[planted] = index[sources] ^ noise[:, None, None]
    return query, index, planted, sources


def cifar_hashes(work: Path, limit: int | None = None):
    """The CIFAR pool's (query, index) hashes, computed once and cached in WORK."""
    from PIL import Image

    from mmalign.data import phash

    cache = work / f"cifar_phash_v{phash.VERSION}_{phash.VIEWS}.npz"
    if not cache.is_file():
        tars = sorted(glob.glob(str(CIFAR_POOL / "*.tar")))
        if not tars:
            raise SystemExit(
                f"no CIFAR pool at {CIFAR_POOL}: run bench/curate_cifar10.py first, or --no-cifar"
            )
        start, qs, ixs = time.perf_counter(), [], []
        for path in tars:
            with tarfile.open(path) as tar:
                images = [
                    Image.open(io.BytesIO(tar.extractfile(m).read())).convert("RGB")
                    for m in tar.getmembers()
                    if m.name.endswith((".jpg", ".png", ".jpeg"))
                ]
            q, ix = phash.hash_images(images)
            qs.append(q)
            ixs.append(ix)
        query, index = np.concatenate(qs), np.concatenate(ixs)
        print(f"hashed {len(query)} CIFAR images in {time.perf_counter() - start:.0f} s", flush=True)
        work.mkdir(parents=True, exist_ok=True)
        np.savez(cache, query=query, index=index)
    data = np.load(cache)
    return data["query"][:limit], data["index"][:limit]


def replicate(query, index, n: int, seed: int = 0):
    """The pool replicated to n rows: each replica XORed with its own mask, each row with one bit."""
    rng = np.random.default_rng(seed)
    reps = -(-n // len(query))
    mask = rng.integers(0, 2**64, reps, dtype=np.uint64, endpoint=False)
    mask[0] = 0  # the first replica is the pool itself
    rep = np.repeat(np.arange(reps), len(query))[:n]
    row = np.tile(np.arange(len(query)), reps)[:n]
    noise = np.where(rep > 0, np.uint64(1) << rng.integers(0, 64, n, dtype=np.uint64), np.uint64(0))
    x = (mask[rep] ^ noise)[:, None, None]  # (n, 1, 1)
    return query[row] ^ x, index[row] ^ x


def measure(kind: str, n: int, radius: int, view_bits: int, work: Path) -> dict:
    """One process, one step: the hashes built (not measured), then perceptual_groups."""
    from data_pipelines.curate.perceptual import greedy_groups, visit_order
    from mmalign.data.hamming import near_pairs

    planted = sources = None
    if kind == "synthetic":
        query, index, planted, sources = synthetic(n, radius, view_bits)
    else:
        query, index = cifar_hashes(work)
        if kind == "cifar-x":
            query, index = replicate(query, index, n)
        query, index = query[:n], index[:n]
    before = reset_peak()  # RSS once the set-up's freed memory is handed back; VmHWM from here
    stats: dict = {}
    start = time.perf_counter()
    a, b, _ = near_pairs(query, index, radius, same=True, stats=stats)
    pairs_s = time.perf_counter() - start
    groups = greedy_groups(len(query), a, b, visit_order(len(query)))
    seconds = time.perf_counter() - start
    row = {
        "pool": kind,
        "n": len(query),
        "radius": radius,
        "seconds": round(seconds, 1),
        "pairs_seconds": round(pairs_s, 1),
        "rss_before_mb": round(before),
        "peak_rss_mb": round(status_mb("VmHWM")),
        "step_mb": round(status_mb("VmHWM") - before),
        "hashes_mb": round((query.nbytes + index.nbytes) / 2**20),
        "grouped": int(len(groups) - np.unique(groups).size),
        **stats,
    }
    if planted is not None:
        row["planted_found"] = float(np.mean(groups[planted] == groups[sources]))
    return row


def main() -> None:
    p = parser(__doc__, write_doc="")
    p.add_argument("--quick", action="store_true", help="20k synthetic and 5k CIFAR rows: seconds")
    p.add_argument("--pools", default="100000,1000000", help="synthetic pool sizes")
    p.add_argument("--radius", default=None, help="bits, comma list (default phash.DEFAULT_DISTANCE)")
    p.add_argument("--view-bits", type=int, default=6, help="synthetic crop views: bits from the whole view")
    p.add_argument("--no-cifar", action="store_true", help="skip the rows from real CIFAR hashes")
    p.add_argument("--work", default=str(ROOT / "data" / "bench_perceptual_scale"))
    p.add_argument("--_one", nargs=3, help=argparse.SUPPRESS)  # KIND N RADIUS: the subprocess
    args = p.parse_args()
    work = Path(args.work)
    if args._one:
        kind, n, radius = args._one
        print(json.dumps(measure(kind, int(n), int(radius), args.view_bits, work)))
        return
    from mmalign.data import phash

    watch = LoadWatch()
    radii = [phash.DEFAULT_DISTANCE] if args.radius is None else [int(r) for r in args.radius.split(",")]
    pools = [20_000] if args.quick else [int(x) for x in args.pools.split(",")]
    runs = [("synthetic", n) for n in pools]
    if not args.no_cifar:
        cifar_n = 5_000 if args.quick else 10**9
        runs += [("cifar", cifar_n), ("cifar-x", 20_000 if args.quick else max(pools))]
        cifar_hashes(work)  # hashed once, outside the measured processes
    rows = []
    for radius in radii:
        for kind, n in runs:
            cmd = [sys.executable, __file__, "--_one", kind, str(n), str(radius)]
            proc = subprocess.run(
                cmd + ["--view-bits", str(args.view_bits), "--work", str(work)],
                capture_output=True,
                text=True,
            )
            if proc.returncode:
                raise SystemExit(proc.stderr[-2000:])
            rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
            print(rows[-1], flush=True)
    (work / "results.json").write_text(json.dumps(rows, indent=1))
    names = {"synthetic": "synthetic", "cifar": "CIFAR-10 pool", "cifar-x": "CIFAR-10 pool x mask replicas"}
    body = table(
        [
            "pool",
            "samples",
            "radius (bits)",
            "substrings",
            "candidates checked",
            "pairs",
            "grouped (dropped)",
            "wall (s)",
            "RSS before (MB)",
            "peak RSS (MB)",
            "step's own (MB)",
            "planted copies found",
        ],
        [
            [
                names[r["pool"]],
                f"{r['n']:,}",
                r["radius"],
                r["parts"] or "all pairs",
                f"{r['candidates']:,}",
                f"{r['pairs']:,}",
                f"{r['grouped']:,}",
                r["seconds"],
                r["rss_before_mb"],
                r["peak_rss_mb"],
                r["step_mb"],
                f"{100 * r['planted_found']:.1f}%" if "planted_found" in r else "-",
            ]
            for r in rows
        ],
    )
    text = "\n".join(
        [
            SECTION,
            "",
            f"Command: `{command()}` · {today()} · {cpu_line()}, numpy {np.__version__}",
            "",
            "`perceptual_groups` (every pair within the radius by multi-index hashing, then the "
            "non-chaining greedy groups), each pool in a fresh process; the pool's pHashes "
            f"({phash.QUERIES} query + {phash.VIEWS} index hashes of 64 bits per sample) are held before "
            "the step. Synthetic pools: uniform random hashes, crop views "
            f"{args.view_bits} random bit flips from the whole view, mirrors independent, 1% planted copies "
            "0..radius bits from another row. CIFAR-10 rows: the real hashes of bench/curate_cifar10.py's "
            "pool (correlated bits, so fuller buckets than uniform hashes), and that pool replicated to the "
            "largest size, each replica XORed with its own random mask and each row with one bit flipped. "
            "Candidates: the (query hash, index hash) pairs whose full distance was computed; "
            f"all pairs would be {phash.QUERIES} x {phash.VIEWS} x N².",
            "",
            body,
        ]
    )
    print("\n" + text)
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
