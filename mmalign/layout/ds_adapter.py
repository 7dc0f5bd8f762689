"""Everything mmalign knows of DeepSpeed's private layout, in one place.

Written against DeepSpeed 0.19.8 (:data:`WRITTEN_AGAINST`); :class:`mmalign.run.engine.Engine`
logs one warning line when another version is installed (:func:`check_version`). Each
function here reads or swaps something DeepSpeed does not document; what DeepSpeed does
document (``deepspeed.initialize``, the engine's ``backward`` / ``step`` / ``save_checkpoint``
/ ``load_checkpoint``, ``deepspeed.utils.safe_get_*``) is used by the engine directly.
``tests/run/test_ds_adapter.py`` checks every function here against that public behaviour, so a
DeepSpeed upgrade that moves a private fails there first, by name.

What is known here:

* the flat fp32 partitions ZeRO steps the optimiser with, and where each parameter's
  piece lies in them (:func:`partitions`, :func:`fragments`, :func:`zero3_slot`): ZeRO-1/2
  and the BF16 optimizer link a parameter to its piece by ``param._hp_mapping``, ZeRO-3
  by the optimizer's ``grad_position`` and ``fp32_partitioned_groups_flat``;
* a ZeRO-3 parameter's local partition (``param.ds_tensor``) and its marker (``ds_id``);
* the engine's step counters, its one-rank gradient all-reduce switch and its
  ``checkpoint_engine`` (the object every checkpoint file goes through);
* the classes DeepSpeed pickles into its checkpoint files, and the keys of its ZeRO
  optimizer files (:func:`consolidate_checkpoint`);
* the two swaps of a module-level name for the duration of a call: ``build_shm_op`` in
  ``deepspeed.comm.torch`` and ``torch`` / ``tqdm`` in ``deepspeed.utils.zero_to_fp32``.

deepspeed is imported inside the functions: this module is imported by modules (the disk
checks of a save, the model loader) that must not pull DeepSpeed in, and it imports nothing
else of mmalign, so every layer may use it. :func:`default_accelerator` runs before each
import of deepspeed (:mod:`mmalign.run.engine`'s, and a consolidation's).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

WRITTEN_AGAINST = "0.19.8"

log = logging.getLogger("mmalign.layout.ds_adapter")
_warned_versions: set[str] = set()


def default_accelerator() -> None:
    """DeepSpeed picks its accelerator once, when first imported: on a machine without CUDA it
    must be the CPU one (``DS_ACCELERATOR=cpu``), unless the user chose another. Called before
    every import of deepspeed (the engine's, and a consolidation's without an engine)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")


def release_groups() -> None:
    """Destroy the process group through DeepSpeed, where DeepSpeed built groups on it: its
    ``destroy_process_group`` also drops the groups it cached (data parallel, world, ...), which
    a later engine in the same process (a second ``cli.main``) would otherwise find destroyed.
    Nothing to do where DeepSpeed was never imported or never initialised."""
    import sys

    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.is_initialized():
        ds_comm.destroy_process_group()


def version_line(installed: str) -> str | None:
    """The warning for an installed DeepSpeed other than :data:`WRITTEN_AGAINST`; None for that one."""
    if installed == WRITTEN_AGAINST:
        return None
    return (
        f"mmalign: warning: DeepSpeed {installed} is installed, mmalign's adapter of DeepSpeed's private "
        f"layout (mmalign/layout/ds_adapter.py) was written against {WRITTEN_AGAINST}; "
        f"tests/run/test_ds_adapter.py checks it against this version"
    )


def check_version(installed: str) -> str | None:
    """Log :func:`version_line` once per process and version; returns the line (None: nothing to say)."""
    line = version_line(installed)
    if line is not None and installed not in _warned_versions:
        _warned_versions.add(installed)
        log.warning("%s", line)
    return line


