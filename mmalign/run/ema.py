"""``train.ema_decay``: an exponential moving average of the weights, sharded like them.

After each optimizer step that was not skipped (a non-finite step changes nothing), every
trainable parameter's EMA moves towards its fp32 master weight::

    d_t = min(d, (1 + t) / (10 + t))   with train.ema_warmup (t = the updates before this one), else d
    ema <- ema * d_t + theta * (1 - d_t)   in float32, each product rounded on its own

so the result does not depend on how the elements are split over ranks: a rank folds only its
own piece of the master copy (:meth:`mmalign.run.engine.Engine.master_pieces`: its fragments of
ZeRO's flat partitions; at ZeRO-0, where every rank holds the whole weights, every parameter
whole, rank 0's copy being the one saved), and the EMA costs each rank one fp32 copy of what it
holds. The EMA starts from the weights training starts from (a pretrained
model's too). Frozen parameters and buffers have no EMA of their own: the EMA model takes them
from the raw weights (a frozen weight's average is itself).

Checkpoints: each rank writes its pieces (:mod:`mmalign.layout.ema_pieces`, the format and the
reassembly) and a resume restores them bit for bit; on another world size or ZeRO stage the
pieces of every rank are put together and cut again. At the end the EMA model is consolidated
(a collective), written to ``RUN/final_ema/`` and evaluated beside ``final/``
(:mod:`mmalign.run.in_run_eval`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmalign.config import ConfigError
from mmalign.dist import distributed as mdist
from mmalign.layout import ema_pieces
from mmalign.layout.run_dir import ema_file


def decay_at(decay: float, warmup: bool, updates: int) -> float:
    """The decay of the update that follows ``updates`` earlier ones."""
    return min(decay, (1 + updates) / (10 + updates)) if warmup else decay


class Ema:
    """This rank's EMA of its pieces of the fp32 master weights (see the module doc)."""

    def __init__(self, engine, decay: float, warmup: bool = True):
        if not 0 < decay < 1:
            raise ConfigError(f"config key 'train.ema_decay': {decay} is outside (0, 1)")
        self.engine, self.decay, self.warmup, self.updates = engine, float(decay), bool(warmup), 0
        # ZeRO-0: every rank folds the whole weights; rank 0's copy alone is saved and summed
        self.replicated = bool(engine.master_replicated)
        self.shapes = {name: list(shape) for name, shape in engine.trainable_shapes().items()}
        pieces = engine.master_pieces()
        self.names = [name for name, _, _ in pieces]
        self.starts = [start for _, start, _ in pieces]
        self.values = [v.detach().float().clone() for _, _, v in pieces]  # on the master copy's device

    def layout(self) -> list[tuple[str, int, int]]:
        """(name, start, length) of this rank's pieces."""
        return [(n, s, v.numel()) for n, s, v in zip(self.names, self.starts, self.values)]

    @torch.no_grad()
    def update(self) -> None:
        """Fold the current master weights in (after a step that was not skipped)."""
        d = decay_at(self.decay, self.warmup, self.updates)
        current = [v for _, _, v in self.engine.master_pieces()]
        if len(current) != len(self.values):
            raise RuntimeError("EMA: this rank's pieces of the master weights changed during the run")
        if current:
            torch._foreach_mul_(self.values, d)
            torch._foreach_add_(self.values, torch._foreach_mul([c.float() for c in current], 1.0 - d))
        self.updates += 1

    def _owns_pieces(self) -> bool:
        """Whether this rank's pieces count once over the ranks (replicated: rank 0's alone)."""
        return not self.replicated or mdist.get_rank() == 0

    def state_dict(self) -> dict:
        """This rank's checkpoint file (:mod:`mmalign.layout.ema_pieces`'s format); with the
        weights replicated (ZeRO-0) the other ranks' files hold no pieces."""
        mine = self._owns_pieces()
        return {
            "version": ema_pieces.VERSION,
            "decay": self.decay,
            "warmup": self.warmup,
            "updates": self.updates,
            "shapes": self.shapes,
            "pieces": {
                n: {"start": s, "value": v.detach().cpu().clone()}
                for n, s, v in zip(self.names, self.starts, self.values)
                if mine
            },
        }

    @torch.no_grad()
    def restore(self, step_dir: Path) -> None:
        """Take the EMA saved in ``step_dir``: this rank's own file when it was cut as this rank
        cuts it now, else every rank's pieces put together and cut again (another world size or
        ZeRO stage). Values are copied, never recomputed. One ConfigError line when the
        checkpoint holds no EMA or one of another model."""
        key = "config key 'train.ema_decay'"
        found = ema_pieces.files(step_dir)
        if not found:
            raise ConfigError(f"{key}: {step_dir} holds no EMA weights (written by a run without an EMA)")
        own = Path(step_dir) / ema_file(mdist.get_rank())
        state = None
        if len(found) == mdist.get_world_size() and own.is_file():
            state = torch.load(own, map_location="cpu", weights_only=True)
            mine = [(n, int(p["start"]), p["value"].numel()) for n, p in state["pieces"].items()]
            if state["shapes"] != self.shapes or sorted(mine) != sorted(self.layout()):
                state = None  # cut another way (another ZeRO stage): put together below
        if state is not None:
            for i, name in enumerate(self.names):
                self.values[i].copy_(state["pieces"][name]["value"].reshape(-1))
            self.updates = int(state["updates"])
            return
        try:
            full, updates = ema_pieces.assemble(ema_pieces.read(step_dir))
        except (ValueError, KeyError, RuntimeError) as e:
            raise ConfigError(f"{key}: the EMA weights in {step_dir} cannot be read: {e}") from None
        for name, shape in self.shapes.items():
            if name not in full or list(full[name].shape) != shape:
                raise ConfigError(f"{key}: the EMA weights in {step_dir} do not fit this model ({name})")
        for i, (name, start, length) in enumerate(self.layout()):
            self.values[i].copy_(full[name].reshape(-1)[start : start + length])
        self.updates = updates

    @torch.no_grad()
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The EMA model's full fp32 state dict on every rank (a collective): the raw weights'
        (:meth:`mmalign.run.engine.Engine.consolidated_state_dict`) with every trainable
        parameter replaced by its EMA, the pieces summed over ranks into one flat buffer."""
        state = self.engine.consolidated_state_dict()
        numels = {name: torch.Size(shape).numel() for name, shape in self.shapes.items()}
        offsets, total = {}, 0
        for name, n in numels.items():
            offsets[name], total = total, total + n
        # on the module's device, where the collectives run (an offloaded master copy lives on the CPU)
        flat = torch.zeros(
            total, dtype=torch.float32, device=_device(self.engine)
        )  # (P,): every trainable element
        if self._owns_pieces():
            for name, start, value in zip(self.names, self.starts, self.values):
                flat.narrow(0, offsets[name] + start, value.numel()).copy_(value)
        mdist.all_reduce_sum(flat)  # each element is counted on one rank: the sum is that rank's value
        for name, shape in self.shapes.items():
            state[name] = flat.narrow(0, offsets[name], numels[name]).reshape(shape).cpu().clone()
        return state


def _device(engine) -> torch.device:
    for t in engine.module.parameters():
        return t.device
    return torch.device("cpu")


__all__ = ["Ema", "decay_at"]
