"""The training loader's position carried over to a new slot layout.

A resume on a different world size (or worker count) changes the slots
(``ranks x workers``, :mod:`mmalign.data.stream`), and every slot's stream is a
function of its slot number, so the saved per-slot states cannot be reused as
they are.  This module converts the states of all the old ranks into the state of
one new rank:

* **resampled**: there is no position to keep (shards are drawn with replacement).
  Every new slot restarts from (seed, step, slot): its shard draws and its
  per-sample augmentation counter start at ``step * 2**32`` (draw indices the
  uninterrupted run never reaches, so nothing is replayed from the run's start),
  its shuffle generator is seeded from (seed, step, slot).  The order differs from
  the uninterrupted run's; the caller logs that.
* **epoch**: the rest of each epoch still in progress is handed over, so no
  sample consumed so far in that epoch is read again in it.  For every epoch from
  the lowest to the highest one an old slot had reached, the remaining work is a
  list of shard pieces ``(url, stride, phase, offset, index)``: an old slot's open
  shard from its read position, the shards of its plan not yet opened, or its whole
  plan for an epoch it had not started.  Samples read into an old shuffle buffer
  but not yet taken are re-read by reference.  Pieces and buffered samples are dealt
  to the new slots round-robin; epochs after that follow the new layout's plan.
  A buffered sample of a later epoch (from a slot that was ahead) may come out
  while its new slot finishes the earlier epoch: each sample still comes once.

Skip counts are kept (summed into the first slot of rank 0), so the run's totals
continue.
"""

from __future__ import annotations

import dataclasses
import random

from mmalign.data.stream import StreamSpec, epoch_plan, mix

RESTART = 1 << 32  # resampled mode: a restarted slot's first draw is step * RESTART


def _old_spec(spec: StreamSpec, state: dict) -> StreamSpec:
    return dataclasses.replace(spec, world_size=int(state["world_size"]), workers=int(state["workers"]))


def _slot_states(states: list[dict]) -> dict[int, dict]:
    slots = {}
    for state in states:
        slots.update({int(s): st for s, st in state.get("slots", {}).items()})
    return slots


def _fresh(spec: StreamSpec, slot: int, step: int) -> dict:
    version, internal, gauss = random.Random(mix(spec.seed, 0x5B0F, slot, step)).getstate()
    base = step * RESTART
    return {"epoch": 0, "cursor": base if spec.mode == "resampled" else 0, "shard": None, "emitted": base,
            "skipped": {}, "rng": [version, list(internal), gauss], "buffer": []}


def _remaining(old: StreamSpec, slots: dict[int, dict]) -> tuple[int, dict[int, list], list]:
    """(lowest epoch, epoch -> the pieces still to read, buffered sample references)."""
    epochs = [int(slots.get(s, {}).get("epoch", 0)) for s in range(old.slots)]
    low, high = min(epochs), max(epochs)
    pieces: dict[int, list] = {e: [] for e in range(low, high + 1)}
    buffered = []
    for s in range(old.slots):
        st = slots.get(s, {})
        at, cursor = int(st.get("epoch", 0)), int(st.get("cursor", 0))
        for e in range(at, high + 1):
            plan = epoch_plan(old, s, e)
            if e > at:  # not started: all of it
                pieces[e] += [[u, stride, phase, 0, 0] for u, stride, phase in plan]
                continue
            shard = st.get("shard")
            if shard is not None:  # the open shard (plan[cursor - 1]) from its read position
                pieces[e].append([shard["url"], shard["stride"], shard["phase"], shard["offset"], shard["index"]])
            pieces[e] += [[u, stride, phase, 0, 0] for u, stride, phase in plan[cursor:]]
        buffered += [list(ref) for ref in st.get("buffer", [])]
    return low, pieces, buffered


def convert(states: list[dict], spec: StreamSpec, rank: int, step: int) -> tuple[dict, str]:
    """This rank's loader state under ``spec`` from the states of every old rank (old rank
    order), at training step ``step``; and a phrase saying what happened to the order."""
    old = _old_spec(spec, states[0])
    slots = _slot_states(states)
    mine = range(rank * spec.workers, (rank + 1) * spec.workers)
    new = {s: _fresh(spec, s, step) for s in mine}
    if spec.mode == "epoch":
        low, pieces, buffered = _remaining(old, slots)
        for s in mine:
            new[s]["epoch"] = low
            new[s]["plans"] = {str(e): p[s::spec.slots] for e, p in pieces.items()}
            new[s]["buffer"] = buffered[s::spec.slots]
        how = (f"epoch mode: the rest of epoch {low} is dealt to {spec.slots} slot(s) "
               f"(no sample of it is read twice), later epochs use the new layout")
    else:
        how = f"resampled mode: the streams restart from seed {spec.seed}, step {step} and {spec.slots} slot(s)"
    if rank == 0:
        skipped: dict[str, int] = {}
        for st in slots.values():
            for reason, count in st.get("skipped", {}).items():
                skipped[reason] = skipped.get(reason, 0) + int(count)
        new[0]["skipped"] = dict(sorted(skipped.items()))
    state = {
        # mode, seed and shards as saved: the loader refuses a resume that changes them
        "version": states[0]["version"], "mode": states[0]["mode"], "seed": states[0]["seed"], "rank": rank,
        "world_size": spec.world_size, "workers": spec.workers, "batch_size": spec.batch_size,
        "shards": states[0]["shards"], "consumed": 0,
        "slots": {str(s): st for s, st in sorted(new.items())},
    }
    return state, f"data order changed ({old.slots} -> {spec.slots} slots; {how})"
