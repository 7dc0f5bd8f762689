"""Worker-side work on one sample and one batch: decode, augment, choose a caption, tokenize.

With ``hard_negatives=k`` a sample also reads up to k mined negative captions from its
``.json`` ``hard_negatives`` list (written by ``mmalign mine``, hardest first) and the
batch carries ``neg_tokens`` (B, k, L) and ``neg_mask`` (B, k).  A sample with fewer
(or none: the field is absent, or mining found none below its false-negative
threshold) is kept and padded with masked slots rather than skipped: it is still a
valid positive pair, and skipping would bias training toward samples that happen to
have many mined neighbours.  The loss reports the filled fraction (``mined_neg_valid``).
A field that is present but malformed is a counted skip (``bad_hard_negatives``).

Images leave the workers as uint8 when the transform is ours (:meth:`TrainTransform.raw`;
normalised on the training device), and large JPEGs are drafted (decoded at reduced
scale) before decoding.  :func:`merge` joins the workers' pieces of one local batch.

Everything random about a sample comes from the sample itself: the stream hands over one
integer, :func:`sample_seed` of (run seed, epoch, sample key), and each use of it draws from
its own generator, keyed by that seed and its purpose (:data:`CAPTION`, :data:`VIEW`,
:data:`VIEW2`; the FLIP mask reads ``Batch.seeds``).  Which rank or worker decodes the sample,
and what came before it there, changes nothing: a run's augmentation does not depend on the
cluster (issue 30), and a resumed run reproduces it exactly.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import numpy as np
import torch

from mmalign.data.batch import Batch
from mmalign.data.seeds import CAPTION, VIEW, VIEW2, draws
from mmalign.data.shards import IMAGE_EXTS, BadSample, open_image, parse_captions, parse_meta
from mmalign.data.teacher_members import read_teacher
from mmalign.data.transforms import TrainTransform


def id_value(value) -> int:
    """A json id -> int64: integers as they are, strings by a stable 63-bit hash."""
    if isinstance(value, bool):
        raise TypeError("a boolean is no id")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        return int.from_bytes(hashlib.blake2b(value.encode("utf-8"), digest_size=8).digest(), "big") >> 1
    raise TypeError(f"unsupported id type {type(value).__name__}")


def mined_captions(meta: dict, k: int) -> list[str]:
    """The first ``k`` captions of ``.json`` ``hard_negatives`` (dicts with a ``caption``, or strings).

    Absent field -> [] (padded and masked); present but malformed -> BadSample.
    """
    listed = meta.get("hard_negatives")
    if listed is None:
        return []
    if not isinstance(listed, list):
        raise BadSample("bad_hard_negatives", f"expected a list, got {type(listed).__name__}")
    captions = []
    for entry in listed[:k]:
        caption = entry.get("caption") if isinstance(entry, dict) else entry
        if not isinstance(caption, str) or not caption.strip():
            raise BadSample("bad_hard_negatives", f"entry without a caption: {str(entry)[:80]}")
        captions.append(caption.strip())
    return captions


class SampleProcessor:
    """Raw members of one sample -> the tensors and strings of one batch row."""

    def __init__(
        self,
        transform: Callable,
        tokenizer: Callable,
        *,
        views: int = 1,
        id_field: str | None = None,
        max_pixels: int | None = None,
        hard_negatives: int = 0,
        teacher_dim: int = 0,
    ):
        self.transform = transform
        self.teacher_dim = teacher_dim  # > 0: read the stored teacher embeddings of this width
        self.tokenizer = tokenizer
        self.views = views
        self.id_field = id_field
        self.max_pixels = max_pixels
        self.hard_negatives = hard_negatives
        # Our train transform takes the per-sample generator, drafts large JPEGs and returns
        # uint8; a plain callable (e.g. a torchvision Compose) uses torch's global RNG and is
        # then not reproducible, and its output crosses processes as it is.
        self._train = transform if isinstance(transform, TrainTransform) else None
        self._prepare = self._train.draft if self._train is not None else None

    def _apply(self, image, rng: random.Random) -> torch.Tensor:
        return self._train.raw(image, rng) if self._train is not None else self.transform(image)

    def __call__(self, key: str, members: dict[str, bytes], seed: int) -> dict:
        """One row from a sample's members and its :func:`sample_seed`; raises BadSample(reason)
        for anything the run should skip."""
        image_bytes = next((members[e] for e in IMAGE_EXTS if e in members), None)
        if image_bytes is None:
            raise BadSample("missing_image")
        meta = parse_meta(members)
        captions = parse_captions(members, meta)
        drawn = draws(seed, CAPTION).randrange(len(captions))
        row = {"key": key.rsplit("/", 1)[-1], "seed": seed, "caption": captions[drawn]}
        if self.id_field is not None:
            if self.id_field not in meta:
                raise BadSample("missing_id", f"no field {self.id_field!r} in .json")
            try:
                row["id"] = id_value(meta[self.id_field])
            except TypeError as e:
                raise BadSample("missing_id", str(e)) from None
        if self.hard_negatives:
            row["negatives"] = mined_captions(meta, self.hard_negatives)
        if self.teacher_dim:
            teacher = read_teacher(members, drawn, len(captions))  # the drawn caption's text row
            if teacher[0].shape[0] != self.teacher_dim:
                raise BadSample(
                    "bad_teacher", f"width {teacher[0].shape[0]}, the first sample's {self.teacher_dim}"
                )
            row["teacher"] = teacher
        image = open_image(image_bytes, self.max_pixels, self._prepare)
        try:
            row["image"] = self._apply(image, draws(seed, VIEW))  # (3, H, W)
            if self.views == 2:
                row["image2"] = self._apply(image, draws(seed, VIEW2))  # a second, independent augmentation
        except (OSError, ValueError) as e:  # truncated pixel data can surface only here
            raise BadSample("corrupt_image", f"{type(e).__name__}: {e}") from None
        return row

    def collate(self, rows: list[dict], epochs: list[int]) -> Batch:
        captions = [r["caption"] for r in rows]
        batch = Batch(
            images=torch.stack([r["image"] for r in rows]),  # (B, 3, H, W) uint8 (our transform)
            tokens=self.tokenizer(captions),  # (B, L)
            captions=captions,
            keys=[r["key"] for r in rows],
            epochs=torch.tensor(epochs, dtype=torch.long),  # (B,) the epoch each sample belongs to
            seeds=torch.tensor([r["seed"] for r in rows], dtype=torch.long),  # (B,) each sample's seed
        )
        if self.id_field is not None:
            batch.ids = torch.tensor([r["id"] for r in rows], dtype=torch.long)  # (B,)
        if self.views == 2:
            batch.images2 = torch.stack([r["image2"] for r in rows])  # (B, 3, H, W)
        if self.hard_negatives:
            k = self.hard_negatives
            padded = [(r["negatives"] + [""] * k)[:k] for r in rows]  # "" marks an empty slot
            tokens = self.tokenizer([c for p in padded for c in p])  # (B k, L)
            batch.neg_tokens = tokens.reshape(len(rows), k, -1)  # (B, k, L)
            batch.neg_mask = torch.tensor([[bool(c) for c in p] for p in padded])  # (B, k)
        if self.teacher_dim:
            batch.teacher_image = torch.from_numpy(np.stack([r["teacher"][0] for r in rows]))  # (B, D_T)
            batch.teacher_text = torch.from_numpy(np.stack([r["teacher"][1] for r in rows]))  # (B, D_T)
            batch.teacher_scale = torch.tensor(
                [[r["teacher"][2]] for r in rows], dtype=torch.float32
            )  # (B, 1)
        return batch


def merge(parts: list[Batch | None], pin_memory: bool = False) -> Batch:
    """Collated pieces -> one batch (:meth:`Batch.cat`); empty pieces (None) are left out."""
    return Batch.cat([p for p in parts if p is not None], pin_memory)
