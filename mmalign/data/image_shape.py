"""The bound on an image's shape, checked from its header before it is decoded or resized.

The eval transform scales the *shorter* side to S, so a 1 x N image becomes S x S*N: a
1 x 20000 PNG of a few hundred bytes costs 4.9 GB at S = 224, and the pixel cap
(``data.max_image_pixels``) does not see it.  At most ``MAX_ASPECT``:1 keeps a resized image
at S x 20*S pixels (3 MB at 224); every photo, web banner (728 x 90 is 8:1) and most
panoramas pass.  A thinner strip is a counted skip (``extreme_aspect``) when data is read,
one line from ``embed``/``search``, and a 413 from ``serve``.
"""

from __future__ import annotations

MAX_ASPECT = 20  # longer side / shorter side; a wider panorama must be cropped or split first


class ImageShapeError(ValueError):
    """An image too thin to resize safely (see :func:`shape_problem`)."""


def shape_problem(width: int, height: int) -> str | None:
    """Why a ``width`` x ``height`` image must not be resized (from its header: before decoding), or None."""
    if min(width, height) < 1:
        return f"{width}x{height} has no pixels"
    if max(width, height) > MAX_ASPECT * min(width, height):
        ratio = max(width, height) / min(width, height)
        return f"{width}x{height} is {ratio:.0f}:1, thinner than {MAX_ASPECT}:1"
    return None
