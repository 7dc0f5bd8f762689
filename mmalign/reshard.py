"""Resuming a checkpoint on a different number of ranks (world size).

DeepSpeed's ZeRO loader refuses optimizer partitions written by another world
size (``ZeRORuntimeException``).  We do not convert the checkpoint to DeepSpeed's
universal format; we consolidate it ourselves and re-partition in memory:

1. every rank reads the whole checkpoint as full per-parameter tensors: the fp32
   master weights (:func:`mmalign.engine.consolidate_checkpoint`) and each
   optimizer moment (the same consolidation with the moment's flat partitions in
   place of the weights' -- they share the weights' layout);
2. each rank copies its own slice of every tensor into the partitions the new
   engine holds: the module weights, the fp32 master partitions and the
   optimizer state of each flat partition (the same tensors that LAMB's
   partition layout, :meth:`mmalign.optim.Lamb.set_partition_layout`, names, so
   the per-tensor trust ratio is unaffected);
3. the learning-rate schedule and DeepSpeed's step counters come from the
   (world-size independent) model-states file.

ZeRO-0 stores its optimizer whole, so DeepSpeed's own loader already reads it on
any world size and this module is not used there.  Values are copied, never
recomputed, so the restored state is the saved one bit for bit and the next step
matches the uninterrupted run's to reduction order (tests/test_reshard_engine.py).
Cost: every rank holds the full fp32 weights and moments in CPU memory while it
loads (three copies of the model for Adam/LAMB), once per resume.

The trainer state (step, skipped steps) comes from rank 0's file; each rank's
random generators restart from (seed, step, rank); the data streams are converted
by :mod:`mmalign.data.resharding`.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
from pathlib import Path

import numpy as np
import torch

from mmalign import distributed as mdist

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stages 0-2 | 3


def model_states_file(engine_dir: Path) -> Path:
    for name in MODEL_STATES:
        if (engine_dir / name).is_file():
            return engine_dir / name
    raise FileNotFoundError(f"no DeepSpeed model states in {engine_dir}")


def saved_world_size(model_states: dict) -> int:
    return int(model_states.get("dp_world_size", 1))


def _module_fragments(engine) -> list[tuple[str, torch.Tensor, torch.Tensor, int, int, int]]:
    """This rank's piece of every trainable parameter: (name, module parameter, flat fp32
    partition holding it, offset in that partition, start in the flattened parameter,
    length).  Mirrors :meth:`mmalign.engine.Engine._partition_layout`, plus the start."""
    out = []
    rank = mdist.get_rank()
    if engine.stage == 3:
        for name, p in engine.named_parameters():
            if not p.requires_grad:
                continue
            partition, offset, size = engine.zero3_slot(p)
            # parameter p is split evenly: rank r holds elements [r*size, (r+1)*size)
            length = max(0, min(size, p.ds_numel - rank * size))
            out.append((name, p, partition, offset, rank * size, length))
        return out
    partitions = [t for group in engine.base_optimizer.param_groups for t in group["params"]]
    for name, p in engine.named_parameters():
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:
            continue
        fragment, hp, lp = mapping.hp_fragment, mapping.hp_fragment_address, mapping.lp_fragment_address
        owner = [t for t in partitions if t.untyped_storage().data_ptr() == fragment.untyped_storage().data_ptr()
                 and fragment.data_ptr() == t.data_ptr() + hp.start * t.element_size()]
        if len(owner) != 1:
            raise RuntimeError(f"resharding ZeRO-{engine.stage}: cannot place parameter {name} in a partition")
        out.append((name, p, owner[0], int(hp.start), int(lp.start), int(hp.numel)))
    return out


def optimizer_state_keys(first_optim_file: dict) -> tuple[list[str], dict]:
    """The per-element state keys of the saved flat partitions (e.g. ``exp_avg``,
    ``exp_avg_sq``) and the scalar ones (e.g. ``step``) of its first group."""
    osd = first_optim_file["optimizer_state_dict"]
    base = osd.get("base_optimizer_state") or osd.get("optimizer_state_dict") or {}
    state = base.get("state", {})
    first = state[min(state)] if state else {}
    tensors = sorted(k for k, v in first.items() if torch.is_tensor(v) and v.dim() == 1)
    scalars = {k: v for k, v in first.items() if k not in tensors}
    return tensors, scalars


@torch.no_grad()
def load_resharded(engine, directory: Path, tag: str, consolidate, read) -> None:
    """Restore ``directory/tag`` (written by any number of ranks) into ``engine``.

    ``consolidate(directory, tag, state_key=None)`` gives full fp32 tensors by name;
    ``read(path)`` unpickles one DeepSpeed file safely."""
    engine_dir = Path(directory) / tag
    states = read(model_states_file(engine_dir))
    optim_files = sorted(engine_dir.glob("*optim_states.pt"))
    keys, scalars = optimizer_state_keys(read(optim_files[0])) if optim_files else ([], {})
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's consolidation prints per call
        weights = consolidate(directory, tag)
        moments = {key: consolidate(directory, tag, state_key=key) for key in keys}

    # this rank's slices: module weights, fp32 master partitions, optimizer moments
    state = engine.base_optimizer.state
    for name, p, partition, offset, start, length in _module_fragments(engine):
        if length <= 0:
            continue
        flat = weights[name].reshape(-1)[start:start + length]
        partition.narrow(0, offset, length).copy_(flat)
        slot = state[partition]
        if not slot:
            slot.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
        for key, full in moments.items():
            if key not in slot:
                slot[key] = torch.zeros_like(partition)
            slot[key].narrow(0, offset, length).copy_(full[name].reshape(-1)[start:start + length])
        if engine.stage == 3:
            p.ds_tensor.data.narrow(0, 0, length).copy_(flat)
    if engine.stage < 3:  # the module holds the full (fp32 or bf16) weights
        for name, p in engine.named_parameters():
            if name in weights:
                p.data.copy_(weights[name].view_as(p))
    for name, buf in engine.named_buffers():
        if name in weights:
            buf.copy_(weights[name].to(buf.dtype))

    # the schedule and DeepSpeed's counters (the optimiser's lr follows the schedule)
    engine.scheduler.load_state_dict(states["lr_scheduler"])
    for group, lr in zip(engine.base_optimizer.param_groups, engine.scheduler.get_last_lr()):
        group["lr"] = lr
    engine.set_step_counters(states["global_steps"],
                             states.get("global_samples", states["global_steps"] * engine.plan.global_batch),
                             states["skipped_steps"])


# ------------------------------------------------------------- trainer state


def fresh_rng_state(seed: int, step: int, rank: int) -> dict:
    """The generators of a rank that did not exist (or was another rank) when the
    checkpoint was written: seeded from (seed, step, rank), returned as
    :func:`mmalign.checkpoint.rng_state` values; the process's own state is left as it was."""
    from mmalign.checkpoint import rng_state, set_rng_state

    saved = rng_state()
    value = (seed * 1_000_003 + step) * 1_009 + rank
    random.seed(value)
    np.random.seed(value % 2**32)
    torch.manual_seed(value)
    fresh = rng_state()
    set_rng_state(saved)
    return fresh


