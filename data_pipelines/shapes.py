"""The embedded dataset: procedurally drawn shapes with attribute captions.

Each image is one shape (kind, colour, size, position) on a plain background.  Each
sample carries two captions from different templates (one per line of ``.txt``) and
its attributes in ``.json``, so the same data serves contrastive training, zero-shot
classification of shape and colour, and multi-caption retrieval.  Generation is
deterministic in ``seed``; train and val draw from disjoint streams.

``caption_mode="subset"`` (a testbed for false negatives and metadata positives):
each sample gets ONE caption that mentions a random non-empty subset of the
attributes ("a red shape", "a large star in the top"), so it truly describes every
image having those attributes, usually several per batch. ``.json`` then also holds
``mentioned`` (the attribute names the caption states) and ``subset_code`` (values +
mention flags packed into one int, see :mod:`mmalign.losses.metadata`): with
``data.id_field: subset_code`` and ``loss.positive_mask: attribute_subset`` the loss
treats image i as a positive of caption j iff i has every attribute j mentions.
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
SIZES = {"small": 0.3, "large": 0.45}  # shape radius as a fraction of half the canvas
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


# Attribute order of the subset code (mmalign.losses.metadata): name -> its vocabulary.
SUBSET_ATTRS = {
    "shape": SHAPES,
    "colour": list(COLOURS),
    "size": list(SIZES),
    "position": list(POSITIONS.values()),
    "background": list(BACKGROUNDS),
}


def subset_caption(attrs: dict, rng: random.Random) -> tuple[str, list[str]]:
    """One caption mentioning a random non-empty subset of attributes; returns (caption, mentioned)."""
    names = list(SUBSET_ATTRS)
    k = rng.randint(1, len(names))
    chosen = set(rng.sample(names, k))
    mentioned = [n for n in names if n in chosen]  # in the fixed attribute order
    words = ["a"]
    if "size" in mentioned:
        words.append(attrs["size"])
    if "colour" in mentioned:
        words.append(attrs["colour"])
    words.append(attrs["shape"] if "shape" in mentioned else "shape")
    if "position" in mentioned:
        words.append(f"in the {attrs['position']}")
    if "background" in mentioned:
        words.append(f"on a {attrs['background']} background")
    return " ".join(words), mentioned


def subset_code(attrs: dict, mentioned: list[str]) -> int:
    from mmalign.losses.metadata import encode_subset_code  # pure-int helper, shared with the loss

    values = [vocab.index(attrs[name]) for name, vocab in SUBSET_ATTRS.items()]
    return encode_subset_code(values, [name in mentioned for name in SUBSET_ATTRS])


def generate_split(out_dir: str | Path, split: str, n: int, seed: int = 0, per_shard: int = 1000, size: int = 64,
                   caption_mode: str = "full") -> dict:
    """Write ``n`` samples of ``split`` as shards under ``out_dir/split``.

    caption_mode: "full" (two full-template captions; the default) or "subset"
    (one caption over a random attribute subset, see the module docstring).
    """
    if caption_mode not in ("full", "subset"):
        raise ValueError(f"caption_mode must be 'full' or 'subset', got {caption_mode!r}")
    rng = random.Random(seed + SPLIT_OFFSET[split])
    with ShardWriter(Path(out_dir) / split, samples_per_shard=per_shard) as writer:
        for _ in range(n):
            attrs = sample_attributes(rng)
            meta = {k: v for k, v in attrs.items() if k != "jitter"}
            if caption_mode == "full":
                caps = captions_for(attrs, rng)
            else:
                cap, mentioned = subset_caption(attrs, rng)
                caps = [cap]
                meta.update(mentioned=mentioned, subset_code=subset_code(attrs, mentioned))
            writer.write(draw(attrs, size), "\n".join(caps), meta)
    return writer.sizes


def generate(out_dir: str | Path, n_train: int = 16000, n_val: int = 1000, seed: int = 0, per_shard: int = 2000,
             caption_mode: str = "full") -> dict:
    """Both splits plus a small ``dataset.json`` describing the attribute vocabularies.

    ``caption_mode="subset"`` applies to train only: val keeps full captions so
    retrieval and zero-shot stay comparable across modes.
    """
    out = Path(out_dir)
    sizes = {
        "train": generate_split(out, "train", n_train, seed, per_shard, caption_mode=caption_mode),
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
    if caption_mode != "full":
        info["caption_mode"] = caption_mode
    (out / "dataset.json").write_text(json.dumps(info, indent=2))
    return info


def is_complete(out_dir: str | Path) -> bool:
    out = Path(out_dir)
    return all((out / split / "sizes.json").is_file() for split in ("train", "val")) and (out / "dataset.json").is_file()