@contextlib.contextmanager
def shadowed(obj, name: str, replacement):
    """``obj.name`` is ``replacement`` for the block (an instance attribute shadowing a method);
    afterwards what was there before: the instance's own attribute again, or the class's method."""
    had_own, own = name in vars(obj), vars(obj).get(name)
    setattr(obj, name, replacement)
    try:
        yield
    finally:
        if had_own:
            setattr(obj, name, own)
        else:
            delattr(obj, name)


# ------------------------------------------------------------------- the running engine


def skip_backward_allreduce(ds_engine) -> None:
    """DeepSpeed's gradient averaging after each backward switched off (one rank: an identity)."""
    ds_engine.enable_backward_allreduce = False


def set_step_counters(ds_engine, global_steps: int, global_samples: int, skipped_steps: int) -> None:
    """The counters DeepSpeed writes into a checkpoint's model-states file, set as if it had read them."""
    ds_engine.global_steps = global_steps
    ds_engine.global_samples = global_samples
    ds_engine.skipped_steps = skipped_steps


def is_zero3(p: torch.nn.Parameter) -> bool:
    """Whether ZeRO-3 partitions ``p`` (it then holds only this rank's slice, :func:`local_partition`)."""
    return hasattr(p, "ds_id")


def local_partition(p: torch.nn.Parameter) -> torch.Tensor:
    """What this rank holds of the module's weight ``p``: the flat slice under ZeRO-3, else ``p``."""
    return p.ds_tensor if is_zero3(p) else p  # type: ignore[attr-defined]  # ZeRO-3 adds it at runtime


def master_fragment(p: torch.nn.Parameter) -> torch.Tensor | None:
    """ZeRO-1/2 and the BF16 optimizer: this rank's piece of ``p``'s fp32 master copy, a writable
    view into the flat partition the optimiser steps (None: no piece here, ZeRO-0 or ZeRO-3)."""
    mapping = getattr(p, "_hp_mapping", None)
    return None if mapping is None else mapping.hp_fragment


def linked_to_master(module: torch.nn.Module) -> bool:
    """Whether the trainable parameters' fp32 master copy lives in flat partitions linked by
    ``param._hp_mapping`` (ZeRO-1/2, and DeepSpeed's BF16 optimizer at ZeRO-0), not in the module."""
    return any(getattr(p, "_hp_mapping", None) is not None for p in module.parameters() if p.requires_grad)


def full_shape(p: torch.nn.Parameter) -> torch.Size:
    """``p``'s whole shape, also under ZeRO-3 (whose module parameter is then an empty placeholder)."""
    return torch.Size(p.ds_shape) if is_zero3(p) else p.shape  # type: ignore[attr-defined]  # ZeRO-3's


def zero3_slot(ds_engine, p: torch.nn.Parameter) -> tuple[torch.Tensor, int, int]:
    """ZeRO-3: (the flat fp32 partition of the sub-group holding this rank's slice of ``p``, the
    slice's offset in it, the per-rank slice size). ``p`` is split evenly over the ranks: rank r
    holds its flattened elements [r * size, (r + 1) * size), the last one padded."""
    z3 = ds_engine.optimizer
    sub, offset, size = z3.grad_position[z3.get_param_id(p)]
    return list(z3.fp32_partitioned_groups_flat)[sub], int(offset), int(size)


