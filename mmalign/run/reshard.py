"""Resuming a checkpoint on a different number of ranks (world size).

DeepSpeed's ZeRO loader refuses optimizer partitions written by another world
size (``ZeRORuntimeException``).  We do not convert the checkpoint to DeepSpeed's
universal format; we consolidate it ourselves and re-partition in memory:

1. every rank reads the whole checkpoint as full per-parameter tensors: the fp32
   master weights (:func:`mmalign.layout.ds_adapter.consolidate_checkpoint`) and each
   optimizer moment (the same consolidation with the moment's flat partitions in
   place of the weights' -- they share the weights' layout);
2. each rank copies its own slice of every tensor into the partitions the new
   engine holds: the module weights, the fp32 master partitions and the
   optimizer state of each flat partition (the same tensors that LAMB's
   partition layout, :meth:`mmalign.run.optim.Lamb.set_partition_layout`, names, so
   the per-tensor trust ratio is unaffected);
3. the learning-rate schedule and DeepSpeed's step counters come from the
   (world-size independent) model-states file.

ZeRO-0 stores its optimizer whole (the torch optimizer's per-parameter state in the
model-states file), so DeepSpeed's own loader reads a ZeRO-0 checkpoint into a ZeRO-0
engine on any world size.  Between ZeRO-0 and ZeRO >= 1 this module converts, both
ways: a one-process run of a ``zero_stage: 1`` config runs ZeRO-0 (:mod:`mmalign.run.zero_stage`)
and must resume at ZeRO-1 on several ranks, and the other way round.  A ZeRO-0 source
gives the weights from its module state and the moments per parameter from its optimizer
state (indexed in the order of :attr:`mmalign.run.engine.Engine.param_group_names`); a ZeRO-0
target gets its torch optimizer's state loaded per parameter.  Values are copied, never
recomputed, so the restored state is the saved one bit for bit and the next step
matches the uninterrupted run's to reduction order (tests/run/test_reshard_engine.py).
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

from mmalign.dist import distributed as mdist
from mmalign.layout import ds_adapter

MODEL_STATES = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # stages 0-2 | 3


def model_states_file(engine_dir: Path) -> Path:
    for name in MODEL_STATES:
        if (engine_dir / name).is_file():
            return engine_dir / name
    raise FileNotFoundError(f"no DeepSpeed model states in {engine_dir}")


def saved_world_size(model_states: dict) -> int:
    return int(model_states.get("dp_world_size", 1))


def saved_zero_stage(model_states: dict) -> int:
    """The ZeRO stage DeepSpeed ran at when it wrote ``model_states`` (the config it stores)."""
    conf = model_states.get("ds_config")
    zero = conf.get("zero_optimization") if isinstance(conf, dict) else None
    if isinstance(zero, dict):
        return int(zero.get("stage", 0))
    # no stored config: DeepSpeed keeps the optimizer in the model states only without ZeRO
    return 0 if model_states.get("optimizer") is not None else 1


def needs_conversion(model_states: dict, stage: int, world_size: int) -> bool:
    """Whether a checkpoint with ``model_states`` must be consolidated and re-cut for an engine
    at ZeRO ``stage`` on ``world_size`` ranks (else DeepSpeed's own loader reads it)."""
    saved = saved_zero_stage(model_states)
    if (saved == 0) != (stage == 0):  # whole per-parameter state on one side, flat partitions on the other
        return True
    return stage >= 1 and saved_world_size(model_states) != world_size  # partitions cut for another world


def zero0_moments(
    optimizer_state: dict, group_names: list[list[str]], shapes: dict[str, torch.Size]
) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
    """A ZeRO-0 checkpoint's torch optimizer state_dict -> ({state key: {parameter name: full
    tensor}}, the scalar state of its first entry, e.g. ``step``).

    Its entries are numbered in parameter-group order; ``group_names`` names them in the same
    order. A moment is a key whose value has the parameter's shape for some multi-element
    parameter (a 0-dim ``step`` tensor and a scalar parameter's 0-dim moment look alike)."""
    groups, state = optimizer_state.get("param_groups"), optimizer_state.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict):
        raise RuntimeError("resharding: the ZeRO-0 checkpoint holds no torch optimizer state_dict")
    if [len(g["params"]) for g in groups] != [len(names) for names in group_names]:
        raise RuntimeError(
            f"resharding: the ZeRO-0 checkpoint's optimizer groups hold "
            f"{[len(g['params']) for g in groups]} tensors, this model's "
            f"{[len(names) for names in group_names]}"
        )
    entries = [
        (name, state[index])
        for g, names in zip(groups, group_names)
        for index, name in zip(g["params"], names)
        if state.get(index)
    ]
    keys = sorted(
        {
            k
            for name, entry in entries
            for k, v in entry.items()
            if torch.is_tensor(v) and shapes[name].numel() > 1 and v.shape == shapes[name]
        }
    )
    moments = {k: {name: entry[k] for name, entry in entries if k in entry} for k in keys}
    scalars = {k: v for k, v in entries[0][1].items() if k not in keys} if entries else {}
    return moments, scalars


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
    with contextlib.redirect_stdout(io.StringIO()):  # DeepSpeed's consolidation prints per call
        weights = consolidate(directory, tag)  # a ZeRO-0 checkpoint: its module state
        if saved_zero_stage(states) == 0:
            shapes = {name: w.shape for name, w in weights.items()}
            moments, scalars = zero0_moments(states["optimizer"], engine.param_group_names, shapes)
        else:
            optim_files = sorted(engine_dir.glob("*optim_states.pt"))
            keys, scalars = optimizer_state_keys(read(optim_files[0])) if optim_files else ([], {})
            moments = {key: consolidate(directory, tag, state_key=key) for key in keys}

    if engine.stage == 0:
        _load_whole_optimizer(engine, moments, scalars)
    # this rank's slices: module weights, fp32 master partitions, optimizer moments (none at ZeRO-0)
    state = engine.base_optimizer.state
    for f in engine.partition_fragments():  # this rank's piece of each trainable parameter
        name, p, partition, offset, start, length = f.name, f.param, f.partition, f.offset, f.start, f.length
        if length <= 0:
            continue
        flat = weights[name].reshape(-1)[start : start + length]
        partition.narrow(0, offset, length).copy_(flat)
        slot = state[partition]
        if not slot:
            slot.update({k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()})
        for key, full in moments.items():
            if key not in slot:
                slot[key] = torch.zeros_like(partition)
            if name in full:  # a ZeRO-0 source has no state for a parameter that never had a gradient
                slot[key].narrow(0, offset, length).copy_(full[name].reshape(-1)[start : start + length])
        if engine.stage == 3:
            ds_adapter.local_partition(p).data.narrow(0, 0, length).copy_(flat)
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
    engine.set_step_counters(
        states["global_steps"],
        states.get("global_samples", states["global_steps"] * engine.plan.global_batch),
        states["skipped_steps"],
    )


