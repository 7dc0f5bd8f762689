"""The embedded dataset: procedurally drawn shapes with attribute captions.

Each image is one shape (kind, colour, size, position) on a plain background.  Each
sample carries two captions from different templates (one per line of ``.txt``) and
its attributes in ``.json``, so the same data serves contrastive training, zero-shot
classification of shape and colour, and multi-caption retrieval.  Generation is
deterministic in ``seed``; train and val draw from disjoint streams.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

from PIL import Image, ImageDraw

from data_pipelines.writer import ShardWriter

SHAPES = ["circle", "square", "triangle", "star", "cross", "diamond"]
COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 170, 40),
    "blue": (30, 60, 220),
    "yellow": (240, 220, 20),
    "purple": (140, 40, 180),
    "orange": (250, 140, 10),
    "pink": (250, 120, 190),
}
BACKGROUNDS = {"white": (245, 245, 245), "gray": (128, 128, 128), "black": (15, 15, 15)}
SIZES = {"small": 0.2, "large": 0.34}  # shape radius as a fraction of half the canvas
# 3x3 grid; the phrase reads after "in the" / "at the".
POSITIONS = {
    (0, 0): "top left corner",
    (1, 0): "top",
    (2, 0): "top right corner",
    (0, 1): "left",
    (1, 1): "center",
    (2, 1): "right",
    (0, 2): "bottom left corner",
    (1, 2): "bottom",
    (2, 2): "bottom right corner",
}

TEMPLATES = [
    "a {size} {colour} {shape} in the {position}",
    "a {colour} {shape} on a {background} background",
    "{size} {colour} {shape}, {position}",
    "there is a {colour} {shape} in the {position} of the picture",
    "a drawing of a {shape} that is {colour}",
    "a {colour} {shape}",
    "one {size} {shape}, coloured {colour}, on {background}",
    "a picture showing a {colour} {shape} near the {position}",
    "{colour} {shape} against a {background} backdrop",
    "an image of a {size} {colour} {shape}",
]

SPLIT_OFFSET = {"train": 0, "val": 1_000_003}


def _polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if kind == "triangle":
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)]
    if kind == "diamond":
        return [(cx, cy - r), (cx + 0.7 * r, cy), (cx, cy + r), (cx - 0.7 * r, cy)]
    if kind == "star":
        pts = []
        for i in range(10):
            rr = r if i % 2 == 0 else 0.45 * r
            a = -math.pi / 2 + i * math.pi / 5
            pts.append((cx + rr * math.cos(a), cy + rr * math.sin(a)))
        return pts
    raise ValueError(kind)


def draw(attrs: dict, size: int = 64) -> Image.Image:
    """Render one scene from its attributes."""
    image = Image.new("RGB", (size, size), BACKGROUNDS[attrs["background"]])
    d = ImageDraw.Draw(image)
    r = SIZES[attrs["size"]] * size / 2
    gx, gy = attrs["grid"]
    cx = (gx + 0.5) * size / 3 + attrs["jitter"][0] * size / 16
    cy = (gy + 0.5) * size / 3 + attrs["jitter"][1] * size / 16
    fill = COLOURS[attrs["colour"]]
    kind = attrs["shape"]
    if kind == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif kind == "square":
        h = 0.85 * r
        d.rectangle([cx - h, cy - h, cx + h, cy + h], fill=fill)
    elif kind == "cross":
        w = 0.35 * r
        d.rectangle([cx - r, cy - w, cx + r, cy + w], fill=fill)
        d.rectangle([cx - w, cy - r, cx + w, cy + r], fill=fill)
    else:
        d.polygon(_polygon(kind, cx, cy, r), fill=fill)
    return image


def sample_attributes(rng: random.Random) -> dict:
    grid = rng.choice(list(POSITIONS))
    return {
        "shape": rng.choice(SHAPES),
        "colour": rng.choice(list(COLOURS)),
        "background": rng.choice(list(BACKGROUNDS)),
        "size": rng.choice(list(SIZES)),
        "grid": list(grid),
        "position": POSITIONS[grid],
        "jitter": [rng.uniform(-1, 1), rng.uniform(-1, 1)],
    }


def captions_for(attrs: dict, rng: random.Random, n: int = 2) -> list[str]:
    return [t.format(**attrs) for t in rng.sample(TEMPLATES, n)]


def generate_split(out_dir: str | Path, split: str, n: int, seed: int = 0, per_shard: int = 1000, size: int = 64) -> dict:
    """Write ``n`` samples of ``split`` as shards under ``out_dir/split``."""
    rng = random.Random(seed + SPLIT_OFFSET[split])
    with ShardWriter(Path(out_dir) / split, samples_per_shard=per_shard) as writer:
        for _ in range(n):
            attrs = sample_attributes(rng)
            caps = captions_for(attrs, rng)
            writer.write(draw(attrs, size), "\n".join(caps), {k: v for k, v in attrs.items() if k != "jitter"})
    return writer.sizes


def generate(out_dir: str | Path, n_train: int = 16000, n_val: int = 1000, seed: int = 0, per_shard: int = 2000) -> dict:
    """Both splits plus a small ``dataset.json`` describing the attribute vocabularies."""
    out = Path(out_dir)
    sizes = {
        "train": generate_split(out, "train", n_train, seed, per_shard),
        "val": generate_split(out, "val", n_val, seed, per_shard),
    }
    info = {
        "name": "shapes",
        "seed": seed,
        "splits": {k: sum(v.values()) for k, v in sizes.items()},
        "shapes": SHAPES,
        "colours": list(COLOURS),
        "backgrounds": list(BACKGROUNDS),
        "sizes": list(SIZES),
        "positions": list(POSITIONS.values()),
    }
    (out / "dataset.json").write_text(json.dumps(info, indent=2))
    return info


def is_complete(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return all((out / split / "sizes.json").is_file() for split in ("train", "val")) and (out / "dataset.json").is_file()
