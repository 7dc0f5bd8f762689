"""The global sample order: which sample fills row j of global batch t, for any cluster.

A run's global batch has B rows; row j of every global batch is fed by *lane* j, a
deterministic stream of its own (:class:`LaneStream`).  The lanes are a function of the
shard list, the seed and B alone: rank r of W reads the lanes of its rows
``[r B/W, (r+1) B/W)``, split over its workers, and the order of the rows never depends on
W or on the worker count.  Any layout whose world size divides B works, from one process
with gradient caching to 64 nodes x 8 GPUs x 8 workers; a resume on another world size
or worker count continues each lane where it stopped (issue 30).

This is MosaicML Streaming's "canonical nodes" idea taken to one lane per row (their
canonical nodes are fixed in the config; ours are the rows of the configured global
batch).  The other known design, a global permutation over indexed tar members (webdataset's
``wids``), needs random access: every slot reads its 1/W of each shuffle block, which from
``pipe:`` shards or HTTP without ranges means reading all of it (bench/order.py measures both:
45x the slot's share at 64 slots, 94x at 512, against the lanes' 4.5x).  A lane instead reads
a contiguous run of samples, shard after shard, sequentially.

* **epoch**: epoch e permutes the shards (seeded by (seed, e)) and concatenates their
  samples (N of them, counted once: :mod:`mmalign.data.shard_sizes`); lane j reads the
  j-th of B contiguous ranges of that sequence, of N // B or N // B + 1 samples (the
  longer ones go round the lanes in turn, so no lane drifts ahead over many epochs).  Every
  sample is read once per epoch, by one lane; B > N is refused.  A row carries its lane's
  epoch: near an epoch's end a batch may mix two, each sample still once in its own.
* **resampled**: the same, over a sequence of as many shards *drawn* (with replacement, by
  source weight, then uniformly within the source) from (seed, e): endless virtual epochs.
  Each draw starts at a random sample (wrapping round), so two draws of one shard in an epoch
  rarely feed two lanes the same samples at the same step (one sample twice in a batch).

Each lane shuffles through a buffer of ``ceil(data.shuffle_buffer / B)`` samples (drained
at each epoch end, so epochs never mix), so a worker holds its lanes' share of the run's
buffer: the memory per worker does not grow with the cluster, it shrinks.  The buffer's
picks are keyed by (seed, lane, count), a sample's augmentation by the sample
(:mod:`mmalign.data.seeds`), so no generator state is saved.  A lane's whole position is
a small JSON-able dict (:meth:`LaneStream.state`): the epoch and piece, the open piece's
byte offset, the buffer as (shard, offset, index, epoch) references re-read on resume,
the samples emitted and the skip counts.  A bad sample is a counted skip and the lane's
next sample takes its row, in every layout alike.
"""

from __future__ import annotations

import bisect
import logging
import random
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from mmalign.config import MAX_MEMBER_BYTES, ConfigError
from mmalign.data.keep_keys import SKIP_REASON as KEEP_SKIP
from mmalign.data.keep_keys import KeySet
from mmalign.data.remote import RemoteOptions, is_gzip_name, note_resume
from mmalign.data.samples import SampleProcessor
from mmalign.data.seeds import mix, sample_seed
from mmalign.data.shard_sizes import ShardIndex
from mmalign.data.shards import BadSample
from mmalign.data.tario import (
    CorruptTar,
    OpenShard,
    RawSample,
    TruncatedTar,
    iter_samples,
    open_shard,
    read_samples_at,
)

log = logging.getLogger("mmalign.data")

RESTART = (
    1 << 32
)  # resampled: a lane restarted from a pre-lane checkpoint at step t reads virtual epoch RESTART + t


