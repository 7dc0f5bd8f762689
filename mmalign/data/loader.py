"""The training loader: streams batches from tar shards and resumes exactly.

Workers decode, augment and tokenize; each batch arrives with the state of the
worker's stream *after* that batch.  The main process keeps, per worker, the state
that came with the last batch the training loop actually took, so
:meth:`StreamingLoader.state_dict` reflects consumed batches only, however far the
DataLoader has prefetched.

Batches come from the workers round-robin (PyTorch's in-order DataLoader).  After
``n`` consumed batches the next one is due from logical worker ``n mod K``; a new
iterator therefore maps DataLoader worker ``w`` to logical worker ``(w + n) mod K``,
so a resumed run interleaves the workers exactly as the uninterrupted one would.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import signal
import sys
from collections.abc import Callable, Iterator

from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmalign.config import ConfigError, DataConfig
from mmalign.data.samples import SampleProcessor
from mmalign.data.shards import check_urls, expand_urls
from mmalign.data.remote import RemoteOptions
from mmalign.data.stream import NoSamples, SlotStream, StreamSpec, check_resumable

log = logging.getLogger("mmalign.data")

STATE_VERSION = 1


class _Slots(IterableDataset):
    """What each DataLoader worker runs: the stream of its logical slot."""

    def __init__(self, spec: StreamSpec, processor: SampleProcessor, rank: int, states: dict, rotation: int):
        self.spec, self.processor, self.rank = spec, processor, rank
        self.states, self.rotation = states, rotation

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if info is not None:
            # PIL's own decompression-bomb limit, explicit, in the worker process only: the
            # training process keeps PIL's default (evaluation reads through it) and the
            # per-sample check in shards.open_image applies data.max_image_pixels everywhere.
            Image.MAX_IMAGE_PIXELS = self.spec.max_image_pixels
        slot = self.rank * self.spec.workers + (worker + self.rotation) % self.spec.workers
        try:
            stream = SlotStream(self.spec, slot, self.processor, self.states.get(slot))
            yield from stream.batches()
        except NoSamples as e:  # reported by the main process as a one-line error
            yield {"_loader": {"slot": slot, "error": str(e)}}


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
    """Iterable of batch dicts with ``state_dict``/``load_state_dict`` and ``skipped``.

    A batch: ``images`` (B,3,H,W), ``tokens`` (B,L), ``captions``, ``keys``, ``epochs``
    (B,), optional ``ids`` (B,), ``images2`` (B,3,H,W), ``neg_tokens`` (B,k,L) with
    ``neg_mask`` (B,k) (mined hard negatives), and ``skipped`` (the
    run's skip counts so far, by reason).  Iterating is endless; iterating again
    continues after the last consumed batch.
    """

    def __init__(self, spec: StreamSpec, processor: SampleProcessor, *, rank: int = 0, num_workers: int = 1,
                 prefetch_factor: int = 2, pin_memory: bool = False):
        self.spec = spec
        self.processor = processor
        self.rank = rank
        self.num_workers = num_workers  # DataLoader processes; 0 = read in this process
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self._states: dict[int, dict] = {}  # slot -> stream state after its last consumed batch
        self._consumed = 0  # batches consumed from this rank's loader

    # ------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[dict]:
        dataset = _Slots(self.spec, self.processor, self.rank, dict(self._states), self._consumed % self.spec.workers)
        if self.num_workers == 0:
            source = iter(dataset)
        else:
            source = iter(DataLoader(dataset, batch_size=None, num_workers=self.num_workers,
                                     prefetch_factor=self.prefetch_factor, pin_memory=self.pin_memory,
                                     persistent_workers=False, worker_init_fn=_worker_init))
        try:
            for batch in source:
                info = batch.pop("_loader")
                if "error" in info:
                    raise ConfigError(f"config key 'data.train': {info['error']}")
                self._states[info["slot"]] = info["state"]
                self._consumed += 1
                batch["skipped"] = self.skipped()
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
        if state.get("version") != STATE_VERSION:
            raise ConfigError(f"loader state version {state.get('version')!r} is not {STATE_VERSION}")
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
) -> StreamingLoader:
    """This rank's loader of ``batch_size`` (the per-rank batch) from ``data`` (a DataConfig).

    A plain list of shard paths is accepted too (resampled mode, DataConfig defaults).
    ``workers``/``shuffle_buffer`` override the config's values when given.
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
    log.info("data: %d shards in %d source(s), mode %s, shuffle buffer %d, %d worker(s), views %d",
             len(urls), len(sources), data.mode, spec.shuffle_buffer, num_workers, data.views)
    return StreamingLoader(spec, processor, rank=rank, num_workers=num_workers)
