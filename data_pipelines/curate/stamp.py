"""``OUT/pool/stamp.json``: what curate's stored embeddings and hashes were computed from.

The stamp records the model (its weight files' names, sizes, mtimes and sha256; ``None`` for a
pool that was only hashed) and the shard list. A rerun with another model or other shards is
refused in one line (:func:`check_stamp`), so embeddings of two models never mix; rank 0 writes
the stamp once the model has loaded (:func:`write_stamp`: a failed start leaves none to block its
rerun) and the other ranks wait for it (:func:`wait_stamp`).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from data_pipelines.curate.embed_pass import POOL
from mmalign.errors import UsageError
from mmalign.models.locate import check_exists

STAMP = "stamp.json"


def stamp_content(opts, urls: list[str]) -> dict:
    """The model's weight files (names, sizes, mtimes) and the shard list."""
    if opts.model is None:  # hashes only
        return {"model": None, "weights": [], "urls": urls}
    model = check_exists(opts.model).resolve()  # a model name: the cache folder it resolves to
    if (model / "final").is_dir():  # a run directory: its final/ is what load() reads, not checkpoints/
        model = model / "final"
    weights = sorted(p for p in model.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    return {
        "model": str(model),
        "weights": [
            [str(p.relative_to(model)), p.stat().st_size, int(p.stat().st_mtime), _weight_hash(p)]
            for p in weights
        ],
        "urls": urls,
    }


_hashed: dict[tuple[str, int, int], str] = {}  # (path, size, mtime) -> sha256: the stamp is built twice a run


def _weight_hash(path: Path) -> str:
    """A weight file's sha256 (~1 s a GB: a line first for a large one), once per process."""
    from data_pipelines.curate.fingerprint import sha256_file

    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key not in _hashed:
        if st.st_size > 1 << 30:
            print(
                f"mmalign: curate: hashing the model's {path.name} ({st.st_size / 2**30:.1f} GiB) for its stamp",
                flush=True,
            )
        _hashed[key] = sha256_file(str(path))
    return _hashed[key]


def check_stamp(opts, urls: list[str], out: Path) -> None:
    """Refuse an ``OUT/pool`` whose embeddings came from another model or other shards."""
    path = out / POOL / STAMP
    if not path.is_file():
        return
    have, want = json.loads(path.read_text()), stamp_content(opts, urls)
    if opts.model is None or have.get("model") is None:  # hashes only, now or then
        from data_pipelines.curate.hash_pass import check_stamp as check_hashes_stamp

        return check_hashes_stamp(opts, have, want, out)
    if all(len(w) == 3 for w in have.get("weights", [])):  # a stamp from before the hash: compare what it has
        want["weights"] = [w[:3] for w in want["weights"]]
    if have != want:
        what = (
            "model"
            if have.get("model") != want["model"] or have.get("weights") != want["weights"]
            else "shards"
        )
        raise UsageError(
            f"--out: {out} holds embeddings of other {what} ({path}); use another --out, or "
            f"delete {out / POOL} to embed again"
        )


def write_stamp(opts, urls: list[str], out: Path) -> None:
    """Rank 0, once the model has loaded: a failed start leaves no stamp to block its rerun."""
    path = out / POOL / STAMP
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{STAMP}.tmp")
        tmp.write_text(json.dumps(stamp_content(opts, urls), indent=1))
        os.replace(tmp, path)


def wait_stamp(out: Path, timeout_s: float = 600.0) -> None:
    """Ranks > 0: rank 0 writes the stamp (and refuses a mismatched --out) before anyone embeds."""
    deadline = time.time() + timeout_s
    while not (out / POOL / STAMP).is_file():
        if time.time() > deadline:
            raise UsageError(f"curate: rank 0 wrote no {out / POOL / STAMP} in {timeout_s:.0f} s")
        time.sleep(0.2)
