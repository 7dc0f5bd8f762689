"""Loader throughput: mmalign's streaming loader vs a plain webdataset 1.x pipeline (a script, not a test).

Both do the same work per sample: read the tar, decode the JPEG, random-resized-crop
+ flip to 32 px (the same TrainTransform object; mmalign's workers send it uint8 and
normalise on the training device, the plain pipeline normalises in its workers), pick one caption
line at random, then batch and tokenize (CLIP BPE, context 32) in the workers.

    .venv/bin/python bench/loader.py                # prints the table
    .venv/bin/python bench/loader.py --write-doc    # ... and updates docs/benchmarks.md
    .venv/bin/python bench/loader.py --size 224     # at 224 px against open_clip_train's pipeline
                                                    # (bench/loader_openclip.py; its own section)

Shards are built once into a temp folder from ../shared/data/cifar10/train.tar when
present (CIFAR-10 with the 18 CLIP templates), else from the synthetic shapes.
"""

from __future__ import annotations

import datetime
import random
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, write_section

SECTION = "## Loader throughput (bench/loader.py)"
SECTION_224 = "## Loader at 224 px against open_clip (bench/loader.py --size 224)"
CIFAR = ROOT.parent / "shared" / "data" / "cifar10" / "train.tar"


def build_data(out: Path, n: int) -> str:
    from itertools import islice

    from data_pipelines.build import build_shards
    from data_pipelines.sources import Captioner, image_folder, load_templates

    if CIFAR.is_file():
        tset = load_templates("cifar10")
        _, items = image_folder(CIFAR, Captioner(tset["templates"], per_image=4, seed=0), tset["classnames"])
        build_shards(islice(items, n), out, per_shard=1000, progress=False, processes=2, source="cifar10")
        what = f"CIFAR-10 train, first {n} images (32x32 JPEG, 4 template captions each)"
    else:
        from data_pipelines import shapes

        shapes.generate_split(out, "train", n, seed=0, per_shard=1000)
        out = out / "train"
        what = f"synthetic shapes, {n} images (64x64 JPEG)"
    shards = sorted(out.glob("*.tar"))
    return f"{out}/{{00000..{len(shards) - 1:05d}}}.tar", what


def _work():
    from open_clip.tokenizer import SimpleTokenizer

    from mmalign.config import AugmentConfig
    from mmalign.data.transforms import train_transform

    aug = AugmentConfig(crop_scale=[0.5, 1.0], hflip=True)
    return train_transform(32, aug), SimpleTokenizer(context_length=32)


def run_mmalign(spec: str, workers: int, batch: int, batches: int, warmup: int) -> float:
    from mmalign.config import DataConfig
    from mmalign.data.loader import build_train_loader

    transform, tokenizer = _work()
    cfg = DataConfig(train=spec, mode="resampled", workers=workers, shuffle_buffer=1000)
    loader = build_train_loader(cfg, transform, tokenizer, batch, seed=0)
    return _time(iter(loader), batches, warmup, batch)


def run_webdataset(spec: str, workers: int, batch: int, batches: int, warmup: int) -> float:
    import torch
    import webdataset as wds

    transform, tokenizer = _work()

    def one_caption(text: str) -> str:
        lines = [line for line in text.splitlines() if line.strip()]
        return random.choice(lines)

    def collate(samples):
        images, captions = zip(*samples)
        return torch.stack(images), tokenizer(list(captions))

    dataset = (
        wds.WebDataset(spec, resampled=True, shardshuffle=False, nodesplitter=wds.split_by_node)
        .shuffle(1000)
        .decode("pil")
        .to_tuple("jpg", "txt")
        .map_tuple(transform, one_caption)
        .batched(batch, collation_fn=collate, partial=False)
    )
    loader = wds.WebLoader(
        dataset, batch_size=None, num_workers=workers, prefetch_factor=2 if workers else None
    )
    return _time(iter(loader), batches, warmup, batch)


def _time(it, batches: int, warmup: int, batch: int) -> float:
    for _ in range(warmup):  # worker start-up and shuffle-buffer fill are not throughput
        next(it)
    start = time.perf_counter()
    for _ in range(batches):
        next(it)
    return batches * batch / (time.perf_counter() - start)


def write_doc(body: str, watch: LoadWatch, allow_loaded: bool) -> None:
    write_section(DOC, f"{SECTION}\n\n{body.strip()}\n", watch, allow_loaded)


def main() -> None:
    p = parser(__doc__, full=True, write_doc="")
    p.add_argument(
        "--size",
        type=int,
        default=32,
        help="32: CIFAR vs plain webdataset; else generated 256-px JPEGs vs open_clip_train",
    )
    p.add_argument("--n", type=int, default=None, help="samples in the shards (10000 at 32 px, 3000 else)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--batches", type=int, default=None, help="timed batches per case (30 at 32 px, 8 else)")
    p.add_argument("--warmup", type=int, default=None, help="(4 at 32 px, 2 else)")
    p.add_argument("--repeats", type=int, default=2, help="runs per case, alternating; the best is reported")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()
    watch = LoadWatch()
    small = args.size == 32
    args.n = args.n or (10000 if small else 3000)
    args.batches = args.batches or (30 if small else 8)
    args.warmup = args.warmup if args.warmup is not None else (4 if small else 2)
    cmd = command()
    if not small:
        from bench.loader_openclip import compare

        body, _ = compare(args, cmd)
        print()
        print(body)
        if args.write_doc:
            write_section(DOC, f"{SECTION_224}\n\n{body.strip()}\n", watch, args.allow_loaded)
            print(f"\nwrote {DOC}")
        return
    import torch

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        spec, what = build_data(Path(tmp), args.n)
        rows = []
        for workers in args.workers:
            ours, plain = [], []
            for _ in range(args.repeats):  # alternate, so a busy neighbour hurts both alike
                ours.append(run_mmalign(spec, workers, args.batch, args.batches, args.warmup))
                plain.append(run_webdataset(spec, workers, args.batch, args.batches, args.warmup))
            rows.append((workers, max(ours), max(plain)))
            print(f"workers={workers}: mmalign {max(ours):.0f}/s, webdataset {max(plain):.0f}/s", flush=True)
    import webdataset

    table = ["| workers | mmalign samples/s | plain webdataset samples/s | ratio |", "|---|---|---|---|"]
    for workers, ours, plain in rows:
        table.append(f"| {workers} | {ours:.0f} | {plain:.0f} | {ours / plain:.2f}x |")
    body = (
        f"Command: `{cmd}` · {datetime.date.today()} · {cpu_line()}, "
        f"torch {torch.__version__}, webdataset {webdataset.__version__} · data: {what} · batch "
        f"{args.batch}, shuffle buffer 1000, resampled shards, best of {args.repeats} runs of {args.batches} "
        f"batches after {args.warmup} warm-up batches.\n\n"
        "Both sides: read tar, decode JPEG, random-resized-crop (scale 0.5-1) + flip to 32 px, normalise "
        "(mmalign: on the training device, untimed; its workers send uint8), "
        "one random caption line, batch, CLIP-BPE tokenize (context 32), in the DataLoader workers. "
        "mmalign also tracks its exact-resume state and skip counts per batch.\n\n"
        + "\n".join(table)
        + "\n\nTarget: mmalign >= 0.9x the plain webdataset pipeline."
    )
    print()
    print("\n".join(table))
    if args.write_doc:
        write_doc(body, watch, args.allow_loaded)
        print(f"\nwrote {DOC}")


if __name__ == "__main__":
    main()
