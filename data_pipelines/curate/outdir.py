"""Whose files are in ``mmalign curate --out``: a manifest of what curate wrote, so it never
deletes or replaces a file it did not write.

``OUT/curate_manifest.json`` is written when curate first takes a folder, and lists, after
every run, the output files that run wrote. A later run on the same folder (a resume, or
other policies) removes only the listed files before writing its own (:func:`clear_outputs`).

A folder curate may take:

- absent or empty (the lock file ``.mmalign.lock`` does not count);
- its own: it holds the manifest, or only ``pool/`` with curate's ``pool/stamp.json`` (the
  embeddings of a run that began before manifests, or copied by hand to re-decide);
- anything else only with ``--overwrite``, and then curate writes beside the files it finds
  and replaces none of them.

In every case a file that curate would write (``NNNNN.tar`` / ``.parquet``, ``sizes.json``,
``keep_keys.txt``, the reports, ``decisions.parquet``, ``pool/``) that is not in the manifest
is refused before anything is embedded or written: curate replaces only its own files.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from mmalign.dirlock import LOCK_FILE
from mmalign.errors import UsageError

MANIFEST = "curate_manifest.json"
POOL = "pool"  # embed_pass.POOL (not imported: that module imports torch)
STAMP = "stamp.json"
OUTPUT = re.compile(
    r"^(\d{5,}\.(tar|parquet)|sizes\.json|keep_keys\.txt|curate_report\.(json|html)|"
    r"decisions\.parquet|\.buckets)$"
)  # what pass 3 writes


def _read(out: Path) -> dict | None:
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise UsageError(
            f"--out: {out / MANIFEST} cannot be read ({type(e).__name__}); it lists the files curate "
            f"wrote there: restore it or use another --out"
        ) from None
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
        raise UsageError(f"--out: {out / MANIFEST} is not curate's manifest; use another --out")
    return manifest


def _write(out: Path, files: list[str]) -> None:
    tmp = out / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"written_by": "mmalign curate", "files": sorted(set(files))}, indent=1))
    os.replace(tmp, out / MANIFEST)


def claim(out: Path, overwrite: bool) -> None:
    """Rank 0, holding ``out``'s lock, before anything is embedded: refuse a folder curate may not
    write into (module docstring); else make sure it holds a manifest."""
    out.mkdir(parents=True, exist_ok=True)
    manifest = _read(out)
    entries = sorted(p.name for p in out.iterdir() if p.name not in (LOCK_FILE, MANIFEST, f".{MANIFEST}.tmp"))
    own = set(manifest["files"]) if manifest else set()
    if manifest is None and entries:
        our_pool = (
            out / POOL / STAMP
        ).is_file()  # curate's embeddings (a run from before manifests, or a copy)
        if entries != [POOL] or not our_pool:
            if not overwrite:
                shown = ", ".join(entries[:4]) + (f" (+{len(entries) - 4} more)" if len(entries) > 4 else "")
                raise UsageError(
                    f"--out: {out} is not empty ({shown}) and was not written by mmalign curate (no "
                    f"{MANIFEST}); choose a new or empty folder, or pass --overwrite to write beside "
                    f"those files (curate replaces none of them)"
                )
            if POOL in entries and not our_pool:
                raise UsageError(
                    f"--out: {out / POOL} was not written by mmalign curate (no {POOL}/{STAMP}); "
                    f"curate keeps its embeddings there: move it, or choose another --out"
                )
        if our_pool:
            own.add(POOL)
    foreign = [name for name in entries if OUTPUT.match(name) and name not in own]
    if foreign:
        raise UsageError(
            f"--out: {out / foreign[0]} was not written by mmalign curate, which would write a file of "
            f"that name ({len(foreign)} such file(s)); move them, or choose another --out"
        )
    if manifest is None:
        _write(out, sorted(own | {POOL}))


def clear_outputs(out: Path) -> None:
    """Remove the outputs the manifest lists (a previous run's), never the embeddings in ``pool/``
    and never a file it does not list."""
    manifest = _read(out) or {"files": []}
    for name in manifest["files"]:
        if name != POOL and OUTPUT.match(name):
            (out / name).unlink(missing_ok=True)
    _write(out, [POOL])


def record(out: Path, names: list[str]) -> None:
    """Add the files this run wrote to the manifest (their names, relative to ``out``)."""
    manifest = _read(out) or {"files": []}
    _write(out, list(manifest["files"]) + list(names))