def _load_whole_optimizer(engine, moments: dict[str, dict[str, torch.Tensor]], scalars: dict) -> None:
    """ZeRO-0: the torch optimizer's state per parameter, from full tensors by name. Loaded
    through ``load_state_dict``, which puts each tensor on its parameter's device and dtype
    (and ``step`` where the fused / capturable kernels want it)."""
    optimizer = engine.base_optimizer
    current = optimizer.state_dict()  # its param_groups number the parameters in group order
    params = dict(engine.named_parameters())
    state = {}
    for group, names in zip(current["param_groups"], engine.param_group_names):
        for index, name in zip(group["params"], names):
            entry = {
                k: full[name].reshape(params[name].shape).clone()
                for k, full in moments.items()
                if name in full
            }
            if entry or (scalars and not moments):
                state[index] = {
                    **{k: (v.clone() if torch.is_tensor(v) else v) for k, v in scalars.items()},
                    **entry,
                }
    optimizer.load_state_dict({"state": state, "param_groups": current["param_groups"]})


# ------------------------------------------------------------- trainer state


def fresh_rng_state(seed: int, step: int, rank: int) -> dict:
    """The generators of a rank that did not exist (or was another rank) when the
    checkpoint was written: seeded from (seed, step, rank), returned as
    :func:`mmalign.run.rng_state.rng_state` values; the process's own state is left as it was."""
    from mmalign.run.rng_state import rng_state, set_rng_state

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


def adopt(
    trainer: dict, loader_state: dict, spec, seed: int, step: int, rank: int
) -> tuple[dict, dict, str | None]:
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
    return (
        trainer,
        loader_state,
        (
            f"resumed a {saved_world}-rank checkpoint on {world} rank(s): weights and optimizer "
            f"state carried over (re-partitioned for ZeRO); {how}"
        ),
    )
