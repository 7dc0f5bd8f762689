"""The resumable rank protocol that ``mmalign embed --out`` and ``--teacher-shards`` share.

A work folder under ``OUT`` holds ``stamp.json`` (rank 0 writes it after its own checks; other
ranks wait for it; another stamp = a one-line refusal) and one done file per finished unit. Rank r
takes units r, r + W, ... that have no done file; rank 0 then waits until every unit has one. No
process group is started: the files are the synchronisation. What a unit is, where its done file
lives and what the command finally writes stay with each command (:mod:`.embed`,
:mod:`.embed_teacher`); this module owns only the stamp, the done files' bookkeeping and the waits.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mmalign.errors import UsageError
from mmalign.search.embed_inputs import Units

STAMP = "stamp.json"

__all__ = ["STAMP", "WorkFolder", "launch_rank", "stamp_content", "write_json"]


def launch_rank(rank: int | None, world: int | None) -> tuple[int, int]:
    """``(rank, world)`` as given, else the launcher's (``RANK`` / ``WORLD_SIZE``, SLURM's), else 0 / 1."""
    if rank is not None and world is not None:
        return rank, world
    from mmalign.dist.distributed import env_dist_info

    dist = env_dist_info()
    return dist.rank, dist.world_size


def write_json(path: Path, content: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(content, indent=2))
    os.replace(tmp, path)  # whole or absent: a kill never leaves half a file that reads as done


def stamp_content(model_dir, units: Units, part_size: int) -> dict:
    """The model's weight files (names, sizes, mtimes), the units and the part size."""
    from mmalign.models.locate import check_exists

    model = check_exists(model_dir).resolve()  # a model name: the cache folder it resolves to
    if (model / "final").is_dir():  # a run directory: its final/ is what load() reads
        model = model / "final"
    weights = sorted(p for p in model.rglob("*") if p.suffix in (".safetensors", ".bin", ".pt", ".pth"))
    return {
        "model": str(model),
        "weights": [[str(p.relative_to(model)), p.stat().st_size, p.stat().st_mtime_ns] for p in weights],
        "units": units.names,
        "text": units.with_text,
        "part_size": int(part_size),
    }


@dataclass(frozen=True)
class WorkFolder:
    """``OUT/<name>/``: the stamp and the done files one command's ranks coordinate through.

    ``done_file(u)`` is unit ``u``'s done file; ``verb`` ("embedded", "copied") words the lines;
    ``mismatch(have, want)`` is the one-line refusal of a stamp from other arguments."""

    out: Path
    name: str
    done_file: Callable[[int], Path]
    verb: str
    mismatch: Callable[[dict, dict], str]

    @property
    def folder(self) -> Path:
        return self.out / self.name

    @property
    def stamp_path(self) -> Path:
        return self.folder / STAMP

    def done(self, n: int) -> set[int]:
        return {u for u in range(n) if self.done_file(u).is_file()}

    def check_stamp(self, want: dict) -> bool:
        """True when the folder has a stamp (and it matches: else one line)."""
        if not self.stamp_path.is_file():
            return False
        have = json.loads(self.stamp_path.read_text())
        if have != want:
            raise UsageError(self.mismatch(have, want))
        return True

    def start(self, stamp: dict, n: int, rank: int, world: int) -> tuple[bool, list[int]]:
        """(stamped, this rank's units still to do); rank 0 says how many a resume skips."""
        stamped = self.check_stamp(stamp)
        done = self.done(n) if stamped else set()
        if rank == 0 and done:
            print(
                f"mmalign: embed: resuming {self.out}: {len(done)} of {n} shard(s) already {self.verb}",
                flush=True,
            )
        return stamped, [u for u in range(rank, n, world) if u not in done]

    def publish_stamp(self, stamp: dict, stamped: bool, rank: int, timeout_s: float = 600.0) -> None:
        """Rank 0 writes the stamp (after its own checks); the others wait for it before working."""
        if rank == 0:
            if not stamped:
                self.folder.mkdir(parents=True, exist_ok=True)
                write_json(self.stamp_path, stamp)
            return
        deadline = time.time() + timeout_s
        while not self.check_stamp(stamp):
            if time.time() > deadline:
                raise UsageError(f"embed: rank 0 wrote no {self.stamp_path} in {timeout_s:.0f} s")
            time.sleep(0.2)

    def wait_for_all(self, n: int, stall_timeout_s: float, example: bool = True) -> None:
        """Rank 0: until every unit has its done file; a one-line error after a stall
        (``example``: the line names the first missing unit)."""
        done = len(self.done(n))
        if done < n:
            print(f"mmalign: embed: waiting for the other ranks' {n - done} shard(s)", flush=True)
        last_change = time.time()
        while done < n:
            time.sleep(0.5)
            now = len(self.done(n))
            if now != done:
                done, last_change = now, time.time()
            elif time.time() - last_change > stall_timeout_s:
                missing = sorted(set(range(n)) - self.done(n))
                which = f" (e.g. shard {missing[0]})" if example else ""
                raise UsageError(
                    f"embed: {len(missing)} shard(s) not {self.verb} after {stall_timeout_s:.0f} s without "
                    f"progress{which}; another rank stopped? run again to resume"
                )
