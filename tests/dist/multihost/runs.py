"""What the two-host cases compare: final weights, per-rank sample keys, logged steps."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file


def weights(run):
    return load_file(str(run / "final" / "model.safetensors"))


def sample_keys(run, rank: int) -> list[tuple[int, tuple[str, ...]]]:
    lines = (run / f"samples_rank{rank}.jsonl").read_text().splitlines()
    return [(r["step"], tuple(r["keys"])) for r in map(json.loads, lines)]


def metric_steps(run) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(run, ref) -> None:
    """Bitwise equal ``final/`` weights, the same per-rank sample keys, each step logged once."""
    a, b = weights(run), weights(ref)
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ from the reference, e.g. {different[:3]}"
    for rank in (0, 1):
        assert sample_keys(run, rank) == sample_keys(ref, rank), f"rank {rank} read other samples"
    assert metric_steps(run) == list(range(1, 13))