def trainer_and_loader(path: Path, saved_world: int) -> tuple[dict, dict]:
    """(trainer state, loader state) for a rank of a run resumed on another world size:
    rank 0's step and skip count, no RNG (``rng`` None: the caller seeds it), and the
    loader states of every rank that wrote the checkpoint (``resharded_from``)."""
    trainer = torch.load(path / "trainer_rank0.pt", map_location="cpu", weights_only=True)
    trainer["rng"] = None
    trainer["resharded_from"] = saved_world
    loaders = []
    for r in range(saved_world):
        file = path / f"loader_rank{r}.json"
        loaders.append(json.loads(file.read_text()) if file.is_file() else {})
    return trainer, {"resharded_from": loaders}


def adopt(trainer: dict, loader_state: dict, spec, seed: int, step: int, rank: int) -> tuple[dict, dict, str | None]:
    """For a resume on another world size: this rank's RNG from (seed, step, rank) and its
    loader state converted to the new slot layout, plus the line to log; otherwise the
    states unchanged and None."""
    from mmalign.data.resharding import convert

    saved_world = trainer.get("resharded_from")
    if not saved_world:
        return trainer, loader_state, None
    trainer = {**trainer, "rng": fresh_rng_state(seed, step, rank)}
    loader_state, how = convert(loader_state["resharded_from"], spec, rank, step)
    world = mdist.get_world_size()
    return trainer, loader_state, (f"resumed a {saved_world}-rank checkpoint on {world} rank(s): weights and optimizer "
                                   f"state carried over (re-partitioned for ZeRO); {how}")
