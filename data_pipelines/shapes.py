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
import random
from pathlib import Path

from data_pipelines.writer import ShardWriter

# The scene schema, renderer and codec live in the library (the counterfactual eval re-draws scenes).
from mmalign.data.shapes_scene import (  # noqa: F401  (re-exported: SHAPES, draw, is_complete, ...)
    BACKGROUNDS,
    COLOURS,
    POSITIONS,
    SHAPES,
    SIZES,
    SUBSET_ATTRS,
    draw,
    is_complete,
    subset_code,
)
from mmalign.progress import track

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


def generate_split(
    out_dir: str | Path,
    split: str,
    n: int,
    seed: int = 0,
    per_shard: int = 1000,
    size: int = 64,
    caption_mode: str = "full",
) -> dict:
    """Write ``n`` samples of ``split`` as shards under ``out_dir/split``.

    caption_mode: "full" (two full-template captions; the default) or "subset"
    (one caption over a random attribute subset, see the module docstring).
    """
    if caption_mode not in ("full", "subset"):
        raise ValueError(f"caption_mode must be 'full' or 'subset', got {caption_mode!r}")
    rng = random.Random(seed + SPLIT_OFFSET[split])
    with ShardWriter(Path(out_dir) / split, samples_per_shard=per_shard) as writer:
        for _ in track(range(n), f"shapes {split}", total=n, unit="images"):
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


def generate(
    out_dir: str | Path,
    n_train: int = 16000,
    n_val: int = 1000,
    seed: int = 0,
    per_shard: int = 2000,
    caption_mode: str = "full",
) -> dict:
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
