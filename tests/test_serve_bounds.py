"""serve's adversarial bounds, with a stub searcher (no model): a thin image is a 413 from its
header; duplicate or conflicting body lengths are a 400; JSON replies say nosniff."""

from __future__ import annotations

import io
import json
import time
import urllib.error
import urllib.request

import pytest
from PIL import Image

from tests.test_serve import _png, _raw, server  # noqa: F401  (the fixture)


def _post(srv, body: bytes):
    request = urllib.request.Request(f"{srv.base}/search?k=1", data=body, method="POST")
    return urllib.request.urlopen(request, timeout=5)


@pytest.mark.parametrize("server", [{"max_pixels": 40_000_000}], indirect=True)
def test_a_thin_image_is_a_413_from_its_header(server):
    strip = _png((1, 20000))  # 20,000 pixels, far under the pixel cap; 4.9 GB resized at 224
    assert Image.open(io.BytesIO(strip)).size == (1, 20000)
    start = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as e:
        _post(server, strip)
    assert e.value.code == 413 and time.monotonic() - start < 2
    assert e.value.headers["Content-Type"] == "application/json"
    message = json.loads(e.value.read())["error"]
    assert "thin" in message and "1x20000" in message
    assert server.stub.images == []  # never reached the model
    with _post(server, _png((40, 2))) as r:  # 20:1, the bound itself, is served
        assert json.loads(r.read())["hits"][0]["key"] == "40x2"
