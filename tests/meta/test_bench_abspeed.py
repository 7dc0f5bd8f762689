"""bench/abspeed.py, the bookkeeping of the speed comparison against open_clip_train: the run order
alternates the tools (A B A B), each cell is the median of its runs, the equal pair is each tool's
first setting, the best pair each tool's fastest median, and the ratio is B / A against the goals.
Pure functions on tiny inputs; no training is run."""

from __future__ import annotations

import importlib.util

import pytest

from tests.harness import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("bench_abspeed_under_test", ROOT / "bench" / "abspeed.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


ab = _load()
SETTINGS = {"open_clip": ["fp32", "amp_bf16"], "mmalign": ["fp32", "bf16", "bf16+compile"]}


def test_alternation_is_a_b_a_b_per_setting_and_repetition():
    order = ab.alternation(SETTINGS, reps=2)
    one = [
        ("open_clip", "fp32"),
        ("mmalign", "fp32"),
        ("open_clip", "amp_bf16"),
        ("mmalign", "bf16"),
        ("mmalign", "bf16+compile"),
    ]
    assert order == [(t, s, 0) for t, s in one] + [(t, s, 1) for t, s in one]


def test_setting_args_parses_tokens_and_rejects_others():
    assert ab.setting_args("mmalign", "bf16+compile+w2") == {
        "precision": "bf16",
        "workers": 2,
        "compile": True,
    }
    assert ab.setting_args("open_clip", "amp_bf16") == {
        "precision": "amp_bf16",
        "workers": 1,
        "compile": False,
    }
    with pytest.raises(ValueError, match="precision"):
        ab.setting_args("mmalign", "amp_bf16")  # open_clip's word, not mmalign's
    with pytest.raises(ValueError, match="unknown token 'fast'"):
        ab.setting_args("open_clip", "fp32+fast")


def _runs(rates: dict) -> list[dict]:
    return [{"tool": t, "setting": s, "samples_per_s": x} for (t, s), xs in rates.items() for x in xs]


def test_summary_medians_equal_and_best_pairs_and_ratio():
    runs = _runs(
        {
            ("open_clip", "fp32"): [100.0, 90.0, 200.0],
            ("open_clip", "amp_bf16"): [80.0, 70.0],
            ("mmalign", "fp32"): [120.0, 110.0, 5.0],
            ("mmalign", "bf16"): [150.0, 170.0],
            ("mmalign", "bf16+compile"): [140.0, 130.0],
        }
    )
    s = ab.summarise(runs, SETTINGS)
    # medians: odd count -> the middle value (an outlier does not move it); even -> mean of the two middle
    assert s["equal"]["open_clip"] == {"setting": "fp32", "median": 100.0, "runs": [100.0, 90.0, 200.0]}
    assert s["equal"]["mmalign"]["median"] == 110.0
    assert s["equal"]["ratio"] == pytest.approx(1.10)
    assert s["best"]["open_clip"]["setting"] == "fp32"  # amp_bf16's median 75 is slower
    assert s["best"]["mmalign"]["setting"] == "bf16" and s["best"]["mmalign"]["median"] == 160.0
    assert s["best"]["ratio"] == pytest.approx(1.60)
    table = ab.speed_table(s)
    rows = [line for line in table.splitlines() if line.startswith("| equal") or line.startswith("| each")]
    assert rows[0].endswith("| 1.10x | >= 1.15x | no |")
    assert rows[1].endswith("| 1.60x | >= 1.5x | yes |")
    assert "mmalign/bf16+compile 135.0" in table
