"""What each sample-order design costs a reader: bytes read, files opened, samples held (a script, not a test).

Two ways to give every run the same global order on any cluster (issue 30) are compared on
one epoch of synthetic shards, per reading slot (one rank's DataLoader worker; W ranks x K
workers = W*K slots), for a global batch B and a shuffle size S:

* **lanes** (what mmalign does, mmalign/data/stream.py; MosaicML Streaming's "canonical
  nodes" taken to one per row): row j of every global batch comes from lane j, which reads
  the j-th of B contiguous ranges of the epoch's shard sequence, sequentially, through a
  buffer of ceil(S/B) samples.  A slot runs its rows' lanes.  This is the real code: one
  ``LaneStream`` per lane, driven round-robin as a loader worker drives them, with
  ``open_shard`` wrapped to count what is read.
* **global permutation** (webdataset's ``wids``: an index of the tar members, one shuffled
  order of all samples; here shuffled within blocks of S consecutive samples, the locality
  ``wids``' ChunkedSampler keeps by shuffling within chunks): the epoch's sequence (the same
  shard permutation, concatenated) with each block of S positions permuted; global batch t
  is positions [tB, (t+1)B); a slot owns the same rows as above.  This is a simulation
  written here: for each block the slot reads its samples in offset order, each by seeking
  to it with the index (``tario.iter_samples`` from its offset), keeping a shard open while
  the next block still reads it, and holds each sample until its batch is due.

Per slot it reports, over one epoch:

* bytes read, as a multiple of the dataset's bytes / slots (1.0 = only its share):
  (a) *seek free*: only bytes that ``read()`` returned (local files, or ranged reads at no cost);
  (b) *gaps read through*: a stream that cannot seek (a ``pipe:`` shard, an HTTP server
  that ignores ranges): every skipped gap is read too, and a file re-opened at an offset is
  read from its start again;
  (c) *HTTP with ranges*: what :class:`mmalign.data.remote.RemoteFile` fetches from a server that
  honours ranges: an open or a forward gap over ``remote.SKIP`` is a new range request (free),
  a shorter gap is read and dropped;
* files opened (``open_shard`` calls);
* peak raw samples held (lanes: all its lane buffers plus the one being processed;
  permutation: its samples of the block read but not yet due).

Every slot of every layout is simulated (``--few-slots``: slot 0 and the middle one); the table
gives the mean over the slots and, in brackets, the worst slot.  No wall time is measured; the
numbers do not depend on the machine's load.

    .venv/bin/python bench/order.py                 # prints the table
    .venv/bin/python bench/order.py --write-doc     # ... and updates docs/benchmarks.md
"""

from __future__ import annotations

import io
import random
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

import mmalign.data.stream as stream_mod
from bench.harness import DOC, LoadWatch, command, parser, write_section
from mmalign.data import tario
from mmalign.data.loader import (
    DEFAULT_WORKER_BATCH,
    MAX_OPEN_LANES,
    lane_split,
    open_file_budget,
    worker_shares,
)
from mmalign.data.remote import SKIP, WINDOW
from mmalign.data.shard_sizes import STRIDE, shard_sizes
from mmalign.data.stream import EpochOrder, LaneStream, StreamSpec, shard_sequence

SECTION = "## Sample order designs (bench/order.py)"
LAYOUTS = ((1, 1), (8, 1), (8, 8), (64, 8))
WORDS = "a photo of the red green blue small large cat dog car tree house river sky bird boat".split()

# ------------------------------------------------------------------ data


def make_shards(out: Path, shards: int, per_shard: int, seed: int = 0) -> list[str]:
    """``shards`` tars of ``per_shard`` samples: KEY.jpg (3-5 KiB of random bytes; never decoded) + KEY.txt."""
    rng = random.Random(seed)
    paths = []
    for s in range(shards):
        path = out / f"{s:05d}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(per_shard):
                key = f"{s:05d}{i:05d}"
                caption = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 12))).encode()
                for ext, data in (("jpg", rng.randbytes(rng.randint(3 << 10, 5 << 10))), ("txt", caption)):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        paths.append(str(path))
    return paths


