"""CIFAR-10 class-folder tar -> captioned shards, cached in the bench's work folder.

Shared by bench/quality_cifar10.py and bench/finetune.py, which choose their images
differently (the caller's ``make_items``) but cache, write and name the shards alike.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from data_pipelines.build import build_shards
from data_pipelines.sources import Captioner, image_folder, load_templates


def cifar_items(src: Path, seed: int, **kwargs) -> Iterable:
    """The images of a class-folder tar, each with one seeded random CIFAR template over its class
    name (as ``mmalign shards imagefolder --templates cifar10``); kwargs go to ``image_folder``."""
    tset = load_templates("cifar10")
    _, items = image_folder(
        src, Captioner(tset["templates"], per_image=1, seed=seed), tset["classnames"], **kwargs
    )
    return items


def cached_shards(src: Path, out: Path, want: dict, make_items: Callable[[], Iterable]) -> str:
    """Shards of ``make_items()`` under ``out`` (``want["per_shard"]`` each), rebuilt only when
    ``want`` differs from the stamp the last build left; returns their brace spec."""
    stamp = out / "bench_stamp.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return shard_spec(out)
    shutil.rmtree(out, ignore_errors=True)
    summary = build_shards(
        make_items(), out, per_shard=want["per_shard"], progress=False, source=f"imagefolder:{src}"
    )
    stamp.write_text(json.dumps(want))
    print(f"  built {summary['written']} samples in {summary['shards']} shards under {out}", flush=True)
    return shard_spec(out)


def shard_spec(folder: Path) -> str:
    tars = sorted(folder.glob("*.tar"))
    return str(tars[0]) if len(tars) == 1 else f"{folder}/{{{tars[0].stem}..{tars[-1].stem}}}.tar"