@dataclass(frozen=True)
class StreamSpec:
    """Everything a worker needs to rebuild its lanes (picklable, no open files)."""

    urls: tuple[str, ...]  # all shards, sources concatenated
    sources: tuple[tuple[int, ...], ...]  # url indices per source
    weights: tuple[float, ...]  # per source (resampled mode)
    mode: str  # "resampled" | "epoch"
    seed: int
    lanes: int  # the global batch: lane j feeds row j of every global batch
    shuffle_buffer: int  # samples held for shuffling, all lanes together
    max_image_pixels: int
    index: ShardIndex = ShardIndex(
        ()
    )  # samples per shard, and where every stride-th starts (data/shard_sizes.py)
    max_consecutive_skips: int = 10_000  # bad samples in a row before a lane gives up (no usable data)
    max_member_bytes: int = MAX_MEMBER_BYTES  # larger tar members are never read (member_too_large)
    remote: RemoteOptions = RemoteOptions()  # retries, backoff and timeout of remote shards
    keep: KeySet | None = None  # data.keep_keys: only these sample keys are used (data/keep_keys.py)

    @property
    def lane_buffer(self) -> int:
        """Samples one lane holds for shuffling (its share of ``shuffle_buffer``)."""
        return max(1, -(-self.shuffle_buffer // self.lanes))

    @property
    def counts(self) -> tuple[int, ...]:
        """Samples per shard, in url order."""
        return self.index.counts

    @property
    def total(self) -> int:
        return sum(self.counts)


class EpochOrder:
    """The epoch's shard order and the prefix sums of its sample counts (one epoch cached)."""

    def __init__(self, spec: StreamSpec):
        self.spec = spec
        self._epoch: int | None = None
        self._order: list[int] = []
        self._rotation: list[int] = []  # where each occurrence starts reading its shard (resampled)
        self._ends: list[int] = []  # _ends[i]: samples in the first i + 1 shards of the order
        self._totals: dict[int, int] = {}  # resampled: epoch -> samples drawn in it
        self._shifts: dict[int, int] = {}  # resampled: epoch -> the first lane of its longer ranges

    def _build(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        sequence = shard_sequence(self.spec, epoch)
        self._epoch, self._order, self._rotation = epoch, [u for u, _ in sequence], [r for _, r in sequence]
        self._ends, total = [], 0
        for u in self._order:
            total += self.spec.counts[u]
            self._ends.append(total)
        self._totals[epoch] = total  # drawn once: _total need not draw this epoch again

    def _total(self, epoch: int) -> int:
        """Samples in ``epoch``'s sequence (every epoch's alike in epoch mode)."""
        if self.spec.mode == "epoch":
            return self.spec.total
        if epoch not in self._totals:
            self._totals[epoch] = sum(self.spec.counts[u] for u, _ in shard_sequence(self.spec, epoch))
        return self._totals[epoch]

    def _shift(self, epoch: int) -> int:
        """The first lane of ``epoch``'s longer ranges: they go round the lanes in turn, epoch
        after epoch, so no lane drifts ahead (resampled: each virtual epoch has its own total,
        so the turn is the running sum of the totals before it, mod B)."""
        lanes = self.spec.lanes
        if self.spec.mode == "epoch":
            return (epoch * (self.spec.total % lanes)) % lanes
        origin = RESTART if epoch >= RESTART else 0  # a restarted run counts from its restart
        known = max((e for e in self._shifts if origin <= e <= epoch), default=None)
        if known is None:
            known, self._shifts[origin] = origin, 0
        shift = self._shifts[known]
        for e in range(known, epoch):
            shift = (shift + self._total(e)) % lanes
            self._shifts[e + 1] = shift
        return shift

    def lane_range(self, lane: int, epoch: int) -> tuple[int, int]:
        """``(start, stop)`` of lane ``lane``'s samples in epoch ``epoch``'s sequence."""
        n, lanes = self._total(epoch), self.spec.lanes
        base, extra = divmod(n, lanes)
        shift = self._shift(epoch)  # the longer ranges: lanes shift .. shift + extra - 1 (mod B)

        def extras_before(j: int) -> int:  # lanes k < j with a longer range
            head = min(max(j - shift, 0), min(extra, lanes - shift))
            wrapped = max(shift + extra - lanes, 0)
            return head + min(j, wrapped)

        start = lane * base + extras_before(lane)
        return start, start + base + (1 if (lane - shift) % lanes < extra else 0)

    def pieces(self, lane: int, epoch: int) -> list[list[int]]:
        """Lane ``lane``'s reading for ``epoch``: ``[url, first, stop]`` sample ranges, in order.

        A shard counted empty (unreadable, or no sample) is a piece ``[url, 0, 0]`` of the lane
        whose range holds its place in the sequence: that lane opens it and counts why it
        gives nothing, once per epoch, in every layout alike."""
        self._build(epoch)
        start, stop = self.lane_range(lane, epoch)
        n = self._ends[-1] if self._ends else 0
        # the lane holding the sequence's end takes the empty shards there (lane 0 if it is empty)
        last = stop == n and (start < stop or (n == 0 and lane == 0))
        out = []
        for i in range(bisect.bisect_left(self._ends, start), len(self._order)):
            u, end = self._order[i], self._ends[i]
            begin = end - self.spec.counts[u]
            if begin > stop or (begin == stop and not (last and begin == end)):
                break
            if begin == end:  # an empty shard at position `begin`
                if begin >= start:
                    out.append([u, 0, 0])
                continue
            first, final = max(start, begin), min(stop, end)
            if final > first:
                out += _rotated(u, first - begin, final - begin, self._rotation[i], self.spec.counts[u])
        return out


def _rotated(u: int, first: int, stop: int, rotation: int, count: int) -> list[list[int]]:
    """Samples ``[first, stop)`` of an occurrence that starts reading its shard at ``rotation``,
    as forward ranges of the shard (two when it wraps past the shard's end)."""
    a = (first + rotation) % count
    b = a + (stop - first)
    return [[u, a, b]] if b <= count else [[u, a, count], [u, 0, b - count]]


def shard_sequence(spec: StreamSpec, epoch: int) -> list[tuple[int, int]]:
    """The shards of ``epoch`` in reading order, each with the sample it starts at: a
    permutation of all, from their first samples (epoch mode); or as many draws with
    replacement, by source weight then uniformly within the source (resampled), each from a
    random sample on (wrapping round), so that two draws of one shard in an epoch do not feed
    two lanes the same samples in lockstep (one sample twice in a batch)."""
    if spec.mode == "epoch":
        order = list(range(len(spec.urls)))
        random.Random(mix(spec.seed, 0xE90C, epoch)).shuffle(order)
        return [(u, 0) for u in order]
    rng = random.Random(mix(spec.seed, 0x5A3D, epoch))
    sources = range(len(spec.sources))
    out = []
    for _ in spec.urls:
        source = rng.choices(sources, weights=spec.weights)[0] if len(spec.sources) > 1 else 0
        u = rng.choice(spec.sources[source])
        out.append((u, rng.randrange(spec.counts[u]) if spec.counts[u] else 0))
    return out


class NoSamples(Exception):
    """A lane found nothing to read (all shards empty or unreadable, or too few samples)."""


def check_resumable(spec: StreamSpec, states: dict) -> None:
    """Refuse exact resume inside a gzip shard: every re-read would decompress it from its start.

    ``states``: lane -> stream state.  Only states that re-open a shard mid-way count
    (buffered samples, or an open shard past its first byte).
    """
    for state in states.values():
        urls = [ref[0] for ref in state.get("buffer", [])]
        shard = state.get("shard")
        if shard is not None and shard.get("offset", 0) > 0:
            urls.append(shard["url"])
        for url in urls:
            if is_gzip_name(spec.urls[url]):
                raise ConfigError(
                    f"config key 'data.train': cannot resume exactly inside gzip shard "
                    f"{spec.urls[url]} (each re-read decompresses it from its start); "
                    "store shards as plain .tar to resume runs"
                )


class LaneStream:
    """One lane: its samples, shuffled through its buffer, with a resumable position.

    ``close_between_fills``: a worker with many lanes closes each lane's shard after every
    refill of its buffer (re-opened at the saved byte offset), so its open files stay few.
    """

    def __init__(
        self,
        spec: StreamSpec,
        lane: int,
        processor: SampleProcessor,
        state: dict | None = None,
        order: EpochOrder | None = None,
        close_between_fills: bool = False,
    ):
        self.spec = spec
        self.lane = lane
        self.process = processor
        self.order = order or EpochOrder(spec)
        self.close_between_fills = close_between_fills
        state = state or {}
        self.epoch = int(state.get("epoch", 0))  # epoch mode
        self.cursor = int(state.get("cursor", 0))  # next piece of the epoch / next draw
        self.shard: dict[str, Any] | None = state.get(
            "shard"
        )  # open piece: {url, offset, index, first, stop, start} or None
        self.emitted = int(state.get("emitted", 0))  # samples taken out of the buffer so far
        self.skipped: dict[str, int] = dict(state.get("skipped", {}))
        self._reader: Iterator[RawSample] | None = None
        self._file: OpenShard | None = (
            None  # the open shard's file (set by _refill when it re-read buffered samples from it)
        )
        # The buffer holds raw samples plus the url index and the epoch each belongs to.
        self.buffer: list[tuple[RawSample, int, int]] = self._refill(state.get("buffer", []))
        self._empty_reads = 0  # consecutive pieces read that gave no sample

    # ------------------------------------------------------------ state

    def state(self) -> dict:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "shard": None if self.shard is None else dict(self.shard),
            "emitted": self.emitted,
            "skipped": dict(self.skipped),
            "buffer": [[url, raw.offset, raw.index, epoch] for raw, url, epoch in self.buffer],
        }

    def _refill(self, refs: list) -> list[tuple[RawSample, int, int]]:
        """The shuffle buffer of a checkpoint, re-read: each shard opened once and read forward.

        Samples of the shard this lane was reading are re-read on the file it then goes on
        reading from (they all lie before its saved offset), so that shard is opened once too.
        """
        by_shard: dict[
            int, dict[tuple[int, int], list[int]]
        ] = {}  # url -> (offset, index) -> buffer positions
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
                raise NoSamples(
                    f"cannot re-read the buffered samples of {path} on resume: {type(e).__name__}: {e}"
                ) from None
            if url == current and not self.close_between_fills:
                self._file = f
            else:
                f.close()
        return buffer

    # ------------------------------------------------------------ reading

    def skip(self, reason: str, where: str, detail: str = "", count: int = 1) -> None:
        total = self.skipped.get(reason, 0) + count
        self.skipped[reason] = total
        if total <= 3 or total & (total - 1) == 0:  # the first few, then at powers of two
            log.warning(
                "skipped sample (%s, %d so far on lane %d): %s %s", reason, total, self.lane, where, detail
            )

    def _next_piece(self) -> bool:
        """Open the next piece; False at the end of the (virtual, when resampled) epoch."""
        plan = self.order.pieces(self.lane, self.epoch)
        if self.cursor >= len(plan):
            return False
        url, first, stop = plan[self.cursor]
        self.cursor += 1
        offset, index = self.spec.index.start(url, first)  # seek near `first`
        self.shard = {
            "url": url,
            "offset": offset,
            "index": index,
            "first": first,
            "stop": stop,
            "start": offset,
        }
        return True

    def _close(self, keep_position: bool = False) -> None:
        if self._file is not None:
            self._file.close()
        self._file, self._reader = None, None
        if not keep_position:
            self.shard = None

    def _read_one(self) -> RawSample | None:
        """The next raw sample of this lane's epoch/stream; None at the end of an epoch."""
        while True:
            if self.shard is None and not self._next_piece():
                return None
            sh = self.shard
            assert sh is not None  # _next_piece opened one
            path = self.spec.urls[sh["url"]]
            try:
                if self._reader is None:
                    if sh["offset"] > sh.get("start", 0):  # a resumed piece, or one re-opened after a fill
                        note_resume(path)
                    if self._file is None:
                        self._file = open_shard(path, self.spec.remote)
                    first, stop = sh["first"], sh["stop"]
                    self._reader = iter_samples(
                        self._file,
                        sh["offset"],
                        sh["index"],
                        keep=lambda i, a=first, b=stop: a <= i < b,
                        max_member=self.spec.max_member_bytes,
                    )
                for raw in self._reader:
                    if raw.index >= sh["stop"]:
                        break  # the rest of the shard is other lanes' (or uncounted: never read)
                    sh["offset"], sh["index"] = raw.end, raw.index + 1
                    if raw.index >= sh["first"]:
                        self._empty_reads = 0
                        return raw
                else:
                    missing = sh["stop"] - max(sh["index"], sh["first"])
                    if missing > 0:  # the shard holds fewer than counted
                        self.skip("shard_shorter_than_counted", path, f"{missing} sample(s)", missing)
            except TruncatedTar as e:
                self.skip("truncated_tar", path, str(e))
            except (CorruptTar, OSError, ValueError, EOFError) as e:  # EOFError: a cut .tar.gz
                self.skip("unreadable_shard", path, f"{type(e).__name__}: {e}")
            self._close()
            self._empty_reads += 1
            if self._empty_reads > 2 * len(self.spec.urls) + 16:
                raise NoSamples(f"lane {self.lane} read {self._empty_reads} shards in a row without a sample")

    def _fill(self) -> None:
        keep = self.spec.keep
        while len(self.buffer) < self.spec.lane_buffer:
            raw = self._read_one()
            if raw is None:
                break
            if keep is not None and raw.key.rsplit("/", 1)[-1] not in keep:
                # dropped before the buffer, so it takes no shuffle slot; counted, not logged (it is asked for)
                self.skipped[KEEP_SKIP] = self.skipped.get(KEEP_SKIP, 0) + 1
                continue
            assert self.shard is not None  # the piece raw was read from
            self.buffer.append((raw, self.shard["url"], self.epoch))
        if self.close_between_fills and self.shard is not None:
            self._close(keep_position=True)

    def samples(self) -> Iterator[tuple[dict, int]]:
        """Endless (row, epoch) pairs; bad samples are counted and skipped."""
        taken, empty_epochs = 0, 0
        bad_run = 0  # samples skipped in a row: shards with no usable sample must not spin forever
        while True:
            self._fill()
            if not self.buffer:  # this lane's epoch is done and drained
                empty_epochs = 0 if taken else empty_epochs + 1
                if empty_epochs > 4 * len(self.spec.urls) + 8:
                    why = (
                        "all shards empty or unreadable, or no sample of them is in data.keep_keys"
                        if self.spec.keep is not None
                        else "all shards empty or unreadable"
                    )
                    raise NoSamples(
                        f"lane {self.lane} of {self.spec.lanes} found no sample in {empty_epochs} "
                        f"epochs: {why}"
                    )
                self.epoch, self.cursor, taken = self.epoch + 1, 0, 0
                continue
            i = mix(self.spec.seed, 0x5B0F, self.lane, self.emitted) % len(self.buffer)
            self.buffer[i], self.buffer[-1] = self.buffer[-1], self.buffer[i]
            raw, url, epoch = self.buffer.pop()
            taken += 1
            self.emitted += 1
            if raw.unsafe:  # a name that would extract outside its folder: never read
                self.skip(
                    "unsafe_name", f"{self.spec.urls[url]}:{raw.key}", "would extract outside its folder"
                )
                continue
            if raw.oversized:  # its big member was never read
                self.skip(
                    "member_too_large",
                    f"{self.spec.urls[url]}:{raw.key}",
                    ", ".join(f".{e} {n} bytes" for e, n in raw.oversized.items()),
                )
                continue
            try:
                row = self.process(
                    raw.key, raw.members, sample_seed(self.spec.seed, epoch, raw.key.rsplit("/", 1)[-1])
                )
            except BadSample as e:
                self.skip(e.reason, f"{self.spec.urls[url]}:{raw.key}", str(e))
                bad_run += 1
                if bad_run >= self.spec.max_consecutive_skips:
                    reasons = ", ".join(
                        f"{k} {v}" for k, v in sorted(self.skipped.items(), key=lambda kv: -kv[1])
                    )
                    raise NoSamples(
                        f"lane {self.lane}: {bad_run} samples in a row were skipped, no usable sample "
                        f"(skips so far: {reasons}); check the shards or raise "
                        f"data.max_consecutive_skips"
                    ) from None
                continue
            bad_run = 0
            yield row, epoch