def index_shards(paths: list[str]) -> list[list[int]]:
    """Per shard, the byte offset of each sample's first header (what ``wids``' index holds); not counted."""
    out = []
    for path in paths:
        with open(path, "rb") as f:
            out.append([raw.offset for raw in tario.iter_samples(f)])
    return out


# ------------------------------------------------------------------ counting


@dataclass
class Tally:
    returned: int = 0  # (a) bytes read() returned
    through: int = 0  # (b) bytes a stream that cannot seek delivers
    ranged: int = 0  # (c) bytes a RemoteFile over an HTTP server that honours ranges fetches
    opens: int = 0


class Counted:
    """A shard file that counts what reading it costs, three ways (see the module doc).

    (b) ``at`` is how far a sequential stream of this file has delivered: a read past it pays
    the gap, one before it within ``WINDOW`` is served from the bytes last read, one further
    back re-runs the stream from byte 0 (what RemoteFile does for pipe: shards).
    (c) ``http_at`` is where a ranged HTTP stream stands, as RemoteFile._position moves it: the
    first read, a gap over ``SKIP`` or a seek back past the window re-requests at the offset (no
    bytes paid), a forward gap up to ``SKIP`` is read and dropped."""

    def __init__(self, f, tally: Tally):
        self.f, self.tally = f, tally
        self.pos = self.at = 0
        self.http_at: int | None = None
        tally.opens += 1

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = self.f.seek(offset, whence)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        end = self.pos + len(data)
        self.tally.returned += len(data)
        if self.pos < self.at - WINDOW:  # far back: the stream starts again
            self.at = 0
        if end > self.at:
            self.tally.through += end - self.at
            self.at = end
        h = self.http_at
        if h is None or self.pos < h - WINDOW or self.pos - h > SKIP:
            h = self.pos  # a range request at the offset
        if end > h:
            self.tally.ranged += end - h
            h = end
        self.http_at = h
        self.pos = end
        return data

    def close(self) -> None:
        self.f.close()


TALLY = Tally()
_open_shard = stream_mod.open_shard


def counting_open(path, remote=None):  # LaneStream opens every shard through stream.open_shard
    return Counted(_open_shard(path, remote), TALLY)


stream_mod.open_shard = counting_open


def keyed(key, members, seed):
    """Stands in for SampleProcessor: nothing is decoded, the row is the sample's key."""
    return {"key": key}


# ------------------------------------------------------------------ the two designs


def slot_rows(B: int, W: int, K: int, slot: int) -> list[int]:
    """The rows (= lanes) of global batch that slot ``slot`` = (rank, worker) reads, as the loader splits them."""
    rank, worker = divmod(slot, K)
    local = B // W
    pieces = lane_split(rank, local, worker_shares(local, K, min(local, DEFAULT_WORKER_BATCH)))[worker]
    return [lane for piece in pieces for lane in piece]


def run_lanes(spec: StreamSpec, rows: list[int]) -> tuple[Tally, int, list[str]]:
    """One epoch of the slot's lanes with the real LaneStream, one sample per lane per round."""
    global TALLY
    TALLY = Tally()
    order = EpochOrder(spec)
    many = len(rows) > min(MAX_OPEN_LANES, open_file_budget(len(rows)))  # as loader._Lanes decides it (local)
    streams = [LaneStream(spec, lane, keyed, order=order, close_between_fills=many) for lane in rows]
    gens = [s.samples() for s in streams]
    todo = [order.lane_range(lane, 0)[1] - order.lane_range(lane, 0)[0] for lane in rows]
    keys, peak = [], 0
    for step in range(max(todo)):
        for _s, g, n in zip(streams, gens, todo):
            if step < n:
                row, epoch = next(g)
                assert epoch == 0
                keys.append(row["key"])
                peak = max(peak, sum(len(x.buffer) for x in streams) + 1)  # + the one just taken
    for s, g in zip(streams, gens):
        g.close()
        s._close()
    return TALLY, peak, keys


