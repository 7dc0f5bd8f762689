"""Images on ``mmalign serve``: a query image decoded within bounds, a hit's thumbnail.

Both read the image's header before decoding it (:func:`mmalign.data.shards.open_image`):
too many pixels or too thin a shape is a 413 the client can read, an unreadable body a 400,
a stored image that cannot be read back a 404.
"""

from __future__ import annotations

import io

from mmalign.errors import UsageError
from mmalign.search.searcher import ImageUnavailable
from mmalign.search.serve_origin import Refused


def query_image(data: bytes, max_pixels: int, what: str):
    """Encoded image bytes -> a PIL image; a bomb or a too thin one 413, unreadable 400."""
    from mmalign.data.shards import BadSample, open_image

    try:
        return open_image(data, max_pixels)  # the pixel count is checked before decoding
    except BadSample as e:
        if e.reason == "decompression_bomb":
            raise Refused(413, f"image has too many pixels ({e}); at most {max_pixels}") from None
        if e.reason == "extreme_aspect":  # a resize would blow it up: refused from its header
            raise Refused(413, f"image is too thin ({e})") from None
        raise UsageError(f"{what} is not a readable image ({e.reason})") from None


def thumbnail(searcher, row: int, size: int, max_bytes: int, max_pixels: int) -> bytes:
    """A JPEG of metadata row ``row``'s image, at most ``size`` px a side; 404 when unreadable."""
    from PIL import Image

    from mmalign.data.shards import BadSample, open_image

    try:
        data = searcher.image_bytes(row, max_bytes)  # no model or index
        image = open_image(data, max_pixels)  # the pixel count is checked before decoding
    except ImageUnavailable as e:
        raise Refused(404, str(e)) from None
    except BadSample as e:
        raise Refused(404, f"row {row}: the stored image is not readable ({e.reason})") from None
    image = image.convert("RGB")
    image.thumbnail((size, size), Image.Resampling.BICUBIC)
    buf = io.BytesIO()
    image.save(buf, format="JPEG", quality=85)
    return buf.getvalue()
