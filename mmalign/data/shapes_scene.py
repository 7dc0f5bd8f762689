"""One scene of the embedded shapes dataset: its attributes, how it is drawn, how it is coded.

The generator (``data_pipelines/shapes.py``) samples scenes and writes them as shards;
the library needs the same scene description to evaluate on them (the counterfactual
``rerender`` edit re-draws a scene with one attribute changed) and to read the
attribute-subset code back (:mod:`mmalign.losses.metadata`). Both sides import the
schema from here, so data flows one way: ``data_pipelines`` -> ``mmalign``.

A scene: one shape (``shape``, ``colour``, ``size``, 3x3 ``grid`` cell with its
``position`` phrase, sub-cell ``jitter``) on a plain ``background``.
"""

from __future__ import annotations

import math
from pathlib import Path

from PIL import Image, ImageDraw

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

# The attributes a re-render may change, each with its vocabulary.
VOCABULARIES = {
    "colour": list(COLOURS),
    "background": list(BACKGROUNDS),
    "shape": SHAPES,
    "size": list(SIZES),
}

# Attribute order of the subset code (mmalign.losses.metadata): name -> its vocabulary.
SUBSET_ATTRS = {
    "shape": SHAPES,
    "colour": list(COLOURS),
    "size": list(SIZES),
    "position": list(POSITIONS.values()),
    "background": list(BACKGROUNDS),
}


def _polygon(kind: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if kind == "triangle":
        return [
            (cx + r * math.cos(a), cy + r * math.sin(a)) for a in (-math.pi / 2, math.pi / 6, 5 * math.pi / 6)
        ]
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


def subset_code(attrs: dict, mentioned: list[str]) -> int:
    """The attribute-subset code of a scene whose caption mentions ``mentioned``."""
    from mmalign.losses.metadata import encode_subset_code  # pure-int packing, shared with the loss

    values = [vocab.index(attrs[name]) for name, vocab in SUBSET_ATTRS.items()]
    return encode_subset_code(values, [name in mentioned for name in SUBSET_ATTRS])


def is_complete(out_dir: str | Path) -> bool:
    """Whether ``out_dir`` holds a finished shapes dataset (both splits and ``dataset.json``)."""
    out = Path(out_dir)
    return (
        all((out / split / "sizes.json").is_file() for split in ("train", "val"))
        and (out / "dataset.json").is_file()
    )
