"""The EMA weights in a step checkpoint: each rank's file and how the pieces make whole tensors.

Under ZeRO each rank keeps the exponential moving average of its own piece of the fp32 master
weights (:mod:`mmalign.run.ema`), so a checkpoint holds one file per rank
(:func:`mmalign.layout.run_dir.ema_file`), each a plain dict (``torch.load(weights_only=True)``)::

    {"version": 1, "decay": d, "warmup": bool, "updates": n,
     "shapes": {name: [full shape]},                      # every parameter the EMA covers
     "pieces": {name: {"start": s, "value": (k,) fp32}}}  # this rank's elements [s, s + k) of it

The pieces of all ranks tile every parameter exactly once, whatever the world size or ZeRO
stage that wrote them: :func:`assemble` rebuilds the whole tensors from them (a resume on
another world size, ``load(..., weights="ema")`` of a step checkpoint). Below ``models/``
(the loader reads it); torch only.
"""

from __future__ import annotations

from pathlib import Path

import torch

from mmalign.layout.run_dir import EMA_PREFIX

VERSION = 1


def files(step_dir: Path) -> list[Path]:
    """The EMA files of a step checkpoint in rank order (none: the run kept no EMA)."""
    found = list(Path(step_dir).glob(f"{EMA_PREFIX}_rank*.pt"))
    return sorted(found, key=lambda p: int(p.stem.rsplit("rank", 1)[1]))


def read(step_dir: Path) -> list[dict]:
    """Every rank's EMA state of ``step_dir`` (weights_only: plain tensors and containers)."""
    return [torch.load(f, map_location="cpu", weights_only=True) for f in files(step_dir)]


def assemble(states: list[dict]) -> tuple[dict[str, torch.Tensor], int]:
    """Whole fp32 tensors by name from every rank's state, and the number of EMA updates.

    ValueError (one line) when the ranks disagree on the count or the shapes, or the pieces do
    not cover a parameter exactly once (a file missing or foreign)."""
    if not states:
        raise ValueError("no EMA files")
    updates = {int(s["updates"]) for s in states}
    if len(updates) != 1:
        raise ValueError(f"the ranks' EMA files hold different update counts {sorted(updates)}")
    shapes = states[0]["shapes"]
    if any(s["shapes"] != shapes for s in states[1:]):
        raise ValueError("the ranks' EMA files describe different parameters")
    full = {
        name: torch.zeros(torch.Size(shape).numel(), dtype=torch.float32) for name, shape in shapes.items()
    }
    covered = dict.fromkeys(shapes, 0)
    for s in states:
        for name, piece in s["pieces"].items():
            if name not in full:
                raise ValueError(f"an EMA piece of {name}, which the files' shapes do not list")
            value = piece["value"].reshape(-1)
            start = int(piece["start"])
            if start < 0 or start + value.numel() > full[name].numel():
                raise ValueError(f"an EMA piece of {name} lies outside it")
            full[name][start : start + value.numel()] = value.float()
            covered[name] += value.numel()
    for name, count in covered.items():
        if count != full[name].numel():
            raise ValueError(f"the EMA pieces of {name} cover {count} of its {full[name].numel()} elements")
    return {name: t.reshape(shapes[name]) for name, t in full.items()}, updates.pop()


__all__ = ["VERSION", "assemble", "files", "read"]
