"""Worker-side work on one sample and one batch: decode, augment, choose a caption, tokenize.

Everything random about a sample (its crop, flip, jitter, and which of its captions
is used) comes from one ``random.Random`` the stream seeds from (seed, slot, sample
number), so a resumed run reproduces it exactly.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable

import torch

from mmalign.data.shards import IMAGE_EXTS, BadSample, open_image, parse_captions, parse_meta
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


class SampleProcessor:
    """Raw members of one sample -> the tensors and strings of one batch row."""

    def __init__(self, transform: Callable, tokenizer: Callable, *, views: int = 1,
                 id_field: str | None = None, max_pixels: int | None = None):
        self.transform = transform
        self.tokenizer = tokenizer
        self.views = views
        self.id_field = id_field
        self.max_pixels = max_pixels
        # Our train transform takes the per-sample generator; a plain callable (e.g. a
        # torchvision Compose) uses torch's global RNG and is then not reproducible.
        self._seeded = isinstance(transform, TrainTransform)

    def _apply(self, image, rng: random.Random) -> torch.Tensor:
        return self.transform(image, rng) if self._seeded else self.transform(image)

    def __call__(self, key: str, members: dict[str, bytes], rng: random.Random) -> dict:
        """Raises BadSample(reason) for anything the run should skip."""
        image_bytes = next((members[e] for e in IMAGE_EXTS if e in members), None)
        if image_bytes is None:
            raise BadSample("missing_image")
        meta = parse_meta(members)
        captions = parse_captions(members, meta)
        row = {"key": key.rsplit("/", 1)[-1], "caption": captions[rng.randrange(len(captions))]}
        if self.id_field is not None:
            if self.id_field not in meta:
                raise BadSample("missing_id", f"no field {self.id_field!r} in .json")
            try:
                row["id"] = id_value(meta[self.id_field])
            except TypeError as e:
                raise BadSample("missing_id", str(e)) from None
        image = open_image(image_bytes, self.max_pixels)
        try:
            row["image"] = self._apply(image, rng)  # (3, H, W)
            if self.views == 2:
                row["image2"] = self._apply(image, rng)  # a second, independent augmentation
        except (OSError, ValueError) as e:  # truncated pixel data can surface only here
            raise BadSample("corrupt_image", f"{type(e).__name__}: {e}") from None
        return row

    def collate(self, rows: list[dict], epochs: list[int]) -> dict:
        captions = [r["caption"] for r in rows]
        batch = {
            "images": torch.stack([r["image"] for r in rows]),  # (B, 3, H, W)
            "tokens": self.tokenizer(captions),  # (B, L)
            "captions": captions,
            "keys": [r["key"] for r in rows],
            "epochs": torch.tensor(epochs, dtype=torch.long),  # (B,) the epoch each sample belongs to
        }
        if self.id_field is not None:
            batch["ids"] = torch.tensor([r["id"] for r in rows], dtype=torch.long)  # (B,)
        if self.views == 2:
            batch["images2"] = torch.stack([r["image2"] for r in rows])  # (B, 3, H, W)
        return batch
