"""``train.grad_cache_chunk_size: auto``: no gradient caching while the local batch fits the
memory budget, else the largest chunk that does.

Memory model (bytes, per process) of a training step over a local batch of B rows with chunk c
(c = B: no caching)::

    need(c) = fixed + c * per_sample + loss + features

* ``per_sample``, ``fixed``: what autograd saves for the backward, measured: training-mode
  forwards of 1 and of 2 full-size samples (full-length captions; the second view and the
  mined negatives when the objective reads them; patch dropout off when the run ends with
  unmasked steps) under the run's autocast, inside ``saved_tensors_hooks`` that record every
  unique storage saved (parameters and buffers excluded: they are resident anyway).
  ``per_sample = bytes(2) - bytes(1)``, ``fixed = bytes(1) - per_sample`` (autocast's
  low-precision weight copies, for one). Under gradient checkpointing the blocks' own saved
  tensors are recomputed in the backward and never reach these hooks; each block's input,
  which the checkpoint keeps, is recorded by a forward pre-hook instead.
* ``loss``: the loss kernel's logits over the B local rows and the gathered candidates
  (:mod:`mmalign.losses.tile_choice`'s estimate for ``loss.tile_size``): the loss runs on the
  whole local batch whatever c is.
* ``features``: every output field of the local and the gathered batch (and the momentum
  queue), with its cached gradient: ``2 x fields x rows x D x 4``.

Budget: ``train.memory_budget_gb`` GiB when > 0 (for the terms above alone); 0 = measured:
on CUDA the free device memory (:func:`torch.cuda.mem_get_info`, plus what torch's allocator
holds unused) less the training state still to be allocated (:func:`state_bytes`: weights are
resident already), times :data:`SAFETY`; on CPU :data:`RAM_FRACTION` of the RAM available to
this host's processes, less the same state.

Choice (:func:`choose_chunk`): off (0) when ``need(B)`` fits; else the largest c that fits,
balanced: the same number of chunks at sizes ``ceil(B / n)`` (so no chunk is a sliver);
a ConfigError naming the budget when not even one sample fits. Every rank measures and
chooses; the run takes the smallest chunk over the ranks, so the plans (DeepSpeed's
accumulation steps, the collectives of each chunk) are equal everywhere.
"""

from __future__ import annotations

import contextlib
import copy
import socket
from dataclasses import dataclass

import torch

from mmalign.dist import distributed as mdist
from mmalign.errors import ConfigError
from mmalign.losses.tile_choice import resolve_tile, tiled_bytes, untiled_bytes
from mmalign.models.probe_pass import traceless_training

AUTO = "auto"
GIB = 2**30
SAFETY = 0.85  # of the free GPU memory: the backward's transient activation gradients, fragmentation
RAM_FRACTION = 0.5  # of this process's share of the available RAM (the OS, the data workers, the page cache)
_MOMENTS = {"adamw": 2, "lamb": 2}  # fp32 tensors of optimizer state per trainable weight (sgd: its momentum)


@dataclass(frozen=True)
class MemoryModel:
    per_sample: int  # saved activation bytes per sample
    fixed: int  # saved bytes of a forward whatever its size
    loss: int
    features: int
    budget: int

    def need(self, chunk: int) -> int:
        return self.fixed + chunk * self.per_sample + self.loss + self.features


