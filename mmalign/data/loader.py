"""The training loader: streams batches from tar shards and resumes exactly.

Workers decode, augment and tokenize; each piece they send arrives with the state of
the worker's stream *after* it.  The main process keeps, per worker, the state that
came with the last piece of the last local batch the training loop actually took, so
:meth:`StreamingLoader.state_dict` reflects consumed batches only, however far the
DataLoader has prefetched.

A local batch of B rows takes B // K rows (one more for the first B mod K) from each of
the K workers, in the same number c of pieces per worker, each piece at most
``data.worker_batch_size`` rows (:func:`worker_shares`).  PyTorch's in-order
DataLoader takes one piece from each worker in turn, so a local batch is exactly c
rounds; the main process orders the rows by worker and concatenates them.  A batch's
rows therefore depend on B and K only, never on the piece size: a run resumes exactly
with another ``worker_batch_size``.  Pieces keep the memory in flight (K workers x
prefetch x piece) independent of the local batch; images travel as uint8.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator
from itertools import islice

from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmalign.config import ConfigError, DataConfig
from mmalign.data.batch import Batch
from mmalign.data.samples import SampleProcessor, merge
from mmalign.data.shards import check_urls, expand_urls
from mmalign.data.remote import RemoteOptions
from mmalign.data.stream import NoSamples, SlotStream, StreamSpec, check_resumable

log = logging.getLogger("mmalign.data")

# 2: every local batch takes rows from all workers (1: each batch came whole from one worker,
# in turn; such a state still resumes each worker's stream where it stopped)
STATE_VERSION = 2
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


class _Slots(IterableDataset):
    """What each DataLoader worker runs: the stream of its slot, cut into its pieces."""

    def __init__(self, spec: StreamSpec, processor: SampleProcessor, rank: int, states: dict,
                 shares: list[list[int]]):
        self.spec, self.processor, self.rank = spec, processor, rank
        self.states, self.shares = states, shares

    def __iter__(self) -> Iterator[tuple[Batch | None, dict]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None:
            # PIL's own decompression-bomb limit, explicit, in the worker process only: the
            # training process keeps PIL's default (evaluation reads through it) and the
            # per-sample check in shards.open_image applies data.max_image_pixels everywhere.
            Image.MAX_IMAGE_PIXELS = self.spec.max_image_pixels
        slot = self.rank * self.spec.workers + worker
        try:
            stream = SlotStream(self.spec, slot, self.processor, self.states.get(slot))
            samples = stream.samples()
            while True:
                for size in self.shares[worker]:
                    taken = list(islice(samples, size))  # exactly `size` rows: the state is after them
                    rows, epochs = [r for r, _ in taken], [e for _, e in taken]
                    piece = self.processor.collate(rows, epochs) if rows else None  # Batch or None
                    yield piece, {"slot": slot, "state": stream.state()}
        except NoSamples as e:  # reported by the main process as a one-line error
            yield None, {"slot": slot, "error": str(e)}


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

    def __init__(self, spec: StreamSpec, processor: SampleProcessor, *, rank: int = 0, num_workers: int = 1,
                 prefetch_factor: int = 2, pin_memory: bool = False, worker_batch_size: int = DEFAULT_WORKER_BATCH):
        self.spec = spec
        self.processor = processor
        self.rank = rank
        self.num_workers = num_workers  # DataLoader processes; 0 = read in this process
        self.prefetch_factor = prefetch_factor  # pieces in flight per worker
        self.pin_memory = pin_memory  # batches assembled in pinned memory (CUDA training)
        self.shares = worker_shares(spec.batch_size, spec.workers, max(1, worker_batch_size))
        self._states: dict[int, dict] = {}  # slot -> stream state after its last consumed batch
        self._consumed = 0  # batches consumed from this rank's loader

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Batch]:
        dataset = _Slots(self.spec, self.processor, self.rank, dict(self._states), self.shares)
        if self.num_workers == 0:
            source = iter(dataset)
        else:
            source = iter(DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                     prefetch_factor=self.prefetch_factor, persistent_workers=False,
                                     worker_init_fn=_worker_init))
        rounds, workers = len(self.shares[0]), self.spec.workers
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
                        states[info["slot"]] = info["state"]
                        pieces[w].append(piece)
                batch = merge([p for parts in pieces for p in parts], self.pin_memory)
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
        """Samples skipped so far by reason, summed over this rank's workers (consumed batches only)."""
        total: dict[str, int] = {}
        for state in self._states.values():
            for reason, count in state["skipped"].items():
                total[reason] = total.get(reason, 0) + count
        return dict(sorted(total.items()))

    @property
    def epoch(self) -> int:
        """The epoch every worker of this rank has reached (epoch mode; 0 before any batch)."""
        return min((s["epoch"] for s in self._states.values()), default=0)

    # ------------------------------------------------------------ state

    def _fingerprint(self) -> str:
        return hashlib.sha256("\n".join(self.spec.urls).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        """JSON-serialisable position of this rank's stream after the consumed batches."""
        return {
            "version": STATE_VERSION,
            "mode": self.spec.mode,
            "seed": self.spec.seed,
            "rank": self.rank,
            "world_size": self.spec.world_size,
            "workers": self.spec.workers,
            "batch_size": self.spec.batch_size,
            "shards": self._fingerprint(),
            "consumed": self._consumed,
            "slots": {str(slot): state for slot, state in sorted(self._states.items())},
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly after the batches ``state`` records; the layout must match."""
        if state.get("version") not in (1, STATE_VERSION):
            raise ConfigError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
        if state["version"] == 1 and self.spec.workers > 1:
            log.warning("the checkpoint's data position is from an mmalign whose batches came whole from one "
                        "worker each: every worker resumes where it stopped, batches now take rows from all")
        mine = {"mode": self.spec.mode, "seed": self.spec.seed, "rank": self.rank,
                "world_size": self.spec.world_size, "workers": self.spec.workers,
                "batch_size": self.spec.batch_size, "shards": self._fingerprint()}
        for key, value in mine.items():
            if state.get(key) != value:
                raise ConfigError(
                    f"cannot resume the data stream: the checkpoint has {key}={state.get(key)!r}, this run {value!r} "
                    "(exact resume needs the same shards, seed, mode, batch size, ranks and workers)"
                )
        check_resumable(self.spec, state["slots"])
        self._states = {int(slot): s for slot, s in state["slots"].items()}
        self._consumed = int(state["consumed"])


# ---------------------------------------------------------------- building


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
) -> StreamingLoader:
    """This rank's loader of ``batch_size`` (the per-rank batch) from ``data`` (a DataConfig).

    A plain list of shard paths is accepted too (resampled mode, DataConfig defaults).
    ``workers``/``shuffle_buffer`` override the config's values when given.  Workers send
    pieces of at most ``data.worker_batch_size`` rows; 0 means ``grad_cache_chunk`` (the
    gradient-cache chunk, when caching) or else min(batch_size, 256).  ``pin_memory``: on
    CUDA, assemble batches in pinned memory for asynchronous copies.
    """
    if not isinstance(data, DataConfig):
        data = DataConfig(train=list(data))
    urls, sources, weights = _sources(data)
    num_workers = data.workers if workers is None else workers
    buffer = data.shuffle_buffer if shuffle_buffer is None else shuffle_buffer
    if batch_size <= 0:
        raise ConfigError(f"the per-rank batch size must be > 0, got {batch_size}")
    spec = StreamSpec(
        urls=tuple(urls), sources=tuple(sources), weights=tuple(weights), mode=data.mode, seed=seed,
        world_size=world_size, workers=max(1, num_workers), batch_size=batch_size,
        shuffle_buffer=max(1, buffer), max_image_pixels=data.max_image_pixels,
        max_consecutive_skips=data.max_consecutive_skips,
        max_member_bytes=data.max_member_bytes,
        remote=_remote_options(data),
    )
    if len(urls) < spec.slots:
        how = ("each worker keeps every c-th sample of a shared shard" if data.mode == "epoch"
               else "workers draw the same shards in different orders")
        log.warning("data.train has %d shards for %d ranks x %d workers: %s (more shards read faster)",
                    len(urls), world_size, spec.workers, how)
    processor = SampleProcessor(transform, tokenizer, views=data.views, id_field=data.id_field,
                                max_pixels=data.max_image_pixels, hard_negatives=data.hard_negatives)
    piece = data.worker_batch_size or grad_cache_chunk or min(batch_size, DEFAULT_WORKER_BATCH)
    loader = StreamingLoader(spec, processor, rank=rank, num_workers=num_workers, pin_memory=pin_memory,
                             worker_batch_size=piece)
    log.info("data: %d shards in %d source(s), mode %s, shuffle buffer %d, %d worker(s), views %d, "
             "%d piece(s) of <= %d rows per worker per local batch of %d", len(urls), len(sources), data.mode,
             spec.shuffle_buffer, num_workers, data.views, len(loader.shares[0]), max(loader.shares[0]), batch_size)
    return loader
