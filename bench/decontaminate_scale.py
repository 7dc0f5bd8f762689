"""``--decontaminate`` at scale: a 1M-sample pool matched against a 10k evaluation set (wall time
and peak memory of :func:`mmalign.evaluation.contamination.matches`), and the hashing rate.

1. **Hashing rate**: :func:`mmalign.data.phash.hash_images` on decoded images, one process: the
   CIFAR-10 test images (32 px, ``../shared/data/cifar10/test.tar``) and synthetic 256 px images;
   images per second (decoding not counted).
2. **Matching**: the evaluation set is the real hashes of ``--eval`` CIFAR-10 test images (random
   hashes when the tar is absent). The pool's ``--pool`` hashes are made, not hashed (hashing 1M
   images would take the hours part 1 predicts): each row is the real hash of one of ``--real``
   CIFAR-10 train images with 12 random bits flipped (the same flips in every view of it), so the
   pool has real images' bit statistics and clustering but no copy of an evaluation image; then
   1% of the rows are replaced by evaluation images' hashes with 0 to ``radius`` bits flipped (the
   planted copies, which must all be found). Measured in a fresh subprocess: the wall time of
   ``matches`` and its peak RSS (VmHWM, reset just before it) minus the RSS before it.

    python bench/decontaminate_scale.py --write-doc                     # ~10 min on 2 cores
    python bench/decontaminate_scale.py --pool 20000 --eval 1000 --real 500 --rate-images 200
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

SECTION = "## Decontamination at scale: 1M pool against a 10k evaluation set (bench/decontaminate_scale.py)"
CIFAR = ROOT / ".." / "shared" / "data" / "cifar10"
NOISE_BITS = 12  # flipped in a made pool row: far from its source at the default distance


def _cifar(name: str, n: int) -> list:
    """The first ``n`` images of a CIFAR-10 tar (every k-th, so all classes come), decoded; [] if absent."""
    from PIL import Image

    path = CIFAR / name
    if not path.is_file():
        return []
    with tarfile.open(path) as tar:
        members = [m for m in tar.getmembers() if m.isfile() and m.name.endswith(".jpg")]
        step = max(1, len(members) // n)
        files = [tar.extractfile(m) for m in members[::step][:n]]  # regular members: never None
        return [Image.open(io.BytesIO(f.read())).convert("RGB") for f in files if f is not None]


def _rate(images: list) -> float:
    from mmalign.data.phash import hash_images

    start = time.perf_counter()
    for s in range(0, len(images), 256):
        hash_images(images[s : s + 256])
    return len(images) / (time.perf_counter() - start)


def _hashes(images: list, n: int, rng) -> tuple[np.ndarray, np.ndarray]:
    from mmalign.data import phash

    if images:
        return phash.hash_images(images)
    q = rng.integers(0, 2**63, (n, phash.QUERIES, phash.WORDS), dtype=np.uint64)
    i = rng.integers(0, 2**63, (n, phash.VIEWS, phash.WORDS), dtype=np.uint64)
    i[:, 0] = q[:, 0]
    return q, i


def _flips(rng, rows: int, bits: np.ndarray) -> np.ndarray:
    """(rows, WORDS) uint64 masks, row r with bits[r] distinct random bits set."""
    from mmalign.data import phash

    masks = np.zeros((rows, phash.BITS), dtype=bool)
    order = np.argsort(rng.random((rows, phash.BITS)), axis=1)
    masks[np.arange(rows)[:, None], order] = np.arange(phash.BITS)[None, :] < bits[:, None]
    return np.packbits(masks, axis=1, bitorder="little").view(np.uint64)


def matching(pool: int, n_eval: int, n_real: int, radius: int | None, seed: int) -> dict:
    """One process: the made pool and the evaluation set, then ``matches`` measured alone."""
    from mmalign.data import phash
    from mmalign.evaluation.contamination import DEFAULT_DISTANCE, matches

    radius = DEFAULT_DISTANCE if radius is None else radius
    rng = np.random.default_rng(seed)
    eq, ei = _hashes(_cifar("test.tar", n_eval), n_eval, rng)
    bq, bi = _hashes(_cifar("train.tar", n_real), n_real, rng)
    real = (CIFAR / "test.tar").is_file()
    pq = np.empty((pool, phash.QUERIES, phash.WORDS), np.uint64)
    pi = np.empty((pool, phash.VIEWS, phash.WORDS), np.uint64)
    for s in range(0, pool, 65536):  # made in blocks: the synthetic data's own peak stays small
        e = min(pool, s + 65536)
        src = rng.integers(0, len(bq), e - s)
        noise = _flips(rng, e - s, np.full(e - s, NOISE_BITS))[:, None, :]  # (b, 1, W)
        pq[s:e], pi[s:e] = bq[src] ^ noise, bi[src] ^ noise
    planted = rng.choice(pool, pool // 100, replace=False)
    sources = rng.integers(0, len(eq), planted.size)
    noise = _flips(rng, planted.size, rng.integers(0, radius + 1, planted.size))[:, None, :]
    pq[planted], pi[planted] = eq[sources] ^ noise, ei[sources] ^ noise
    del bq, bi, src, noise
    before = reset_peak()  # the set-up's freed memory handed back; VmHWM from here: the step's own peak
    start = time.perf_counter()
    rows, _, _ = matches(pq, pi, eq, ei, radius)
    seconds = time.perf_counter() - start
    found = np.isin(planted, rows).mean()
    return {
        "pool": pool,
        "eval": len(eq),
        "real_hashes": real,
        "radius": radius,
        "seconds": round(seconds, 2),
        "rss_before_mb": round(before),
        "peak_rss_mb": round(status_mb("VmHWM")),
        "step_mb": round(status_mb("VmHWM") - before),
        "hashes_mb": round((pq.nbytes + pi.nbytes + eq.nbytes + ei.nbytes) / 2**20),
        "planted": int(planted.size),
        "planted_found": float(found),
        "matched": int(rows.size),
    }


def main() -> None:
    p = parser(__doc__, write_doc="")
    p.add_argument("--pool", type=int, default=1_000_000)
    p.add_argument("--eval", type=int, default=10_000, help="evaluation images (CIFAR-10 test)")
    p.add_argument(
        "--real", type=int, default=20_000, help="CIFAR-10 train images the pool's rows are made from"
    )
    p.add_argument("--rate-images", type=int, default=2000, help="images per hashing-rate run")
    p.add_argument(
        "--distance", type=int, default=None, help="bits (default: contamination.DEFAULT_DISTANCE)"
    )
    p.add_argument("--_matching", action="store_true", help=argparse.SUPPRESS)  # the subprocess of part 2
    args = p.parse_args()
    if args._matching:
        print(json.dumps(matching(args.pool, args.eval, args.real, args.distance, 0)))
        return
    watch = LoadWatch()
    from PIL import Image

    rng = np.random.default_rng(0)
    rates = []
    cifar = _cifar("test.tar", args.rate_images)
    if cifar:
        rates.append(("CIFAR-10 test, 32 px", len(cifar), _rate(cifar)))
    big = [
        Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8))
        for _ in range(max(8, args.rate_images // 8))
    ]
    rates.append(("synthetic, 256 px", len(big), _rate(big)))
    for r in rates:
        print(r, flush=True)
    child = [sys.executable, __file__, "--_matching", "--pool", str(args.pool), "--eval", str(args.eval)]
    child += ["--real", str(args.real)] + (
        [] if args.distance is None else ["--distance", str(args.distance)]
    )
    proc = subprocess.run(child, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(proc.stderr[-2000:])
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    print(m, flush=True)
    import mmalign.data.phash as phash

    made = (
        f"the real hashes of {args.real:,} CIFAR-10 train images, each row one of them with {NOISE_BITS} "
        "bits flipped"
        if m["real_hashes"]
        else "random hashes (CIFAR-10 not found)"
    )
    lines = [
        SECTION,
        "",
        f"Command: `{command()}` · {datetime.date.today().isoformat()} · {cpu_line()} · load "
        f"{watch.start:.1f} at the start",
        "",
        f"**Hashing** (`phash.hash_images`, VERSION {phash.VERSION}: {phash.QUERIES} query and {phash.VIEWS} "
        "index hashes per image; decoding not counted), one process:",
        "",
        "| images | count | images/s |",
        "|---|---|---|",
        *[f"| {name} | {n:,} | {rate:.0f} |" for name, n, rate in rates],
        "",
        f"**Matching** (`contamination.matches`, {m['radius']} bits, both ways through `hamming.near_pairs`): "
        f"{m['eval']:,} evaluation images ({'real CIFAR-10 test hashes' if m['real_hashes'] else 'random'}); "
        f"the pool's hashes are made: {made}, then 1% replaced by evaluation hashes with 0 to "
        f"{m['radius']} bits flipped (planted copies). A fresh process; peak RSS (VmHWM) reset before the step.",
        "",
        "| pool | eval | wall (s) | RSS before (MB) | peak RSS (MB) | step's own (MB) | hashes (MB) | "
        "planted found | pool rows matched |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {m['pool']:,} | {m['eval']:,} | {m['seconds']} | {m['rss_before_mb']} | {m['peak_rss_mb']} | "
        f"{m['step_mb']} | {m['hashes_mb']} | {100 * m['planted_found']:.1f}% of {m['planted']:,} | "
        f"{m['matched']:,} |",
    ]
    text = "\n".join(lines)
    print("\n" + text)
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
