"""The training loader: streams batches from tar shards and resumes exactly.

Row j of every global batch is lane j's next sample (mmalign/data/stream.py); a rank reads
the lanes of its rows, ``[rank B_local, (rank + 1) B_local)``.  Workers decode, augment and
tokenize; each piece they send arrives with the states of its lanes *after* it.  The main
process keeps, per lane, the state that came with the last piece of the last local batch the
training loop actually took, so :meth:`StreamingLoader.state_dict` reflects consumed batches
only, however far the DataLoader has prefetched.

A local batch of B rows takes B // K consecutive lanes (one more for the first B mod K) from
each of the K workers, in the same number c of pieces per worker, each piece at most
``data.worker_batch_size`` rows (:func:`worker_shares`, :func:`lane_split`).  PyTorch's
in-order DataLoader takes one piece from each worker in turn, so a local batch is exactly c
rounds; the main process orders the rows by worker, which is lane order.  A batch's rows
therefore depend on the global batch only, never on the world size, the worker count or the
piece size: a run resumes exactly on another layout.  Pieces keep the memory in flight (K
workers x prefetch x piece) independent of the local batch; images travel as uint8.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import signal
import sys
from collections.abc import Callable, Generator, Iterator

from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmalign.config import ConfigError, DataConfig
from mmalign.data.batch import Batch
from mmalign.data.remote import RemoteOptions, kind_of
from mmalign.data.samples import SampleProcessor, merge
from mmalign.data.shard_sizes import ShardIndex, shard_sizes
from mmalign.data.shards import check_urls, expand_urls
from mmalign.data.stream import EpochOrder, LaneStream, NoSamples, StreamSpec, check_resumable
from mmalign.data.teacher_members import check_teacher_members

log = logging.getLogger("mmalign.data")

# 3: one stream per row of the global batch (lanes), layout-free (1, 2: one stream per rank and
# worker; such a state restarts its lanes at its step: mmalign.data.resharding.from_slots)
STATE_VERSION = 3
# A worker keeps each lane's shard open (one file, or one HTTP stream) unless it has more lanes
# than this (remote: MAX_OPEN_REMOTE_LANES) or than its open-file limit allows; then each lane's
# shard is closed between buffer refills and re-opened at its byte offset.
MAX_OPEN_LANES = 4096
MAX_OPEN_REMOTE_LANES = 64  # connections per worker to a shard server
FD_HEADROOM = 256  # descriptors left for everything else in a worker
DEFAULT_WORKER_BATCH = 256


def worker_shares(batch_size: int, workers: int, piece: int) -> list[list[int]]:
    """Rows of one local batch, per worker as the sizes of the pieces it sends, in order.

    Worker w gives ``batch_size // workers`` rows (one more when w < batch_size mod
    workers), split into c near-equal pieces of at most ``piece`` rows; every worker
    sends the same c (a worker with fewer rows sends smaller, possibly empty, pieces),
    so the DataLoader's round-robin lines up with local batches.
    """
    base, extra = divmod(batch_size, workers)
    rows = [base + (w < extra) for w in range(workers)]
    pieces = -(-rows[0] // piece)  # rows[0] is the largest share
    return [[r // pieces + (j < r % pieces) for j in range(pieces)] for r in rows]


def lane_split(rank: int, batch_size: int, shares: list[list[int]]) -> list[list[range]]:
    """Per worker, the lanes of each piece it sends: rank ``rank``'s lanes are
    ``[rank B_local, (rank + 1) B_local)``, worker w takes the next ``sum(shares[w])`` of them,
    in pieces of ``shares[w]`` lanes."""
    out, lane = [], rank * batch_size
    for sizes in shares:
        pieces = []
        for size in sizes:
            pieces.append(range(lane, lane + size))
            lane += size
        out.append(pieces)
    return out


def open_file_budget(wanted: int) -> int:
    """Files this process may hold open for ``wanted`` lanes: its soft limit, raised towards the
    hard one first where that is short (any process may), less :data:`FD_HEADROOM`."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_HEADROOM
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return wanted if soft == resource.RLIM_INFINITY else soft - FD_HEADROOM