def partitions(ds_engine, stage: int, base_optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The flat fp32 partitions DeepSpeed steps ``base_optimizer`` (ours) with on this rank. At
    ZeRO-1/2 DeepSpeed puts them in place of the parameters of our optimiser's groups; at ZeRO-0
    these are the module's own parameters, holding no fragment."""
    if stage == 3:
        return list(ds_engine.optimizer.fp32_partitioned_groups_flat)
    return [t for group in base_optimizer.param_groups for t in group["params"]]


@dataclass(frozen=True)
class Fragment:
    """This rank's piece of one trainable parameter in a flat fp32 partition."""

    index: int  # the parameter's position in named_parameters (the same on every rank)
    name: str
    param: torch.nn.Parameter
    partition: torch.Tensor  # a flat fp32 partition (one of :func:`partitions`)
    offset: int  # where the piece starts in the partition
    start: int  # where it starts in the flattened parameter
    length: int  # its element count (0: this rank holds none of it)


def fragments(
    ds_engine, module: torch.nn.Module, stage: int, base_optimizer: torch.optim.Optimizer, rank: int
) -> list[Fragment]:
    """This rank's piece of every trainable parameter of ``module`` (none at ZeRO-0). The
    partitions' elements in no fragment are padding."""
    parts, out = partitions(ds_engine, stage, base_optimizer), []
    for index, (name, p) in enumerate(module.named_parameters()):
        if stage == 3:
            if not p.requires_grad:
                continue
            partition, offset, size = zero3_slot(ds_engine, p)
            length = max(0, min(size, p.ds_numel - rank * size))  # type: ignore[attr-defined]  # ZeRO-3's
            out.append(Fragment(index, name, p, partition, offset, rank * size, length))
            continue
        mapping = getattr(p, "_hp_mapping", None)
        if mapping is None:  # not on this rank, frozen, or ZeRO-0
            continue
        fragment, hp, lp = mapping.hp_fragment, mapping.hp_fragment_address, mapping.lp_fragment_address
        # the partition whose storage holds the fragment, at the fragment's address
        owner = [
            t
            for t in parts
            if t.untyped_storage().data_ptr() == fragment.untyped_storage().data_ptr()
            and fragment.data_ptr() == t.data_ptr() + hp.start * t.element_size()
        ]
        if len(owner) != 1:
            raise RuntimeError(f"ZeRO-{stage}: cannot place parameter {name} in a flat partition")
        out.append(Fragment(index, name, p, owner[0], int(hp.start), int(lp.start), int(hp.numel)))
    return out


@contextlib.contextmanager
def weights_only_resume(ds_engine):
    """DeepSpeed's ``load_checkpoint`` with every file unpickled by ``torch.load(weights_only=True)``
    (plus :func:`safe_globals`): all of its resume reads go through ``checkpoint_engine.load``,
    so that one method is swapped for the block."""

    def load(path, map_location=None):
        return torch.load(path, map_location=map_location, weights_only=True)

    with (
        shadowed(ds_engine.checkpoint_engine, "load", load),
        torch.serialization.safe_globals(safe_globals()),
    ):
        yield


def checkpoint_writer(engine) -> tuple[object, bool | None] | None:
    """(the object every file of an :class:`mmalign.run.engine.Engine`'s DeepSpeed save goes through,
    the zipfile flag of DeepSpeed's torch writer or None for another writer); None for an engine
    without one. ``engine``'s DeepSpeed engine is its ``ds``."""
    writer = getattr(getattr(engine, "ds", None), "checkpoint_engine", None)
    if writer is None or not callable(getattr(writer, "save", None)):
        return None
    torch_writer = type(writer).__name__ == "TorchCheckpointEngine"
    return writer, (writer.zipfile_serialization if torch_writer else None)


@contextlib.contextmanager
def without_shm_comm_op():
    """``deepspeed.initialize`` without DeepSpeed's shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed's communication backend JIT-compiles the C++ op
    ``deepspeed_shm_comm`` (50-100 s on two cores, printing a CUDA_HOME warning, and compiled
    again whenever torch's extension cache key changes) the first time a backend is made. That
    op serves only ``inference_all_reduce`` (tensor-parallel inference); training's collectives
    go through torch.distributed (gloo), so it is never used here. DeepSpeed falls back to
    torch.distributed when the builder returns None."""
    import importlib

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # the package re-binds the name "torch"
    with shadowed(ds_comm_torch, "build_shm_op", lambda: None):
        yield


# ------------------------------------------------------------------- checkpoint files


def safe_globals() -> list:
    """The non-tensor classes DeepSpeed pickles into its ZeRO 1-3 optimizer files (found by
    saving real checkpoints at every stage, fp32 and bf16): allowing exactly these lets
    ``torch.load(weights_only=True)`` read them. All three are plain data (a loss-scale record,
    an int enum, a dataclass of two ints): unpickling them runs no code."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def safe_load(path) -> dict:
    """One DeepSpeed checkpoint file, unpickled with ``weights_only=True``."""
    with torch.serialization.safe_globals(safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


class _WeightsOnlyTorch:
    """``torch`` as DeepSpeed's zero_to_fp32 module sees it while we consolidate: the same
    module except that ``load`` always unpickles with ``weights_only=True``.

    zero_to_fp32 calls ``torch.load(..., weights_only=False)`` itself; swapping its module-level
    name for the duration of our call is narrower than patching ``torch.load`` for the process.

    ``state_key`` (e.g. ``exp_avg``): each optimizer file's flat fp32 partitions are replaced by
    that optimizer state of the same partitions (cut to the partitions' saved lengths: ZeRO-1/2
    store the state with its end padding), so zero_to_fp32 consolidates the state instead."""

    def __init__(self, state_key: str | None = None):
        self.state_key = state_key

    def __getattr__(self, name):
        return getattr(torch, name)

    def load(self, f, *args, **kwargs):
        kwargs["weights_only"] = True
        loaded = torch.load(f, *args, **kwargs)
        osd = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
        if self.state_key is not None and isinstance(osd, dict):
            key = (
                "single_partition_of_fp32_groups"
                if "single_partition_of_fp32_groups" in osd
                else "fp32_flat_groups"
            )
            base = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
            state = base["state"]
            osd[key] = [state[i][self.state_key][: len(part)] for i, part in zip(sorted(state), osd[key])]
        return loaded


_zero_to_fp32_lock = threading.Lock()  # the swap below is process-wide: one consolidation at a time


def _no_bar(iterable, *args, **kwargs):
    return iterable


def consolidate_checkpoint(
    directory: str | Path, tag: str, state_key: str | None = None
) -> dict[str, torch.Tensor]:
    """One fp32 state dict from a DeepSpeed checkpoint directory (any ZeRO stage); with
    ``state_key`` (ZeRO >= 1), that optimizer state per parameter instead of the weights.

    Every file is read with ``torch.load(weights_only=True)`` (plus the few DeepSpeed classes
    of :func:`safe_globals`), so a planted pickle fails to load (``pickle.UnpicklingError``)
    instead of running."""
    default_accelerator()
    from deepspeed.utils import zero_to_fp32

    path = Path(directory) / tag
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint {tag!r} in {directory}")
    with torch.serialization.safe_globals(safe_globals()):
        if not list(path.glob("*optim_states.pt")):  # ZeRO-0: the module state is stored whole
            if (
                state_key is not None
            ):  # its optimizer state is per parameter: mmalign.run.reshard.zero0_moments
                raise ValueError(
                    f"consolidate_checkpoint: {path} is a ZeRO-0 checkpoint; state_key is for "
                    f"ZeRO >= 1 partitions"
                )
            model_file = next(iter(sorted(path.glob("mp_rank_*_model_states.pt"))), None)
            if model_file is None:
                raise FileNotFoundError(f"no model states in {path}")
            state = torch.load(model_file, map_location="cpu", weights_only=True)["module"]
        else:
            # and no progress bars on stderr (an export or a server start is one line)
            with (
                _zero_to_fp32_lock,
                shadowed(zero_to_fp32, "torch", _WeightsOnlyTorch(state_key)),
                shadowed(zero_to_fp32, "tqdm", _no_bar),
            ):
                state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
            if state_key is None:  # locked (frozen) weights: ZeRO-1 keeps them in the module state only
                for model_file in sorted(path.glob("*model_states.pt"))[:1]:
                    module = torch.load(model_file, map_location="cpu", weights_only=True)["module"]
                    state.update({k: v for k, v in module.items() if k not in state and v.numel()})
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
