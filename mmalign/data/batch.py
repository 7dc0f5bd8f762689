"""``Batch``: one training batch, as the loader yields it and the engine consumes it.

Every field is optional except ``images`` and ``tokens``; a field the run does not
produce is None.  Tensors and lists are per-sample (dim 0 / list index = sample),
so :meth:`Batch.slice` cuts any of them the same way (gradient-cache chunks) and
:meth:`Batch.cat` joins collated pieces; ``skipped`` (the run's skip counts so far)
is per-batch.  ``images`` / ``images2`` leave the workers as uint8 and become
normalised float32 in :meth:`Batch.to` (:mod:`mmalign.data.device`).

The model's inputs are the fields named in :data:`MODEL_INPUTS` (field -> the
``TwoTower.forward`` keyword); the objective decides which of the optional ones a
run feeds (:meth:`mmalign.objective.Objective.select`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from mmalign.data.device import images_to

__all__ = ["Batch", "MODEL_INPUTS"]

# Batch field -> TwoTower.forward keyword
MODEL_INPUTS = {
    "images": "images",
    "tokens": "texts",
    "images2": "images2",
    "neg_tokens": "neg_texts",
    "seeds": "seeds",
}
_IMAGES = ("images", "images2")  # uint8 from the workers: normalised on the device
HOST = ("seeds",)  # read on the host (each row's FLIP mask generator): never moved to the device


@dataclass
class Batch:
    images: Tensor  # (B, 3, H, W) uint8 from the loader, float32 after .to()
    tokens: Tensor  # (B, L) int64
    captions: list[str] | None = None  # B strings (the sampled caption of each image)
    keys: list[str] | None = None  # B sample keys
    epochs: Tensor | None = None  # (B,) the epoch each sample belongs to
    seeds: Tensor | None = (
        None  # (B,) int64 >= 0: each sample's seed (data/samples.sample_seed; the FLIP mask)
    )
    ids: Tensor | None = None  # (B,) int64 from data.id_field
    images2: Tensor | None = None  # (B, 3, H, W) a second augmented view (data.views: 2)
    neg_tokens: Tensor | None = None  # (B, k, L) mined negative captions (data.hard_negatives)
    neg_mask: Tensor | None = None  # (B, k) bool: which of the k slots hold a caption
    # a distillation teacher's embeddings stored in the shards (loss.distill.teacher: stored)
    teacher_image: Tensor | None = None  # (B, D_T) float32, L2-normalised
    teacher_text: Tensor | None = None  # (B, D_T) float32, L2-normalised
    teacher_scale: Tensor | None = None  # (B, 1) float32: the teacher's logit scale, exp'd
    skipped: dict[str, int] = field(default_factory=dict)  # the run's skipped samples so far, by reason

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    def _per_sample(self) -> dict:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "skipped" and getattr(self, f.name) is not None
        }

    def slice(self, i: int, j: int) -> Batch:
        """Samples [i, j) (tensor views, no copies); ``skipped`` is kept."""
        views: dict[str, Any] = {k: v[i:j] for k, v in self._per_sample().items()}
        return dataclasses.replace(self, **views)

    def to(self, device: torch.device | str) -> Batch:
        """Every tensor on ``device``; uint8 images normalised there (float input only moved)."""
        moved: dict[str, Any] = {}
        for k, v in self._per_sample().items():
            if k in _IMAGES:
                moved[k] = images_to(v, torch.device(device))  # (B, 3, H, W) float32
            elif torch.is_tensor(v) and k not in HOST:
                moved[k] = v.to(device, non_blocking=True)
        return dataclasses.replace(self, **moved)

    def model_inputs(self) -> dict[str, Tensor]:
        """``TwoTower.forward`` keywords of the present model-input fields."""
        return {
            kw: getattr(self, name) for name, kw in MODEL_INPUTS.items() if getattr(self, name) is not None
        }

    def without(self, *names: str) -> Batch:
        """A copy with the optional fields ``names`` set to None."""
        cleared: dict[str, Any] = dict.fromkeys(names)
        return dataclasses.replace(self, **cleared)

    @classmethod
    def cat(cls, parts: list[Batch], pin_memory: bool = False) -> Batch:
        """Collated pieces -> one batch: tensors concatenated on dim 0 (into pinned memory when
        ``pin_memory``, for asynchronous copies to a GPU), lists joined, in the order given."""
        first = parts[0]
        joined: dict[str, Any] = {}
        for name, value in first._per_sample().items():
            values = [getattr(p, name) for p in parts]
            if torch.is_tensor(value):
                shape = (sum(v.shape[0] for v in values), *value.shape[1:])
                out = torch.empty(shape, dtype=value.dtype, pin_memory=pin_memory)
                joined[name] = torch.cat(values, out=out)  # (B, ...)
            else:
                joined[name] = [x for v in values for x in v]
        return dataclasses.replace(first, **joined)
