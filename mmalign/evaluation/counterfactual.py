"""Counterfactual tests: edit an image in a known way and see whether the model notices.

Two kinds of edits:

- meaning-preserving: a horizontal flip (``hflip``) and a mild centre crop
  (``crop``, keeping ``scale`` of each side, resized back).  A robust model keeps
  its embedding (cosine near 1) and its zero-shot predictions (flip rate near 0).
  On the shapes a flip moves a shape between left and right; no shape or colour
  class changes, and no evaluated task is about position.
- meaning-changing (``rerender``, shapes only): the scene is re-drawn from its
  ``.json`` attributes with one ``field`` changed (``colour`` -> another colour).
  The task whose label is that field should change its prediction (to the new
  value: the ``follow_rate``); the other tasks should not.

The generator does not store each shape's sub-cell ``jitter`` in ``.json``, so a
re-render cannot reproduce the stored image exactly.  The ``rerender`` edit
therefore compares a re-render of the original attributes against a re-render of
the edited ones, both with zero jitter: the only difference between the two images
is the edited attribute.

Reported per edit: cosine between original and edited joint embeddings (mean, 5th
percentile, min), and per task the prediction flip rate, the top-1 accuracy before
and after (after = against the edited labels, so for a changed task it is the rate
at which the answer follows the edit), and whether the edit should keep or change
that task's answer.
"""

from __future__ import annotations

import random

import torch
from PIL import Image, ImageOps

from mmalign.config import ConfigError
from mmalign.data.shapes_scene import VOCABULARIES, draw
from mmalign.errors import UsageError
from mmalign.evaluation.features import embed_images

KINDS = ("hflip", "crop", "rerender")


def _shapes_vocab(field: str) -> list:
    if field not in VOCABULARIES:
        raise ConfigError(f"counterfactual rerender: field {field!r} is not one of {sorted(VOCABULARIES)}")
    return VOCABULARIES[field]


def _crop(image: Image.Image, scale: float) -> Image.Image:
    w, h = image.size
    cw, ch = max(1, round(w * scale)), max(1, round(h * scale))
    left, top = (w - cw) // 2, (h - ch) // 2
    return image.crop((left, top, left + cw, top + ch)).resize((w, h), Image.Resampling.BICUBIC)


def edit_pairs(samples: list[dict], edit: dict, seed: int = 0) -> tuple[list, list, list[dict]]:
    """(original images, edited images, edited metadata) for one edit spec."""
    kind = edit["name"]
    if kind == "hflip":
        return (
            [s["image"] for s in samples],
            [ImageOps.mirror(s["image"]) for s in samples],
            [s["json"] for s in samples],
        )
    if kind == "crop":
        scale = float(edit.get("scale", 0.9))
        return (
            [s["image"] for s in samples],
            [_crop(s["image"], scale) for s in samples],
            [s["json"] for s in samples],
        )
    if kind == "rerender":
        field = edit.get("field", "colour")
        vocab = _shapes_vocab(field)
        rng = random.Random(seed)
        originals, edited, metas = [], [], []
        for s in samples:
            attrs = dict(s["json"], jitter=[0.0, 0.0])  # jitter is not stored: re-render both sides
            if field not in attrs or "grid" not in attrs:
                raise UsageError(
                    f"counterfactual rerender needs shapes attributes in .json; sample {s['key']} has none"
                )
            new = dict(attrs, **{field: rng.choice([v for v in vocab if v != attrs[field]])})
            originals.append(draw(attrs, s["image"].width))
            edited.append(draw(new, s["image"].width))
            metas.append(new)
        return originals, edited, metas
    raise ConfigError(f"counterfactual edit {kind!r} is not one of {', '.join(KINDS)}")


def _labels(metas: list[dict], field: str, classnames: list[str]) -> torch.Tensor:
    index: dict[object, int] = {n: i for i, n in enumerate(classnames)}  # a missing field: -1
    return torch.tensor([index.get(m.get(field), -1) for m in metas])


@torch.no_grad()
def run_counterfactuals(
    model,
    preprocess,
    samples: list[dict],
    edits: list[dict],
    classifiers: dict,
    batch_size: int = 256,
    device: str = "cpu",
    seed: int = 0,
) -> tuple[dict, dict]:
    """``classifiers``: task name -> {"weights" (D, C), "label_field", "classnames"}.

    Returns (flat metrics ``{edit}_cosine_mean``, ``{edit}_{task}_flip_rate``, ...,
    ``{"edit/task": "keeps" | "changes"}``: what a correct model does).
    """
    metrics: dict = {"n_images": len(samples)}
    expected: dict = {}
    for edit in edits:
        name = edit.get("label", edit["name"])
        before_imgs, after_imgs, after_metas = edit_pairs(samples, edit, seed)
        before = embed_images(model, preprocess, before_imgs, batch_size, device)["joint"]  # (N, D)
        after = embed_images(model, preprocess, after_imgs, batch_size, device)["joint"]  # (N, D)
        cos = (before * after).sum(dim=1)  # (N,)
        metrics[f"{name}_cosine_mean"] = float(cos.mean())
        metrics[f"{name}_cosine_p05"] = float(torch.quantile(cos.double(), 0.05))
        metrics[f"{name}_cosine_min"] = float(cos.min())
        for task, clf in classifiers.items():
            field = clf["label_field"]
            changes = edit["name"] == "rerender" and edit.get("field", "colour") == field
            expected[f"{name}/{task}"] = "changes" if changes else "keeps"
            pred_before = (before @ clf["weights"]).argmax(dim=1)
            pred_after = (after @ clf["weights"]).argmax(dim=1)
            y_before = _labels([s["json"] for s in samples], field, clf["classnames"])
            y_after = _labels(after_metas, field, clf["classnames"])
            metrics[f"{name}_{task}_flip_rate"] = float((pred_before != pred_after).float().mean())
            metrics[f"{name}_{task}_acc1_before"] = float((pred_before == y_before).float().mean())
            # against the edited labels: for a changed task, the rate at which the answer follows the edit
            metrics[f"{name}_{task}_acc1_after"] = float((pred_after == y_after).float().mean())
    return metrics, expected
