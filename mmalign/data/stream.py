"""One slot's resumable sample stream: which shards, which samples, in which order.

A *slot* is one (rank, worker) pair; ``slot = rank * workers + worker`` among
``S = world_size * workers``.  Each slot owns a deterministic stream:

* **resampled**: the d-th shard of slot s is drawn (with replacement, by source
  weight, then uniformly within the source) from a generator seeded by (seed, s, d).
  Endless, no epochs; fewer shards than slots is harmless.
* **epoch**: epoch e permutes all shards with a generator seeded by (seed, e); slot s
  reads shards ``order[s::S]``.  With fewer shards than slots, slot s reads shard
  ``order[s % N]`` and keeps every c-th sample of it (c = the slots sharing that
  shard), so every sample is read exactly once per epoch, by exactly one slot.

Samples pass through a shuffle buffer (drained at each epoch end, so epochs never
mix).  The stream's whole position is a small JSON-able dict (:meth:`SlotStream.state`):
the epoch or draw count, the open shard's byte offset and sample index, the buffer
as (shard, offset, index) references that are re-read on resume, the shuffle
generator's state, the number of samples emitted and the skip counts.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass

from mmalign.config import MAX_MEMBER_BYTES, ConfigError
from mmalign.data.remote import RemoteOptions, is_gzip_name, note_resume
from mmalign.data.samples import SampleProcessor
from mmalign.data.shards import BadSample
from mmalign.data.tario import CorruptTar, RawSample, TruncatedTar, iter_samples, open_shard, read_samples_at

log = logging.getLogger("mmalign.data")

_MASK = (1 << 64) - 1


def mix(*parts: int) -> int:
    """A 64-bit seed from integers (splitmix64 finalizer over a running combination)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & _MASK)) * 0xBF58476D1CE4E5B9 & _MASK
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & _MASK
        x ^= x >> 29
    return x


@dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs to rebuild its stream (picklable, no open files)."""

    urls: tuple[str, ...]  # all shards, sources concatenated
    sources: tuple[tuple[int, ...], ...]  # url indices per source
    weights: tuple[float, ...]  # per source (resampled mode)
    mode: str  # "resampled" | "epoch"
    seed: int
    world_size: int
    workers: int  # >= 1 (0 DataLoader workers count as 1 slot per rank)
    batch_size: int
    shuffle_buffer: int
    max_image_pixels: int
    max_consecutive_skips: int = 10_000  # bad samples in a row before the slot gives up (no usable data)
    max_member_bytes: int = MAX_MEMBER_BYTES  # larger tar members are never read (member_too_large)
    remote: RemoteOptions = RemoteOptions()  # retries, backoff and timeout of remote shards

    @property
    def slots(self) -> int:
        return self.world_size * self.workers


def epoch_plan(spec: StreamSpec, slot: int, epoch: int) -> list[tuple[int, int, int]]:
    """Slot ``slot``'s shards for ``epoch`` as (url index, stride, phase) triples."""
    order = list(range(len(spec.urls)))
    random.Random(mix(spec.seed, 0xE90C, epoch)).shuffle(order)
    n, s = len(order), spec.slots
    if n >= s:
        return [(u, 1, 0) for u in order[slot::s]]
    sharing = len(range(slot % n, s, n))  # slots that split this shard by sample
    return [(order[slot % n], sharing, slot // n)]


def draw_shard(spec: StreamSpec, slot: int, draw: int) -> int:
    rng = random.Random(mix(spec.seed, 0x5A3D, slot, draw))
    source = rng.choices(range(len(spec.sources)), weights=spec.weights)[0] if len(spec.sources) > 1 else 0
    return rng.choice(spec.sources[source])


class NoSamples(Exception):
    """The slot found nothing to read (all shards empty or unreadable, or too few samples)."""


def check_resumable(spec: StreamSpec, states: dict) -> None:
    """Refuse exact resume inside a gzip shard: every re-read would decompress it from its start.

    ``states``: slot -> stream state.  Only states that re-open a shard mid-way count
    (buffered samples, or an open shard past its first byte).
    """
    for state in states.values():
        urls = [ref[0] for ref in state.get("buffer", [])]
        shard = state.get("shard")
        if shard is not None and shard.get("offset", 0) > 0:
            urls.append(shard["url"])
        for url in urls:
            if is_gzip_name(spec.urls[url]):
                raise ConfigError(f"config key 'data.train': cannot resume exactly inside gzip shard "
                                  f"{spec.urls[url]} (each re-read decompresses it from its start); "
                                  "store shards as plain .tar to resume runs")


class SlotStream:
    def __init__(self, spec: StreamSpec, slot: int, processor: SampleProcessor, state: dict | None = None):
        self.spec = spec
        self.slot = slot
        self.process = processor
        state = state or {}
        self.epoch = int(state.get("epoch", 0))  # epoch mode
        self.cursor = int(state.get("cursor", 0))  # next entry of the epoch plan / next draw
        self.shard = state.get("shard")  # open shard: {url, offset, index, stride, phase} or None
        self.emitted = int(state.get("emitted", 0))  # samples taken out of the buffer so far
        self.skipped: dict[str, int] = dict(state.get("skipped", {}))
        # epoch -> explicit pieces [url, stride, phase, offset, index] replacing epoch_plan for
        # that epoch (set when a resume changed the slot layout: mmalign.data.resharding)
        self.plans: dict[int, list] = {int(e): [list(x) for x in p] for e, p in state.get("plans", {}).items()}
        self.rng = random.Random()
        if "rng" in state:
            version, internal, gauss = state["rng"]
            self.rng.setstate((version, tuple(internal), gauss))
        else:
            self.rng.seed(mix(spec.seed, 0x5B0F, slot))
        self._reader: Iterator[RawSample] | None = None
        self._file = None  # the open shard's file (set by _refill when it re-read buffered samples from it)
        # The buffer holds raw samples plus the url index and the epoch each belongs to.
        self.buffer: list[tuple[RawSample, int, int]] = self._refill(state.get("buffer", []))
        self._empty_reads = 0  # consecutive shard reads that gave no sample

    # ------------------------------------------------------------ state

    def state(self) -> dict:
        version, internal, gauss = self.rng.getstate()
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "shard": None if self.shard is None else dict(self.shard),
            "emitted": self.emitted,
            "skipped": dict(self.skipped),
            "rng": [version, list(internal), gauss],
            "buffer": [[url, raw.offset, raw.index, epoch] for raw, url, epoch in self.buffer],
            **({"plans": {str(e): p for e, p in self.plans.items()}} if self.plans else {}),
        }

    def _refill(self, refs: list) -> list[tuple[RawSample, int, int]]:
        """The shuffle buffer of a checkpoint, re-read: each shard opened once and read forward.

        Samples of the shard this slot was reading are re-read on the file it then goes on
        reading from (they all lie before its saved offset), so that shard is opened once too.
        """
        by_shard: dict[int, dict[tuple[int, int], list[int]]] = {}  # url -> (offset, index) -> buffer positions
        for position, (url, offset, index, _epoch) in enumerate(refs):
            by_shard.setdefault(int(url), {}).setdefault((int(offset), int(index)), []).append(position)
        buffer: list = [None] * len(refs)
        current = self.shard["url"] if self.shard is not None else None
        for url, wanted in by_shard.items():
            path = self.spec.urls[url]
            note_resume(path)
            f = open_shard(path, self.spec.remote)
            try:
                for raw in read_samples_at(f, list(wanted), self.spec.max_member_bytes):
                    for position in wanted[(raw.offset, raw.index)]:
                        buffer[position] = (raw, url, int(refs[position][3]))
            except (TruncatedTar, CorruptTar, OSError, ValueError, EOFError) as e:
                f.close()
                raise NoSamples(f"cannot re-read the buffered samples of {path} on resume: "
                                f"{type(e).__name__}: {e}") from None
            if url == current:
                self._file = f
            else:
                f.close()
        return buffer

    # ------------------------------------------------------------ reading

    def skip(self, reason: str, where: str, detail: str = "") -> None:
        count = self.skipped.get(reason, 0) + 1
        self.skipped[reason] = count
        if count <= 3 or count & (count - 1) == 0:  # the first few, then at powers of two
            log.warning("skipped sample (%s, %d so far on slot %d): %s %s", reason, count, self.slot, where, detail)

    def _next_shard(self) -> bool:
        """Open the next shard; False at the end of the epoch (epoch mode)."""
        offset = index = 0
        if self.spec.mode == "epoch":
            plan = self.plans.get(self.epoch)
            if plan is None:
                plan = epoch_plan(self.spec, self.slot, self.epoch)
            if self.cursor >= len(plan):
                return False
            url, stride, phase, *start = plan[self.cursor]
            offset, index = start or (0, 0)
        else:
            url, stride, phase = draw_shard(self.spec, self.slot, self.cursor), 1, 0
        self.cursor += 1
        self.shard = {"url": url, "offset": offset, "index": index, "stride": stride, "phase": phase}
        return True

    def _close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._reader, self.shard = None, None, None

    def _read_one(self) -> RawSample | None:
        """The next raw sample of this slot's epoch/stream; None at the end of an epoch."""
        while True:
            if self.shard is None and not self._next_shard():
                return None
            sh = self.shard
            path = self.spec.urls[sh["url"]]
            try:
                if self._reader is None:
                    if sh["offset"]:  # only a resumed shard starts past its first byte
                        note_resume(path)
                    if self._file is None:
                        self._file = open_shard(path, self.spec.remote)
                    stride, phase = sh["stride"], sh["phase"]
                    keep = None if stride == 1 else (lambda i, s=stride, p=phase: i % s == p)
                    self._reader = iter_samples(self._file, sh["offset"], sh["index"], keep=keep,
                                                max_member=self.spec.max_member_bytes)
                for raw in self._reader:
                    sh["offset"], sh["index"] = raw.end, raw.index + 1
                    if sh["stride"] == 1 or raw.index % sh["stride"] == sh["phase"]:
                        self._empty_reads = 0
                        return raw
            except TruncatedTar as e:
                self.skip("truncated_tar", path, str(e))
            except (CorruptTar, OSError, ValueError, EOFError) as e:  # EOFError: a cut .tar.gz
                self.skip("unreadable_shard", path, f"{type(e).__name__}: {e}")
            self._close()
            self._empty_reads += 1
            if self._empty_reads > 2 * len(self.spec.urls) + 16:
                raise NoSamples(f"slot {self.slot} read {self._empty_reads} shards in a row without a sample")

    def _fill(self) -> None:
        while len(self.buffer) < self.spec.shuffle_buffer:
            raw = self._read_one()
            if raw is None:
                return
            url = self.shard["url"] if self.shard is not None else None
            self.buffer.append((raw, url, self.epoch))

    def samples(self) -> Iterator[tuple[dict, int]]:
        """Endless (row, epoch) pairs; bad samples are counted and skipped."""
        taken, empty_epochs = 0, 0
        bad_run = 0  # samples skipped in a row: shards with no usable sample must not spin forever
        while True:
            self._fill()
            if not self.buffer:  # epoch mode: this slot's epoch is done and drained
                empty_epochs = 0 if taken else empty_epochs + 1
                if empty_epochs > 4 * len(self.spec.urls) + 8:
                    raise NoSamples(
                        f"slot {self.slot} of {self.spec.slots} (ranks x workers) found no sample in "
                        f"{empty_epochs} epochs: too few samples for that many workers, or all shards unreadable"
                    )
                self.plans.pop(self.epoch, None)
                self.epoch, self.cursor, taken = self.epoch + 1, 0, 0
                continue
            i = self.rng.randrange(len(self.buffer))
            self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
            raw, url, epoch = self.buffer.pop()
            taken += 1
            sample_rng = random.Random(mix(self.spec.seed, 0x5A4F, self.slot, self.emitted))
            self.emitted += 1
            if raw.oversized:  # its big member was never read
                self.skip("member_too_large", f"{self.spec.urls[url]}:{raw.key}",
                          ", ".join(f".{e} {n} bytes" for e, n in raw.oversized.items()))
                continue
            try:
                row = self.process(raw.key, raw.members, sample_rng)
            except BadSample as e:
                self.skip(e.reason, f"{self.spec.urls[url]}:{raw.key}", str(e))
                bad_run += 1
                if bad_run >= self.spec.max_consecutive_skips:
                    reasons = ", ".join(f"{k} {v}" for k, v in sorted(self.skipped.items(), key=lambda kv: -kv[1]))
                    raise NoSamples(f"slot {self.slot}: {bad_run} samples in a row were skipped, no usable sample "
                                    f"(skips so far: {reasons}); check the shards or raise "
                                    f"data.max_consecutive_skips") from None
                continue
            bad_run = 0
            yield row, epoch
