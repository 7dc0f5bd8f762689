"""Which weights a run trains: each tower locked, partly unlocked or trainable (LiT's
``model.lock_image`` / ``model.lock_text``), and the trainable and frozen parameter counts.

A locked tower is easy to miss: the loss still falls (the other tower and the temperature
learn), so a run states it at the start, on stdout, in ``train.log`` and in the first record
of ``metrics.jsonl`` (:func:`param_counts` gives the fields, :func:`describe` the line).

A tower's state is read from its parameters' ``requires_grad``, not from the config, so the
line says what the optimiser will see whatever set the flags (the towers' own ``lock()``).
Counts are taken before DeepSpeed builds the engine: under ZeRO-3 the parameters are
partitioned afterwards and each rank holds only a slice.
"""

from __future__ import annotations

from torch import nn

from mmalign.config import ModelConfig

# (name in the line and the record, TwoTower attribute, config key of the partial unlock, its unit)
TOWERS = (
    ("image", "visual", "lock_image_unlocked_groups", "layer group"),
    ("text", "text", "lock_text_unlocked_layers", "layer"),
)


def _split(module: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) parameter counts of ``module``."""
    trainable = frozen = 0
    for p in module.parameters():
        if p.requires_grad:
            trainable += p.numel()
        else:
            frozen += p.numel()
    return trainable, frozen


def _state(trainable: int, frozen: int) -> str:
    if trainable and frozen:
        return "partly unlocked"
    return "locked" if frozen else "trainable"


def param_counts(model: nn.Module, cfg: ModelConfig) -> dict:
    """The fields the run's first metrics record carries: ``params_trainable``, ``params_frozen``
    (the whole model, the temperature included), and per tower its state (``image_tower``,
    ``text_tower``: locked / partly unlocked / trainable) and its own two counts."""
    trainable, frozen = _split(model)
    counts: dict = {"params_trainable": trainable, "params_frozen": frozen}
    for name, attr, unlocked_key, _ in TOWERS:
        t, f = _split(getattr(model, attr))
        counts[f"{name}_tower"] = _state(t, f)
        counts[f"{name}_params_trainable"], counts[f"{name}_params_frozen"] = t, f
        if counts[f"{name}_tower"] == "partly unlocked":
            counts[f"{name}_unlocked"] = int(getattr(cfg, unlocked_key))
    return counts


def describe(counts: dict) -> str:
    """One line: ``parameters: 1,234 trainable, 5,678 frozen; image tower: locked (5,678
    frozen), text tower: trainable (1,200)``; a partly unlocked tower names its unlocked groups."""
    towers = []
    for name, _, _, unit in TOWERS:
        state, t, f = (
            counts[f"{name}_tower"],
            counts[f"{name}_params_trainable"],
            counts[f"{name}_params_frozen"],
        )
        if state == "locked":
            detail = f"{f:,} frozen"
        elif state == "trainable":
            detail = f"{t:,}"
        else:
            n = counts.get(f"{name}_unlocked", 0)
            detail = f"last {n} {unit}{'s' if n != 1 else ''}: {t:,} trainable, {f:,} frozen"
        towers.append(f"{name} tower: {state} ({detail})")
    return (
        f"parameters: {counts['params_trainable']:,} trainable, {counts['params_frozen']:,} frozen; "
        + ", ".join(towers)
    )


def dropout_line(model: nn.Module) -> str | None:
    """The one random draw of a run that stays per rank: tower dropout (p > 0), from each rank's
    torch generator (as in open_clip).  None when no tower has any; else the line a run states
    at its start, since the same config on another number of ranks then trains another model
    (everything a sample draws is keyed by the sample: mmalign/data/seeds.py)."""
    rates = sorted({round(m.p, 6) for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0})
    if not rates:
        return None
    return (
        f"tower dropout (p = {', '.join(map(str, rates))}) draws from each rank's generator: the same config "
        f"on another number of ranks trains with other dropout masks (the data order, augmentation and FLIP "
        f"masks do not change)"
    )
