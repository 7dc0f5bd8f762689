"""Query by an indexed item's key ("more like this" on the search page).

The image index holds each image once, and ``image_rows.npy`` maps an index position to
its metadata row; a key names a sample, so the item's image is the position whose row has
that key.  Its vector is read back from the index itself (``reconstruct``): an exact
index returns the stored vector, an IVF-PQ index its decoded code (close enough to rank
neighbours by), once the index's id -> list map is built.  Neither the model nor the
embedding directory is needed.  The key -> position table is built on the first query
and kept per searcher; building it takes a lock (an IVF shard's direct map is the index's own lock), the
rest only reads, so concurrent key queries need no lock of the caller's.
"""

from __future__ import annotations

import threading
import weakref

import numpy as np

from mmalign.errors import UsageError

_POSITIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # searcher -> {key: image index position}
_BUILD = threading.Lock()  # one table build at a time


def _positions(searcher) -> dict[str, int]:
    table = _POSITIONS.get(searcher)
    if table is None:
        with _BUILD:
            table = _POSITIONS.get(searcher)
            if table is None:
                keys = searcher.table.column("key")[
                    searcher.rows["image"]
                ]  # (n_images,) key of each position
                table = {}
                for position, key in enumerate(keys):
                    table.setdefault(str(key), position)  # a key repeated across shards: its first image
                _POSITIONS[searcher] = table
    return table


def key_vector(searcher, key: str) -> np.ndarray | None:
    """(D,) float32 unit vector of the image of the item ``key``; None when no indexed image has it."""
    if "image" not in searcher.indexes:
        raise UsageError("a key query needs the image index, and this index directory has none")
    position = _positions(searcher).get(key)
    if position is None:
        return None
    vector = searcher.indexes["image"].reconstruct(position)  # thread-safe, direct map included
    vector = np.asarray(vector, dtype=np.float32)
    return vector / max(float(np.linalg.norm(vector)), 1e-12)
