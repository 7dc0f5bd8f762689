"""Two training tools' speed side by side: settings, alternated runs (A B A B), medians, ratios.

On a shared machine one timing measures the neighbours as much as the tool; timings taken
back to back, alternating the tools, see about the same load, so their ratio is the most
trustworthy number such a machine gives.  This module holds the bookkeeping of that
comparison (bench/quality_cifar10.py ``--parts speed`` runs the trainings):

- a *setting* is a name like ``bf16+compile+w2``: ``+``-joined tokens, a precision first
  (each tool's own word: ``fp32``, ``bf16`` for mmalign, ``amp_bf16`` for open_clip_train),
  then ``compile`` (torch.compile of the towers) and ``wN`` (N loader workers; default 1);
- ``alternation`` orders the runs: per repetition, per setting index, tool A then tool B;
- ``summarise`` takes the median samples/s of each (tool, setting), the equal-settings pair
  (each tool's first setting) and each tool's best setting, and their ratios B/A;
- ``speed_table`` writes the markdown with the goals and whether each is met.
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict

EQUAL_GOAL = 1.15  # mmalign / open_clip_train samples/s at equal fp32 settings (issue 20)
BEST_GOAL = 1.5  # the same at each tool's best setting

PRECISIONS = {
    "open_clip": ("fp32", "amp_bf16", "amp", "bf16", "pure_bf16"),
    "mmalign": ("fp32", "bf16", "fp16"),
}


def setting_args(tool: str, setting: str) -> dict:
    """``{"precision": ..., "workers": N, "compile": bool}`` of a setting name; ValueError if malformed."""
    tokens = setting.split("+")
    if tokens[0] not in PRECISIONS[tool]:
        raise ValueError(
            f"{tool} setting {setting!r}: the first token must be a precision, one of "
            f"{', '.join(PRECISIONS[tool])}"
        )
    out = {"precision": tokens[0], "workers": 1, "compile": False}
    for tok in tokens[1:]:
        if tok == "compile":
            out["compile"] = True
        elif re.fullmatch(r"w\d+", tok):
            out["workers"] = int(tok[1:])
        else:
            raise ValueError(f"{tool} setting {setting!r}: unknown token {tok!r} (compile or wN)")
    return out


def alternation(settings: dict[str, list[str]], reps: int) -> list[tuple[str, str, int]]:
    """(tool, setting, repetition) in run order: for each repetition, for each setting index, the
    tools in ``settings``' order; a tool with fewer settings is left out of the later indices."""
    width = max(len(v) for v in settings.values())
    return [
        (tool, names[i], rep)
        for rep in range(reps)
        for i in range(width)
        for tool, names in settings.items()
        if i < len(names)
    ]


def summarise(runs: list[dict], settings: dict[str, list[str]]) -> dict:
    """Medians per (tool, setting) over ``runs`` (dicts with tool, setting, samples_per_s), and the
    equal (first settings) and best (highest median) comparisons of the second tool over the first."""
    rates: dict = defaultdict(list)
    for r in runs:
        rates[(r["tool"], r["setting"])].append(r["samples_per_s"])
    med = {k: statistics.median(v) for k, v in rates.items()}
    a, b = list(settings)
    best = {t: max(settings[t], key=lambda s, t=t: med[(t, s)]) for t in (a, b)}

    def pair(sa: str, sb: str) -> dict:
        return {
            a: {"setting": sa, "median": med[(a, sa)], "runs": rates[(a, sa)]},
            b: {"setting": sb, "median": med[(b, sb)], "runs": rates[(b, sb)]},
            "ratio": med[(b, sb)] / med[(a, sa)],
        }

    return {
        "tools": [a, b],
        "medians": {f"{t}/{s}": v for (t, s), v in med.items()},
        "equal": pair(settings[a][0], settings[b][0]),
        "best": pair(best[a], best[b]),
    }


def speed_table(summary: dict, goals: tuple[float, float] = (EQUAL_GOAL, BEST_GOAL)) -> str:
    a, b = summary["tools"]
    lines = [
        f"| comparison | {a} setting | {a} samples/s | {b} setting | {b} samples/s | {b} / {a} | goal | met |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, label, goal in (
        ("equal", "equal settings (fp32)", goals[0]),
        ("best", "each at its best", goals[1]),
    ):
        row = summary[key]
        cells = [
            f"{row[t]['setting']} | {row[t]['median']:.1f} ({', '.join(f'{x:.1f}' for x in row[t]['runs'])})"
            for t in (a, b)
        ]
        lines.append(
            f"| {label} | {cells[0]} | {cells[1]} | {row['ratio']:.2f}x | >= {goal:g}x | "
            f"{'yes' if row['ratio'] >= goal else 'no'} |"
        )
    lines.append(
        "\nMedians of all settings (samples/s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in sorted(summary["medians"].items()))
        + "."
    )
    return "\n".join(lines)