def permuted_sequence(spec: StreamSpec, S: int, seed: int) -> tuple[list[tuple[int, int]], list[int]]:
    """The epoch's global order: (shard, index) at each position, and each position's place in
    the unshuffled concatenation (its offset order)."""
    concat = [(u, i) for u, _ in shard_sequence(spec, 0) for i in range(spec.counts[u])]
    place = list(range(len(concat)))
    rng = random.Random(seed)
    for start in range(0, len(place), S):
        block = place[start : start + S]
        rng.shuffle(block)
        place[start : start + S] = block
    return [concat[q] for q in place], place


def run_permutation(
    spec: StreamSpec, seq, place, offsets, rows: list[int], B: int, S: int
) -> tuple[Tally, int, list[str]]:
    tally, mine = Tally(), set(rows)
    files: dict[int, Counted] = {}
    keys, peak = [], 0
    for start in range(0, len(seq), S):
        positions = [p for p in range(start, min(len(seq), start + S)) if p % B in mine]
        shards = {seq[p][0] for p in positions}
        for u in [u for u in files if u not in shards]:  # a shard the block no longer reads
            files.pop(u).close()
        pending: dict[int, str] = {}
        due = 0
        for p in sorted(positions, key=place.__getitem__):  # offset order
            u, i = seq[p]
            if u not in files:
                files[u] = Counted(open(spec.urls[u], "rb"), tally)
            # keep: only sample i's data (the reader still looks at the next header to see i end)
            raw = next(tario.iter_samples(files[u], offsets[u][i], i, keep=i.__eq__))
            assert raw.index == i and raw.members
            pending[p] = raw.key
            peak = max(peak, len(pending))
            while due < len(positions) and positions[due] in pending:  # emitted in batch order
                keys.append(pending.pop(positions[due]))
                due += 1
        assert not pending
    for f in files.values():
        f.close()
    return tally, peak, keys


# ------------------------------------------------------------------ the table


