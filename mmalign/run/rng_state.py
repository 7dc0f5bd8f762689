"""Every random generator a run consumes, saved and restored as ``weights_only``-loadable values.

Its own module: checkpoints save it (``checkpoint``) and a change of world size re-derives it
(``reshard``), which ``checkpoint`` itself imports.
"""

from __future__ import annotations

import random
from typing import Any, cast

import numpy as np
import torch


def rng_state() -> dict:
    """Every generator the loop consumes, as weights_only-loadable values."""
    np_state = cast(tuple[Any, ...], np.random.get_state())  # legacy form: (name, keys, pos, gauss...)
    py = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        # this rank's device only: get_rng_state_all() would create a CUDA context on every visible
        # GPU in every rank (with 8 ranks x 8 GPUs, 7 stray contexts per GPU)
        "cuda": [torch.cuda.get_rng_state()] if torch.cuda.is_available() else [],
        "python": list(py[1]),
        "python_version": py[0],
        "python_gauss": [] if py[2] is None else [py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        # one state (this rank's device); a checkpoint from before held every visible device's
        cuda = state["cuda"]
        torch.cuda.set_rng_state(cuda[0] if len(cuda) == 1 else cuda[torch.cuda.current_device()])
    gauss = state["python_gauss"][0] if state["python_gauss"] else None
    random.setstate((state["python_version"], tuple(int(v) for v in state["python"]), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