def choose_chunk(local: int, model: MemoryModel) -> int:
    """0 (off) when the whole local batch fits ``model.budget``; else the largest balanced chunk
    that fits; -1 when not even one sample does."""
    if model.need(local) <= model.budget:
        return 0
    room = model.budget - model.need(0)
    largest = room // model.per_sample if model.per_sample > 0 else 0
    if largest < 1:
        return -1
    n = -(-local // largest)  # as few chunks as fit; largest < local, so n >= 2
    return -(-local // n)  # <= largest: the same n chunks, sizes differing by at most one row


# ------------------------------------------------------------------ measuring


class SavedStorages:
    """``saved_tensors_hooks`` that record the unique storages autograd saves (and keep them
    alive while recording, so that no freed address is reused and counted twice)."""

    def __init__(self, exclude: set[tuple]):
        self.exclude = exclude
        self.storages: dict[tuple, torch.UntypedStorage] = {}

    def add(self, t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # no storage (sparse, nested): nothing countable
            return
        key = _storage_key(t)
        if key not in self.exclude:
            self.storages[key] = storage

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.add(t)
        return t

    @property
    def bytes(self) -> int:
        return sum(s.nbytes() for s in self.storages.values())


def _storage_key(t: torch.Tensor) -> tuple:
    return (t.device.type, t.device.index, t.untyped_storage().data_ptr())


def _checkpointed_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules activation checkpointing wraps: the blocks of every ModuleList inside a
    module whose ``grad_checkpointing`` (open_clip) / ``gradient_checkpointing`` (HF) is on."""
    blocks: list[torch.nn.Module] = []
    for m in model.modules():
        if (
            getattr(m, "grad_checkpointing", False) is True
            or getattr(m, "gradient_checkpointing", False) is True
        ):
            for child in m.modules():
                if isinstance(child, torch.nn.ModuleList):
                    blocks.extend(child)
    return blocks


def saved_bytes(model: torch.nn.Module, inputs: dict, autocast) -> int:
    """Bytes of the unique storages a training-mode forward of ``inputs`` saves for the backward
    (``autocast``: ``() -> context manager``). The model's mode, buffers (BatchNorm statistics)
    and the random generators are left as they were."""
    exclude = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    record = SavedStorages(exclude)

    def keep_input(module, args):  # a checkpointed block keeps its input, nothing else
        for a in args:
            if torch.is_tensor(a):
                record.add(a)

    hooks = [b.register_forward_pre_hook(keep_input) for b in _checkpointed_blocks(model)]
    try:
        with traceless_training(model), torch.enable_grad():  # modes, buffers and RNG restored after
            with torch.autograd.graph.saved_tensors_hooks(record.pack, lambda t: t), autocast():
                out = model(**inputs)
            total = record.bytes
            del out  # the graph and its saved tensors go here
    finally:
        for h in hooks:
            h.remove()
    return total


def probe_inputs(model, tokenizer, n: int, device: torch.device, fields, hard_negatives: int = 0) -> dict:
    """Full-size model inputs of ``n`` samples: random images, captions filling the whole context
    (nothing for the text trim to cut), plus what the objective's ``fields`` need."""
    g = torch.Generator().manual_seed(0)
    size = model.image_size
    images = torch.randn(n, 3, size, size, generator=g).to(device)  # (n, 3, S, S)
    texts = tokenizer(["a " * model.context_length] * n).to(device)  # (n, L)
    inputs = {"images": images, "texts": texts}
    if "image2" in fields:
        inputs["images2"] = images.clone()
    if "neg_text" in fields and hard_negatives:
        inputs["neg_texts"] = texts[:, None].repeat(1, hard_negatives, 1)  # (n, k, L)
    return inputs


def measure(model, tokenizer, cfg, device: torch.device, fields, autocast) -> tuple[int, int]:
    """(per-sample, fixed) saved bytes of ``model`` (see the module doc)."""
    if cfg.train.grad_checkpointing:
        model.set_grad_checkpointing(True)  # as the engine will (a ConfigError for a tower without it)
    restore = None
    if cfg.train.unmasked_steps and cfg.model.patch_dropout:
        model.set_patch_dropout(0.0)  # the unmasked steps at the end hold every patch
        restore = cfg.model.patch_dropout
    try:
        with _upper_bound_attention(device, autocast):
            one, two = (
                saved_bytes(
                    model,
                    probe_inputs(model, tokenizer, n, device, fields, cfg.data.hard_negatives),
                    autocast,
                )
                for n in (1, 2)
            )
    finally:
        if restore is not None:
            model.set_patch_dropout(restore)
    per_sample = max(0, two - one)
    return per_sample, max(0, one - per_sample)


def _upper_bound_attention(device: torch.device, autocast):
    """On CPU under bf16 / fp16 autocast, ``train.attention_kernel: auto`` picks a kernel per shape
    class by timing it (mmalign.models.attention_kernel), so the probe's 1- and 2-row batches may
    run another kernel than the real one: measure under ``math``, the one that saves the most
    (the attention probabilities). Elsewhere the configured choice, as the run makes it."""
    from mmalign.models import attention_kernel

    with autocast():
        low = torch.get_autocast_dtype(device.type) in (
            torch.bfloat16,
            torch.float16,
        ) and torch.is_autocast_enabled(device.type)
    if device.type == "cpu" and low and attention_kernel.get_mode() == "auto":
        return attention_kernel.using("math")
    return contextlib.nullcontext()


# ------------------------------------------------------------------ the other terms


def loss_bytes(cfg, local: int, world: int) -> int:
    """The loss kernel's estimated workspace over ``local`` rows (:mod:`mmalign.losses.tile_choice`)."""
    loss, global_batch = cfg.loss, local * world
    cols = global_batch * (1 + cfg.data.hard_negatives)
    if loss.name == "siglip":
        kernel = "siglip"
    elif loss.queue_size:
        kernel, cols = "queue", cols + loss.queue_size
    elif loss.hard_negative_beta or loss.debias_prior:
        kernel = "hardneg"
    else:
        kernel = "infonce_sharded" if world > 1 else "infonce"
    tile = resolve_tile(loss.tile_size, kernel, local, cols, torch.float32, loss.tile_budget_mb)
    total = untiled_bytes(kernel, local, cols) if tile is None else tiled_bytes(tile)
    if loss.image_image_weight:  # NT-Xent over both views
        total += untiled_bytes("ntxent", 2 * local, 2 * global_batch)
    return total


def features_bytes(cfg, embed_dim: int, local: int, world: int, fields) -> int:
    """Every per-sample output field of the local batch and of its gathered copy (and the momentum
    queue's), each with its cached gradient, float32 (k columns for k mined negative captions)."""
    rows = local + local * world + cfg.loss.queue_size
    widths = [
        cfg.data.hard_negatives if f == "neg_text" else 1
        for f in fields
        if f not in ("logit_scale", "logit_bias")
    ]
    return 2 * sum(widths) * rows * embed_dim * 4


def state_bytes(model: torch.nn.Module, cfg, stage: int, world: int) -> int:
    """Training state still to be allocated once the weights are on the device: fp32 gradients,
    the optimizer's moments, ZeRO's fp32 master copy and train.ema_decay's average of it (all
    partitioned over the ranks from stage 1) and ZeRO-1/2's flat gradient buffers."""
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t = cfg.train
    moments = _MOMENTS.get(t.optimizer, 1 if t.momentum else 0)
    shard = world if stage >= 1 else 1
    master = 1 if stage >= 1 or cfg.deepspeed.precision != "fp32" else 0
    ema = 1 if t.ema_decay > 0 else 0  # mmalign.run.ema: one fp32 copy of this rank's piece
    buckets = 1 if stage in (1, 2) else 0
    return int(4 * trainable * (1 + buckets + (moments + master + ema) / shard))


def budget_bytes(cfg, device: torch.device, state: int, host_processes: int) -> int:
    """The bytes a step's activations, loss and features may take (see the module doc)."""
    if cfg.train.memory_budget_gb > 0:
        return int(cfg.train.memory_budget_gb * GIB)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return max(0, int(SAFETY * (free - state)))
    import psutil

    return max(0, int(RAM_FRACTION * psutil.virtual_memory().available / host_processes - state))


# ------------------------------------------------------------------ the resolution


def resolve_grad_cache_chunk(
    cfg, model, objective, tokenizer, device: torch.device
) -> tuple[int, str | None]:
    """Collective for ``auto`` (every rank): (the chunk the run uses, 0 = off; the line to log, or
    None when ``train.grad_cache_chunk_size`` is an integer, returned unchanged)."""
    chunk = cfg.train.grad_cache_chunk_size
    if chunk != AUTO:
        return chunk, None
    from mmalign.run.zero_stage import effective_stage

    world = mdist.get_world_size()
    local = cfg.train.global_batch_size // world
    fields = set(objective.embeddings)
    per_sample, fixed = measure(model, tokenizer, cfg, device, fields, probe_autocast(cfg, device))
    stage = effective_stage(cfg, world)[0]
    host = socket.gethostname()
    hosts = mdist.all_gather_object(host)
    budget = budget_bytes(cfg, device, state_bytes(model, cfg, stage, world), hosts.count(host))
    plan = MemoryModel(
        per_sample,
        fixed,
        loss_bytes(cfg, local, world),
        features_bytes(cfg, model.embed_dim, local, world, fields),
        budget,
    )
    mine = choose_chunk(local, plan)
    chosen = mdist.all_gather_object(mine)
    if min(chosen) < 0:  # on every rank, after the gather: no rank is left waiting in a collective
        raise ConfigError(
            f"config key 'train.memory_budget_gb': train.grad_cache_chunk_size: auto needs "
            f"{_gib(plan.need(1))} for one sample (activations {_gib(per_sample)}/sample + "
            f"{_gib(fixed + plan.loss + plan.features)} fixed, loss and features) but "
            f"{'a rank has' if world > 1 else 'the budget is'} {_gib(budget)}: set an integer "
            f"chunk, a larger budget or a smaller train.global_batch_size"
        )
    smallest = min(c or local for c in chosen)
    result = 0 if smallest >= local else smallest
    line = (
        f"train.grad_cache_chunk_size: auto -> {'off' if result == 0 else result} (local batch {local} needs "
        f"{_gib(plan.need(local))}: activations {_gib(per_sample)}/sample + {_gib(fixed)}, loss {_gib(plan.loss)}, "
        f"features {_gib(plan.features)}; budget {_gib(budget)}"
        + (f" on this rank, the smallest chunk over {world} ranks" if world > 1 else "")
        + ")"
    )
    return result, line


def resolved_config(cfg, chunk: int):
    """A copy of ``cfg`` with the integer ``chunk`` (what the engine and the loader are built
    from; the run's own config, saved with its checkpoints, keeps ``auto``).  The config was
    validated at load; only the checks that read the chunk run again, at the real world size
    (e.g. bf16 weights at ZeRO-0 cannot be chunked)."""
    from mmalign.config import validate_chunk

    resolved = copy.deepcopy(cfg)
    resolved.train.grad_cache_chunk_size = chunk
    validate_chunk(resolved, mdist.get_world_size())
    return resolved


def probe_autocast(cfg, device: torch.device):
    """``() -> context``: train.precision's autocast; with fp32 autocast and bf16 / fp16 weights
    (which DeepSpeed casts later) an autocast to the weights' dtype stands in for them."""
    name = cfg.train.precision if cfg.train.precision != "fp32" else cfg.deepspeed.precision
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(name)
    if dtype is None:
        return contextlib.nullcontext
    return lambda: torch.autocast(device.type, dtype=dtype)


def _gib(n: float) -> str:
    return f"{n / GIB:.3g} GiB" if n >= GIB / 10 else f"{n / 2**20:.3g} MiB"
