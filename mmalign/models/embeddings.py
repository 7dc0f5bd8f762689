"""``Embeddings``: what the two-tower model returns, one typed field per output.

Each field says in its metadata whether it is **per-sample** (its rows are the
batch's samples: concatenated across gradient-cache chunks, cut along dim 0) or
**per-step** (one value for the whole step, e.g. the temperature: taken once, its
gradient back-propagated once).  :mod:`mmalign.run.gradcache` and the engine iterate
the fields through :meth:`Embeddings.tensors`, so an output added to the model (in
a subclass) reaches the loss and gets its gradient on both the cached and the
uncached path without being listed anywhere else; a field without the metadata is
refused (``TypeError``), not silently dropped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor

__all__ = ["Embeddings", "PER_SAMPLE", "PER_STEP", "per_sample", "per_step"]

PER_SAMPLE = "per_sample"
PER_STEP = "per_step"


def per_sample(doc: str = ""):
    """A per-sample output field (rows = samples; any trailing shape)."""
    return dataclasses.field(default=None, metadata={"kind": PER_SAMPLE, "doc": doc})


def per_step(doc: str = ""):
    """A per-step output field (one value for the whole step)."""
    return dataclasses.field(default=None, metadata={"kind": PER_STEP, "doc": doc})


@dataclass
class Embeddings:
    """The model's outputs for one batch; absent outputs are None.

    Features are L2-normalised joint-space vectors (after each tower's projection).
    """

    image: Tensor | None = per_sample("(B, D) features of the images")
    text: Tensor | None = per_sample("(B, D) features of the captions")
    image2: Tensor | None = per_sample("(B, D) features of the second augmented view")
    neg_text: Tensor | None = per_sample("(B, k, D) features of the k mined negative captions")
    logit_scale: Tensor | None = per_step("(1,) the exponentiated temperature scale")
    logit_bias: Tensor | None = per_step("(1,) the SigLIP bias")

    @classmethod
    def kinds(cls) -> dict[str, str]:
        """Field name -> PER_SAMPLE | PER_STEP, for every field of this (sub)class."""
        out = {}
        for f in dataclasses.fields(cls):
            kind = f.metadata.get("kind")
            if kind not in (PER_SAMPLE, PER_STEP):
                raise TypeError(
                    f"{cls.__name__}.{f.name} needs per_sample() or per_step() as its field "
                    f"(the gradient cache must know how to split it)"
                )
            out[f.name] = kind
        return out

    def tensors(self, kind: str | None = None) -> dict[str, Tensor]:
        """The present (not None) fields, optionally only those of ``kind``, in field order."""
        return {
            name: getattr(self, name)
            for name, k in self.kinds().items()
            if getattr(self, name) is not None and (kind is None or k == kind)
        }

    def replace(self, **changes) -> Embeddings:
        """A copy of the same class with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def map(self, fn: Callable[[Tensor], Tensor]) -> Embeddings:
        """``fn`` applied to every present field (e.g. ``.float()`` after autocast)."""
        return self.replace(**{k: fn(v) for k, v in self.tensors().items()})