class _Lanes(IterableDataset):
    """What each DataLoader worker runs: its lanes, one sample of each per local batch, in pieces."""

    def __init__(self, spec: StreamSpec, processor: SampleProcessor, pieces: list[list[range]], states: dict):
        self.spec, self.processor, self.pieces, self.states = spec, processor, pieces, states

    def __iter__(self) -> Iterator[tuple[Batch | None, dict]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None:
            # PIL's own decompression-bomb limit, explicit, in the worker process only: the
            # training process keeps PIL's default (evaluation reads through it) and the
            # per-sample check in shards.open_image applies data.max_image_pixels everywhere.
            Image.MAX_IMAGE_PIXELS = self.spec.max_image_pixels
        mine = [lane for piece in self.pieces[worker] for lane in piece]
        try:
            order = EpochOrder(self.spec)  # shared by this worker's lanes (one epoch's prefix sums)
            remote = any(kind_of(u) != "local" for u in self.spec.urls)
            many = len(mine) > min(
                MAX_OPEN_REMOTE_LANES if remote else MAX_OPEN_LANES, open_file_budget(len(mine))
            )
            streams = {
                lane: LaneStream(
                    self.spec, lane, self.processor, self.states.get(lane), order, close_between_fills=many
                )
                for lane in mine
            }
            samples = {lane: stream.samples() for lane, stream in streams.items()}
            while True:
                for piece in self.pieces[worker]:
                    taken = [
                        next(samples[lane]) for lane in piece
                    ]  # row j of the piece: its lane's next sample
                    rows, epochs = [r for r, _ in taken], [e for _, e in taken]
                    batch = self.processor.collate(rows, epochs) if rows else None  # Batch or None
                    yield batch, {"states": {lane: streams[lane].state() for lane in piece}}
        except NoSamples as e:  # reported by the main process as a one-line error
            yield None, {"error": str(e)}


def _worker_init(_worker_id: int) -> None:
    """A DataLoader worker dies with the training process, however that ends.

    A worker notices a dead parent only between batches (PyTorch polls every 5 s), and
    one batch can take minutes while a shuffle buffer fills; so on Linux the kernel is
    asked to SIGTERM the worker when its parent exits (even on SIGKILL). The trainer's
    SIGTERM handler (raise SystemExit, inherited through fork) is reset to the default
    here: a worker told to stop just stops.
    """
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG = 1
        except (OSError, AttributeError):  # no prctl: PyTorch's own polling remains
            pass


class StreamingLoader:
    """Iterable of :class:`~mmalign.data.batch.Batch` with ``state_dict``/``load_state_dict``
    and ``skipped``.

    A batch: ``images`` (B,3,H,W), ``tokens`` (B,L), ``captions``, ``keys``, ``epochs``
    (B,), optional ``ids`` (B,), ``images2`` (B,3,H,W), ``neg_tokens`` (B,k,L) with
    ``neg_mask`` (B,k) (mined hard negatives), and ``skipped`` (the
    run's skip counts so far, by reason).  Iterating is endless; iterating again
    continues after the last consumed batch.
    """

    def __init__(
        self,
        spec: StreamSpec,
        processor: SampleProcessor,
        *,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 1,
        prefetch_factor: int = 2,
        pin_memory: bool = False,
        worker_batch_size: int = DEFAULT_WORKER_BATCH,
    ):
        if spec.lanes % world_size:
            raise ConfigError(
                f"the global batch ({spec.lanes}) must be a multiple of the world size ({world_size})"
            )
        self.spec = spec
        self.processor = processor
        self.rank = rank
        self.world_size = world_size
        self.batch_size = (
            spec.lanes // world_size
        )  # this rank's rows: lanes [rank B_local, (rank + 1) B_local)
        self.num_workers = num_workers  # DataLoader processes; 0 = read in this process
        self.workers = max(1, num_workers)
        self.prefetch_factor = prefetch_factor  # pieces in flight per worker
        self.pin_memory = pin_memory  # batches assembled in pinned memory (CUDA training)
        self.shares = worker_shares(self.batch_size, self.workers, max(1, worker_batch_size))
        self.pieces = lane_split(rank, self.batch_size, self.shares)
        self.lanes = range(rank * self.batch_size, (rank + 1) * self.batch_size)
        self._states: dict[int, dict] = {}  # lane -> stream state after its last consumed batch
        self._consumed = 0  # batches consumed from this rank's loader

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Generator[Batch, None, None]:
        dataset = _Lanes(self.spec, self.processor, self.pieces, dict(self._states))
        if self.num_workers == 0:
            source = iter(dataset)
        else:
            source = iter(
                DataLoader(
                    dataset,
                    batch_size=None,
                    num_workers=self.num_workers,
                    prefetch_factor=self.prefetch_factor,
                    persistent_workers=False,
                    worker_init_fn=_worker_init,
                )
            )
        rounds, workers = len(self.shares[0]), self.workers
        try:
            while True:
                pieces: list[list[Batch | None]] = [[] for _ in range(workers)]  # per worker, in its order
                states = {}
                for _ in range(rounds):
                    for w in range(workers):  # the DataLoader's round-robin
                        item = next(source, None)
                        if item is None:
                            return
                        piece, info = item
                        if "error" in info:
                            raise ConfigError(f"config key 'data.train': {info['error']}")
                        states.update(info["states"])
                        pieces[w].append(piece)
                batch = merge([p for parts in pieces for p in parts], self.pin_memory)  # rows in lane order
                self._states.update(states)
                self._consumed += 1
                batch.skipped = self.skipped()
                yield batch
        finally:
            # closing this iterator (or an error) stops the workers now, not at garbage collection
            shutdown = getattr(source, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()

    def skipped(self) -> dict[str, int]:
        """Samples skipped so far by reason, summed over this rank's lanes (consumed batches only)."""
        total: dict[str, int] = {}
        for state in self._states.values():
            for reason, count in state["skipped"].items():
                total[reason] = total.get(reason, 0) + count
        return dict(sorted(total.items()))

    @property
    def epoch(self) -> int:
        """The epoch every lane of this rank has reached (epoch mode; 0 before any batch)."""
        return min((s["epoch"] for s in self._states.values()), default=0)

    # ------------------------------------------------------------ state

    def _fingerprint(self) -> str:
        return hashlib.sha256("\n".join(self.spec.urls).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        """JSON-serialisable position of this rank's lanes after the consumed batches."""
        return {
            "version": STATE_VERSION,
            "mode": self.spec.mode,
            "seed": self.spec.seed,
            "lanes": self.spec.lanes,
            "shards": self._fingerprint(),
            "rank": self.rank,
            "world_size": self.world_size,
            "consumed": self._consumed,
            "lane_states": {str(lane): state for lane, state in sorted(self._states.items())},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batches ``state`` records.

        ``state`` may hold the lanes of other ranks too (a resume on another world size merges
        every old rank's lanes: :func:`mmalign.data.resharding.convert`); this rank takes its
        own, whatever the old world size and worker count were.  A state written before lanes
        (version 1 or 2: one stream per rank and worker) cannot continue the same order; its
        lanes restart at the step it records (:func:`mmalign.data.resharding.from_slots`)."""
        from mmalign.data.resharding import from_slots

        version = state.get("version")
        if version in (1, 2):
            step = int(state.get("consumed", 0))
            state = from_slots([state], self.spec, step, into=self.lanes[0])
            if self.rank == 0:
                log.warning(
                    "the checkpoint's data position predates lanes (one stream per rank and worker): the "
                    "data order restarts at step %d (%s)",
                    step,
                    "shard draws start afresh"
                    if self.spec.mode == "resampled"
                    else "the epoch in progress starts over",
                )
        elif version != STATE_VERSION:
            raise ConfigError(f"loader state version {version!r} is not {STATE_VERSION}")
        mine = {
            "mode": self.spec.mode,
            "seed": self.spec.seed,
            "lanes": self.spec.lanes,
            "shards": self._fingerprint(),
        }
        for key, value in mine.items():
            if state.get(key) != value:
                what = "global batch (lanes)" if key == "lanes" else key
                raise ConfigError(
                    f"cannot resume the data stream: the checkpoint has {what}={state.get(key)!r}, this run {value!r} "
                    "(exact resume needs the same shards, seed, mode and global batch; ranks and workers may change)"
                )
        lanes = {int(lane): s for lane, s in state["lane_states"].items()}
        missing = [lane for lane in self.lanes if lane not in lanes]
        if len(missing) not in (0, len(self.lanes)):
            raise ConfigError(
                f"cannot resume the data stream: the checkpoint lacks lanes {missing[:4]} of rank "
                f"{self.rank} (a loader file of the checkpoint is missing)"
            )
        mine_states = {lane: lanes[lane] for lane in self.lanes if lane in lanes}
        check_resumable(self.spec, mine_states)
        self._states = mine_states
        self._consumed = int(state.get("consumed", 0))


# ---------------------------------------------------------------- building


def _keep_keys(data: DataConfig, lanes: int):
    """``data.keep_keys``'s KeySet (None when unset); fewer keys than one global batch is refused,
    since an epoch could not fill every row of a batch once."""
    if data.keep_keys is None:
        return None
    from mmalign.data.keep_keys import KeySet

    keep = KeySet.read(data.keep_keys)
    if len(keep) < lanes:
        raise ConfigError(
            f"config key 'data.keep_keys': {data.keep_keys} lists {len(keep)} keys, fewer than one "
            f"global batch ({lanes})"
        )
    log.info(
        "data.keep_keys: %d sample keys from %s; other samples are skipped (counted as not_in_keep_keys)",
        len(keep),
        data.keep_keys,
    )
    return keep


def _remote_options(data: DataConfig) -> RemoteOptions:
    return RemoteOptions(data.remote_retries, data.remote_backoff, data.remote_timeout)


def _sources(data: DataConfig) -> tuple[list[str], list[tuple[int, ...]], list[float]]:
    specs = data.train if isinstance(data.train, list) else [data.train]
    remote = _remote_options(data)
    if data.train_weights is None:
        urls = expand_urls(specs)
        check_urls(urls, "data.train", remote)
        return urls, [tuple(range(len(urls)))], [1.0]
    urls, sources = [], []
    for i, spec in enumerate(specs):
        part = expand_urls(spec)
        check_urls(part, f"data.train[{i}]", remote)
        sources.append(tuple(range(len(urls), len(urls) + len(part))))
        urls.extend(part)
    return urls, sources, [float(w) for w in data.train_weights]


def train_counts(data: DataConfig) -> ShardIndex:
    """Samples per shard of ``data.train`` (the global order is built from them): counted once,
    by rank 0, and shared (``counts=`` of :func:`build_train_loader` on every rank)."""
    urls, _, _ = _sources(data)
    return shard_sizes(urls, _remote_options(data), data.max_member_bytes)


def build_train_loader(
    data: DataConfig | list[str],
    transform: Callable,
    tokenizer: Callable,
    batch_size: int,
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    workers: int | None = None,
    shuffle_buffer: int | None = None,
    grad_cache_chunk: int = 0,
    pin_memory: bool = False,
    counts: ShardIndex | None = None,
    teacher: bool = False,
) -> StreamingLoader:
    """This rank's loader of ``batch_size`` rows (the per-rank batch) from ``data`` (a DataConfig).

    The global batch (``batch_size x world_size``) fixes the lanes and so the order
    (mmalign/data/stream.py); the world size and worker count only decide who reads which.
    A plain list of shard paths is accepted too (resampled mode, DataConfig defaults).
    ``workers``/``shuffle_buffer`` override the config's values when given.  Workers send
    pieces of at most ``data.worker_batch_size`` rows; 0 means ``grad_cache_chunk`` (the
    gradient-cache chunk, when caching) or else min(batch_size, 256).  ``pin_memory``: on
    CUDA, assemble batches in pinned memory for asynchronous copies.  ``counts``: the
    shards' :class:`~mmalign.data.shard_sizes.ShardIndex` (counts and offsets), when the caller counted them already (rank 0, for all);
    else they are counted here (:func:`mmalign.data.shard_sizes.shard_sizes`).
    ``teacher``: read each sample's stored teacher embeddings (``loss.distill.teacher: stored``,
    :mod:`mmalign.data.teacher_members`); shards without them are one line here.
    """
    if not isinstance(data, DataConfig):
        data = DataConfig(train=list(data))
    urls, sources, weights = _sources(data)
    num_workers = data.workers if workers is None else workers
    buffer = data.shuffle_buffer if shuffle_buffer is None else shuffle_buffer
    if batch_size <= 0:
        raise ConfigError(f"the per-rank batch size must be > 0, got {batch_size}")
    lanes = batch_size * world_size
    index = counts if counts is not None else shard_sizes(urls, _remote_options(data), data.max_member_bytes)
    if sum(index.counts) < lanes:
        raise ConfigError(
            f"config key 'data.train': {sum(index.counts)} samples in {len(urls)} shard(s), fewer than "
            f"one global batch ({lanes}): too few samples (each epoch must fill every row of a "
            f"batch once)"
        )
    spec = StreamSpec(
        urls=tuple(urls),
        sources=tuple(sources),
        weights=tuple(weights),
        mode=data.mode,
        seed=seed,
        lanes=lanes,
        shuffle_buffer=max(1, buffer),
        max_image_pixels=data.max_image_pixels,
        index=index,
        max_consecutive_skips=data.max_consecutive_skips,
        max_member_bytes=data.max_member_bytes,
        remote=_remote_options(data),
        keep=_keep_keys(data, lanes),
    )
    teacher_dim = (
        check_teacher_members(urls, "loss.distill.teacher", _remote_options(data), data.max_member_bytes)
        if teacher
        else 0
    )
    processor = SampleProcessor(
        transform,
        tokenizer,
        views=data.views,
        id_field=data.id_field,
        max_pixels=data.max_image_pixels,
        hard_negatives=data.hard_negatives,
        teacher_dim=teacher_dim,
    )
    piece = data.worker_batch_size or grad_cache_chunk or min(batch_size, DEFAULT_WORKER_BATCH)
    loader = StreamingLoader(
        spec,
        processor,
        rank=rank,
        world_size=world_size,
        num_workers=num_workers,
        pin_memory=pin_memory,
        worker_batch_size=piece,
    )
    if num_workers > batch_size:
        log.warning(
            "data.workers=%d for %d rows per rank: %d worker(s) have no lane to read",
            num_workers,
            batch_size,
            num_workers - batch_size,
        )
    log.info(
        "data: %d shards in %d source(s), mode %s, %d lanes (the global batch), shuffle buffer %d per lane, "
        "%d worker(s), views %d, %d piece(s) of <= %d rows per worker per local batch of %d",
        len(urls),
        len(sources),
        data.mode,
        lanes,
        spec.lane_buffer,
        num_workers,
        data.views,
        len(loader.shares[0]),
        max(loader.shares[0]),
        batch_size,
    )
    return loader
