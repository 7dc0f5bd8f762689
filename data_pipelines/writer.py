"""Write img2dataset-layout shards.

Per shard ``NNNNN``: ``NNNNN.tar`` with ``KEY.jpg``, ``KEY.txt`` and ``KEY.json``
members, ``NNNNN.parquet`` (one row per sample) and ``NNNNN_stats.json``; after
the last shard, ``sizes.json`` maps each tar name to its sample count.  Keys are
the shard id followed by the zero-padded index in the shard, as img2dataset makes them.
A sample that could not be made (:meth:`ShardWriter.fail`) is a parquet row with
``status="failed"`` and its error, and counts in its shard's ``failures``.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
import time
from pathlib import Path

import pandas as pd
from PIL import Image

INDEX_DIGITS = 4  # samples per shard < 10**4


class ShardWriter:
    def __init__(self, out_dir: str | Path, samples_per_shard: int = 1000, jpeg_quality: int = 92):
        if not 0 < samples_per_shard <= 10**INDEX_DIGITS:
            raise ValueError(f"samples_per_shard must be in 1..{10**INDEX_DIGITS}")
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.per_shard = samples_per_shard
        self.quality = jpeg_quality
        self.shard = -1
        self.sizes: dict[str, int] = {}
        self._tar: tarfile.TarFile | None = None
        self._rows: list[dict] = []
        self._failures = 0
        self._started = 0.0

    def _open_next(self) -> None:
        self._close_current()
        self.shard += 1
        self._tar = tarfile.open(self.out / f"{self.shard:05d}.tar", "w")
        self._rows = []
        self._failures = 0
        self._started = time.time()

    def _add_member(self, name: str, data: bytes) -> None:
        assert self._tar is not None  # write() opens a shard before its first member
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        info.mtime = 0  # reproducible shards
        self._tar.addfile(info, io.BytesIO(data))

    def write(self, image: Image.Image, caption: str, meta: dict | None = None) -> str:
        """Add one sample; ``caption`` may hold several captions, one per line."""
        buf = io.BytesIO()
        image.convert("RGB").save(buf, format="JPEG", quality=self.quality)
        return self.write_encoded(buf.getvalue(), caption, meta, width=image.width, height=image.height)

    def write_encoded(
        self, jpg: bytes, caption: str, meta: dict | None = None, *, width: int, height: int
    ) -> str:
        """Add one sample whose JPEG bytes are already made (e.g. by a pool of encoders)."""
        if self._tar is None or len(self._rows) - self._failures >= self.per_shard:
            self._open_next()
        key = f"{self.shard:05d}{len(self._rows) - self._failures:0{INDEX_DIGITS}d}"
        sha = hashlib.sha256(jpg).hexdigest()
        record = {"key": key, "caption": caption, "width": width, "height": height, "sha256": sha}
        record.update(meta or {})
        self._add_member(f"{key}.jpg", jpg)
        self._add_member(f"{key}.txt", caption.encode("utf-8"))
        self._add_member(f"{key}.json", json.dumps(record, sort_keys=True).encode("utf-8"))
        self._rows.append({**record, "status": "success", "error_message": None})
        return key

    def fail(self, error: str, meta: dict | None = None) -> None:
        """Record a sample that could not be written (counted in the current shard's stats)."""
        if self._tar is None:
            self._open_next()
        self._rows.append(
            {
                "key": None,
                "caption": None,
                "width": None,
                "height": None,
                "sha256": None,
                **(meta or {}),
                "status": "failed",
                "error_message": error,
            }
        )
        self._failures += 1

    def _close_current(self) -> None:
        if self._tar is None:
            return
        self._tar.close()
        name = f"{self.shard:05d}"
        table = pd.DataFrame(self._rows)
        for column in table.columns:  # mixed-type metadata columns would not make a parquet column
            if table[column].dtype == object and table[column].map(type).nunique() > 1:
                table[column] = table[column].map(lambda v: None if v is None else str(v))
        table.to_parquet(self.out / f"{name}.parquet", index=False)
        successes = len(self._rows) - self._failures
        stats = {
            "count": len(self._rows),
            "successes": successes,
            "failures": self._failures,
            "duration": round(time.time() - self._started, 3),
        }
        (self.out / f"{name}_stats.json").write_text(json.dumps(stats, indent=2))
        self.sizes[f"{name}.tar"] = successes
        self._tar = None

    def close(self) -> dict[str, int]:
        self._close_current()
        (self.out / "sizes.json").write_text(json.dumps(self.sizes, indent=2))
        return self.sizes

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
