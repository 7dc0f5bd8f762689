"""The training loader's position carried over to another world size or worker count.

Since the data order is a function of the global batch alone (one lane per row,
:mod:`mmalign.data.stream`), the position of a run is the state of each lane, wherever it
was read.  A resume on another world size merges the lane states of every old rank into one
loader state; each new rank takes its own lanes from it (:func:`convert`), and the order goes
on exactly as the uninterrupted run's.  A change of workers needs nothing at all.

A loader state written before lanes (version 1 or 2: one stream per rank and worker) has no
lane positions.  Its lanes restart at the step it records (:func:`from_slots`):

* **resampled**: the lanes start virtual epoch ``2**32 + step`` (shard draws the
  uninterrupted run never reaches, so nothing is replayed from the run's start);
* **epoch**: the lanes restart the lowest epoch any old stream was in, so samples of that
  epoch consumed before the checkpoint come once more in it.

Either way the log says what happened.  Skip counts are kept (summed into one lane of the
rank they belonged to; lane 0 when every old rank's are merged).
"""

from __future__ import annotations

from typing import Any

from mmalign.data.stream import RESTART, StreamSpec  # noqa: F401 (RESTART re-exported)


def _skipped(states: list[dict]) -> dict[str, int]:
    """The skip counts of pre-lane states, summed over their streams."""
    skipped: dict[str, int] = {}
    for state in states:
        for st in state.get("slots", {}).values():
            for reason, count in st.get("skipped", {}).items():
                skipped[reason] = skipped.get(reason, 0) + int(count)
    return dict(sorted(skipped.items()))


def from_slots(states: list[dict], spec: StreamSpec, step: int, into: int = 0) -> dict:
    """A lane state for every lane from pre-lane loader states (every old rank's, or one rank's
    own); their skip counts go to lane ``into`` (a lane of the rank that keeps them)."""
    epoch = min(
        (int(st.get("epoch", 0)) for state in states for st in state.get("slots", {}).values()), default=0
    )
    lanes: dict[str, dict[str, Any]] = {
        str(lane): {
            "epoch": epoch if spec.mode == "epoch" else RESTART + step,
            "cursor": 0,
            "shard": None,
            "emitted": step * RESTART,
            "skipped": {},
            "buffer": [],
        }
        for lane in range(spec.lanes)
    }
    lanes[str(into)]["skipped"] = _skipped(states)
    first = states[0]
    # mode, seed and shards as saved: the loader refuses a resume that changes them
    return {
        "version": 3,
        "mode": first.get("mode"),
        "seed": first.get("seed"),
        "lanes": spec.lanes,
        "shards": first.get("shards"),
        "consumed": step,
        "lane_states": lanes,
        "restarted": True,
    }


def convert(states: list[dict], spec: StreamSpec, rank: int, step: int) -> tuple[dict, str]:
    """One loader state holding the lanes of every old rank (``states``, old rank order), for
    rank ``rank`` of a run resumed at step ``step``; and a phrase saying what happened to the
    order."""
    old_world = len(states)
    if any(state.get("version") in (1, 2) for state in states):
        return (
            from_slots(states, spec, step),
            f"data order restarted at step {step}: the checkpoint's data position predates lanes "
            f"({spec.mode} mode: "
            + (
                "shard draws start afresh)"
                if spec.mode == "resampled"
                else "the epoch in progress starts over)"
            ),
        )
    lanes: dict[str, dict] = {}
    for state in states:
        lanes.update(state.get("lane_states", {}))
    first = states[0]
    merged = {
        **first,
        "rank": rank,
        "consumed": step,
        "lane_states": dict(sorted(lanes.items(), key=lambda kv: int(kv[0]))),
    }
    return (
        merged,
        f"data order unchanged (the {len(lanes)} lanes of {old_world} old rank(s) continue where they stopped)",
    )


__all__ = ["RESTART", "convert", "from_slots"]
