"""Streaming training loader over tar shards.

Each (rank, worker) pair draws shards with replacement from its own seeded RNG
(the "resampled" mode of large-scale CLIP training: an endless stream, no epoch
bookkeeping), fills a shuffle buffer, decodes and augments, and tokenizes in the
worker so the training process only receives tensors.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from mmalign.data.shards import decode_sample, iter_tar_groups

log = logging.getLogger(__name__)


class ResampledShardStream(IterableDataset):
    def __init__(
        self,
        urls: list[str],
        transform: Callable,
        *,
        seed: int,
        rank: int = 0,
        shuffle_buffer: int = 1000,
    ):
        self.urls = urls
        self.transform = transform
        self.seed = seed
        self.rank = rank
        self.shuffle_buffer = max(1, shuffle_buffer)

    def _samples(self, rng: random.Random) -> Iterator[dict]:
        while True:
            url = rng.choice(self.urls)
            try:
                for raw in iter_tar_groups(url):
                    try:
                        sample = decode_sample(raw)
                    except Exception as e:  # a bad sample is skipped, never fatal
                        log.warning("skipping sample %s in %s: %s", raw.get("__key__"), url, e)
                        continue
                    yield sample
            except Exception as e:  # a truncated or unreadable shard ends that shard only
                log.warning("shard %s ended early: %s", url, e)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, str, str]]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        rng = random.Random(f"{self.seed}/{self.rank}/{worker}")
        buffer: list[dict] = []
        for sample in self._samples(rng):
            if len(buffer) < self.shuffle_buffer:
                buffer.append(sample)
                continue
            i = rng.randrange(len(buffer))
            buffer[i], sample = sample, buffer[i]
            caption = rng.choice(sample["captions"])
            yield self.transform(sample["image"]), caption, sample["key"]


class _Collate:
    """Stack images and tokenize captions (runs inside the workers)."""

    def __init__(self, tokenizer: Callable):
        self.tokenizer = tokenizer

    def __call__(self, batch):
        images, captions, keys = zip(*batch)
        return {
            "images": torch.stack(images),  # (B, 3, H, W)
            "tokens": self.tokenizer(list(captions)),  # (B, L)
            "captions": list(captions),
            "keys": list(keys),
        }


def build_train_loader(
    urls: list[str],
    transform: Callable,
    tokenizer: Callable,
    batch_size: int,
    *,
    seed: int,
    rank: int = 0,
    workers: int = 1,
    shuffle_buffer: int = 1000,
) -> DataLoader:
    dataset = ResampledShardStream(urls, transform, seed=seed, rank=rank, shuffle_buffer=shuffle_buffer)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        num_workers=workers,
        collate_fn=_Collate(tokenizer),
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )
