"""Terms beside the contrastive one: mined hard negatives and the image-image views.

* :class:`MinedNegatives`: each image row's own mined captions as extra image->text
  candidates (:mod:`mmalign.losses.mined`; adds ``0.5 * mean softplus(N_i - L_i)`` to
  the plain InfoNCE, so it reads the contrastive term's row LSE ``ctx.lse_i2t``).
* :class:`ImageImage`: ``weight`` x NT-Xent between two augmented views of each image
  (:mod:`mmalign.losses.ntxent`; SimCLR / SLIP) at a fixed temperature, logged as
  ``image_image_loss`` (the total ``loss`` then = ``contrastive_loss`` + weight x it).
"""

from __future__ import annotations

from mmalign.losses.mined import mined_negatives_term
from mmalign.losses.ntxent import ntxent_loss
from mmalign.losses.tile_choice import DEFAULT_BUDGET_MB, resolve_tile

from .base import StepContext, Term, TermOutput

__all__ = ["MinedNegatives", "ImageImage"]


class MinedNegatives(Term):
    name = "mined"
    embeddings = ("image", "neg_text", "logit_scale")
    batch_fields = ("neg_tokens", "neg_mask")

    def __call__(self, ctx: StepContext) -> TermOutput:
        if ctx.lse_i2t is None:
            raise ValueError("mined negatives need the plain infonce term before them")
        emb, neg_mask = ctx.emb, ctx.batch.neg_mask
        # declared in embeddings / batch_fields: present with data.hard_negatives
        assert emb.image is not None and emb.neg_text is not None and emb.logit_scale is not None
        assert neg_mask is not None
        term, stats = mined_negatives_term(emb.image, emb.neg_text, neg_mask, emb.logit_scale, ctx.lse_i2t)
        return TermOutput(term, stats if ctx.track else {})


class ImageImage(Term):
    """``weight`` x NT-Xent(image, image2) at ``1 / temperature``."""

    name = "views"
    embeddings = ("image", "image2")
    batch_fields = ("images2",)
    stat = "image_image_loss"

    def __init__(
        self,
        weight: float,
        temperature: float = 0.1,
        tile_size: int | str | None = 0,
        tile_budget_mb: float = DEFAULT_BUDGET_MB,
    ):
        if weight <= 0 or temperature <= 0:
            raise ValueError(f"need weight > 0 and temperature > 0, got {weight}, {temperature}")
        self.weight, self.scale, self.tile_size = float(weight), 1.0 / float(temperature), tile_size or None
        self.tile_budget_mb = float(tile_budget_mb)

    def __repr__(self) -> str:
        return f"ImageImage(weight={self.weight}, temperature={1 / self.scale}, tile_size={self.tile_size!r})"

    def __call__(self, ctx: StepContext) -> TermOutput:
        if ctx.emb.image2 is None:
            raise ValueError("the image-image term needs image2 features (data.views: 2)")
        assert ctx.emb.image is not None  # checked by StepContext
        rows = 2 * ctx.emb.image.shape[0]  # both views are anchors, against every rank's
        tile = resolve_tile(
            self.tile_size, "ntxent", rows, ctx.world * rows, ctx.emb.image.dtype, self.tile_budget_mb
        )
        term = ntxent_loss(ctx.emb.image, ctx.emb.image2, self.scale, tile_size=tile)
        return TermOutput(term, {self.stat: term.detach().float().reshape(())} if ctx.track else {})