def measure(args) -> tuple[list[dict], str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        urls = make_shards(Path(tmp), args.shards, args.per_shard)
        offsets = index_shards(urls)  # every sample's offset: the permutation's index
        counts = [len(o) for o in offsets]
        index = shard_sizes(
            urls
        )  # the lanes' own: counts and every STRIDE-th offset, as the loader reads them
        assert list(index.counts) == counts
        data_bytes = sum(Path(u).stat().st_size for u in urls)
        n = sum(counts)
        what = (
            f"{args.shards} shards x {args.per_shard} samples (KEY.jpg 3-5 KiB random bytes + KEY.txt), "
            f"{data_bytes / 2**20:.1f} MiB"
        )
        print(what, flush=True)
        results = []
        for W, K in LAYOUTS:
            slots = W * K
            spec = StreamSpec(
                urls=tuple(urls),
                sources=(tuple(range(len(urls))),),
                weights=(1.0,),
                mode="epoch",
                seed=args.seed,
                lanes=args.batch,
                shuffle_buffer=args.shuffle,
                max_image_pixels=1 << 30,
                index=index,
            )
            seq, place = permuted_sequence(spec, args.shuffle, args.seed)
            share = data_bytes / slots
            seen: dict[str, list[str]] = {}
            chosen = sorted({0, slots // 2}) if args.few_slots else range(slots)
            for slot in chosen:
                rows = slot_rows(args.batch, W, K, slot)
                for design, run in (
                    ("lanes", lambda: run_lanes(spec, rows)),
                    (
                        "permutation",
                        lambda: run_permutation(spec, seq, place, offsets, rows, args.batch, args.shuffle),
                    ),
                ):
                    tally, peak, keys = run()
                    assert len(keys) == len(set(keys)), design
                    r = {
                        "W": W,
                        "K": K,
                        "slot": slot,
                        "rows": len(rows),
                        "design": design,
                        "a": tally.returned / share,
                        "b": tally.through / share,
                        "c": tally.ranged / share,
                        "opens": tally.opens,
                        "peak": peak,
                    }
                    results.append(r)
                    seen.setdefault(design, []).extend(keys)
                    if slot in (0, slots // 2):
                        print(
                            f"{W}x{K} slot {slot} ({len(rows)} rows) {design}: (a) {r['a']:.2f}x, (b) {r['b']:.2f}x, "
                            f"(c) {r['c']:.2f}x, {r['opens']} opens, peak {peak} samples",
                            flush=True,
                        )
            if not args.few_slots:  # the slots together read every sample once, in both designs
                assert all(len(set(k)) == len(k) == n for k in seen.values()), {
                    d: len(k) for d, k in seen.items()
                }
        return results, what, data_bytes / len(urls) / 2**20


def table(results: list[dict]) -> str:
    lines = [
        "| W x K (slots) | rows (lanes) per slot | design | bytes read, seek free (x share) | "
        "bytes read, gaps read through (x share) | bytes read, HTTP with ranges (x share) | files opened per slot | peak raw samples held per slot |",
        "|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["W"], r["K"], r["design"]), []).append(r)
    for (W, K, design), rs in groups.items():

        def cell(key, fmt):
            values = [r[key] for r in rs]
            mean = format(sum(values) / len(values), fmt)
            return mean if len(values) == 1 else f"{mean} ({format(max(values), fmt)})"

        lines.append(
            f"| {W} x {K} ({W * K}) | {rs[0]['rows']} | {design} | {cell('a', '.2f')} | {cell('b', '.2f')} | "
            f"{cell('c', '.2f')} | {cell('opens', '.0f')} | {max(r['peak'] for r in rs)} |"
        )
    return "\n".join(lines)


def reading(results: list[dict], args, shard_mib: float) -> str:
    """The paragraph under the table: what it shows, its numbers taken from the results."""

    def get(layout, design, key, how="mean"):
        values = [r[key] for r in results if (r["W"], r["K"], r["design"]) == (*layout, design)]
        return max(values) if how == "max" else sum(values) / len(values)

    def span(values) -> str:
        lo, hi = f"{min(values):.2f}", f"{max(values):.2f}"
        return lo if lo == hi else f"{lo}-{hi}"

    one, few, mid, big = LAYOUTS
    rest = LAYOUTS[1:]
    n = args.shards * args.per_shard
    lanes_a = [get(lay, "lanes", "a") for lay in LAYOUTS]
    lanes_b = [get(lay, "lanes", "b") for lay in LAYOUTS]
    lanes_c = [get(lay, "lanes", "c") for lay in LAYOUTS]
    return (
        f"Seek free (local files), the permutation reads {span([get(lay, 'permutation', 'a') for lay in LAYOUTS])}x "
        f"its share at every layout (it seeks to each sample through its index) and the lanes {span(lanes_a)}x "
        f"(a lane seeks to the indexed offset nearest below its first sample, every "
        f"{STRIDE}th, and reads the headers from there; a pipe: shard cannot seek). With gaps read through (pipe:, HTTP that ignores ranges) "
        f"the permutation's bytes grow with the slots ("
        + ", ".join(f"{get(lay, 'permutation', 'b'):.1f}x at {lay[0]} x {lay[1]}" for lay in rest)
        + f"), the lanes' are {span(lanes_b)}x; over HTTP with ranges (shards of {shard_mib:.1f} MiB) the "
        f"permutation reads {span([get(lay, 'permutation', 'c') for lay in rest])}x from {few[0]} x {few[1]} up, "
        f"the lanes {span(lanes_c)}x. At 1 x 1 the permutation reads {get(one, 'permutation', 'b'):.2f}x and "
        f"opens {get(one, 'permutation', 'opens'):.0f} files, the lanes {get(one, 'lanes', 'b'):.2f}x with "
        f"{get(one, 'lanes', 'opens'):.0f} opens ({args.batch} lanes in one worker, {n} samples). Held: the "
        f"lanes about one sample per lane ({get(one, 'lanes', 'peak', 'max'):.0f} at 1 x 1, "
        f"{get(big, 'lanes', 'peak', 'max'):.0f} at {big[0]} x {big[1]}), the permutation up to its share of a "
        f"block ({get(one, 'permutation', 'peak', 'max'):.0f} at 1 x 1, "
        f"{get(few, 'permutation', 'peak', 'max'):.0f} at {few[0]} x {few[1]})."
    )


def main() -> None:
    # --allow-loaded is accepted like every doc-writing bench; these are counts, not timings, so load does not matter
    p = parser(__doc__, full=True, write_doc="")
    p.add_argument("--shards", type=int, default=64)
    p.add_argument("--per-shard", type=int, default=200)
    p.add_argument("--batch", type=int, default=512, help="the global batch B (lanes)")
    p.add_argument(
        "--shuffle", type=int, default=1000, help="S: the shuffle buffer (lanes) / block (permutation)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--few-slots", action="store_true", help="only slot 0 and the middle slot of each layout (else all)"
    )
    args = p.parse_args()
    watch = LoadWatch()
    cmd = command()
    results, what, shard_mib = measure(args)
    # the paragraph's wording (which layout is special, and why) holds for the default sizes only
    default = all(getattr(args, k) == p.get_default(k) for k in ("shards", "per_shard", "batch", "shuffle"))
    said = (
        reading(results, args, shard_mib)
        if default
        else "(The reading of the table is written for the default sizes; none for these.)"
    )
    slots_said = (
        "slot 0 and the middle slot, their mean and (in brackets) the larger"
        if args.few_slots
        else "every slot simulated, the mean over the slots and (in brackets) the worst slot"
    )
    body = (
        f"Command: `{cmd}` · data: {what} · global batch B = {args.batch}, S = {args.shuffle} (lanes: shuffle "
        f"buffer, ceil(S/B) = {-(-args.shuffle // args.batch)} per lane; permutation: shuffle block), epoch mode, "
        f"one epoch, seed {args.seed}. Counts, not times: they do not depend on the machine's load.\n\n"
        f"Per slot (one rank's DataLoader worker; W ranks x K workers), {slots_said}: bytes read "
        f"as a multiple of the dataset's bytes / slots (1.00 = only its share; peak held: the largest), (a) seek free: only bytes that "
        f"read() returned (local files), (b) gaps read through: also every skipped gap and, on a re-open at an "
        f"offset, the bytes before it (pipe: shards, HTTP that ignores ranges), (c) HTTP with ranges: as "
        f"RemoteFile reads, a gap over remote.SKIP = {SKIP >> 20} MiB or a re-open is a free range request, a "
        f"shorter gap is read through. Lanes: "
        f"the real LaneStream (one per row the slot owns, round-robin, open_shard wrapped to count). "
        f"Permutation: a simulation of a wids-style global order (index of sample offsets, each block of S "
        f"consecutive positions of the shard-permuted sequence shuffled, batch t = positions [tB, (t+1)B), the "
        f"slot's rows as the lanes'), read per block in offset order by seeking to each sample, a shard kept open "
        f"while the next block reads it, each sample held until its batch is due.\n\n"
        + table(results)
        + "\n\n"
        + said
        + "\n"
    )
    print()
    print(table(results))
    print()
    print(said)
    if args.write_doc:
        # counts, not timings: the load guard does not apply (allow_loaded), nor its note (note=False)
        write_section(DOC, f"{SECTION}\n\n{body.strip()}\n", watch, args.allow_loaded, note=False)
        print(f"\nwrote {DOC}")


if __name__ == "__main__":
    main()
