"""`mmalign quickstart`: its learning targets (value vs threshold), its phase clock, and the
summary it prints end to end (on a seconds-long config)."""

from __future__ import annotations

import logging

import pytest

from data_pipelines import shapes
from mmalign import quickstart
from mmalign.cli import quickstart_verdict
from tests.harness import run_cli


def _records(shape_acc: float, r5: float, n_images: int = 1000) -> list[dict]:
    """eval.json records as the shapes suite writes them (6 shapes: chance 1/6)."""
    return [
        {
            "dataset": "shapes/shape",
            "task": "zeroshot_classification",
            "metrics": {"acc1": shape_acc, "chance_acc1": 1 / 6},
        },
        {
            "dataset": "shapes/colour",
            "task": "zeroshot_classification",
            "metrics": {"acc1": 0.1, "chance_acc1": 1 / 7},
        },
        {
            "dataset": "shapes/retrieval",
            "task": "zeroshot_retrieval",
            "n_images": n_images,
            "metrics": {"image_retrieval_recall@5": r5},
        },
    ]


def test_targets_are_2x_and_3x_chance_with_their_measured_values():
    found = {t["name"]: t for t in quickstart.targets(_records(0.5, 0.02, n_images=1000))}
    assert set(found) == {"shape zero-shot top-1", "text->image R@5"}  # colour is no target
    shape, r5 = found["shape zero-shot top-1"], found["text->image R@5"]
    assert (shape["value"], r5["value"]) == (0.5, 0.02)
    assert shape["threshold"] == pytest.approx(2 / 6) and r5["threshold"] == pytest.approx(3 * 5 / 1000)
    assert shape["met"] and r5["met"]
    assert quickstart_verdict(_records(0.5, 0.02)) == []


def test_a_missed_target_is_one_line_naming_value_and_threshold():
    problems = quickstart_verdict(_records(0.30, 0.014, n_images=1000))
    assert problems == [
        "shape zero-shot top-1 0.300 < 2x chance 0.333",
        "text->image R@5 0.014 < 3x chance 0.015",
    ]
    at = quickstart.targets(_records(2 / 6, 0.015))  # at the threshold: met
    assert all(t["met"] for t in at)


def test_the_clock_splits_train_into_phases_from_its_log_lines():
    clock = quickstart.PhaseClock()
    clock.mark("data")
    handler, log = quickstart._MarkHandler(clock), logging.getLogger("mmalign.run.train")
    log.addHandler(handler)
    old, log.level = log.level, logging.INFO
    try:
        for line in (
            "building model tiny-rn on cpu",
            "starting DeepSpeed (ZeRO stage 0)",
            "training 5 step(s)",
            "step 1/5 loss",
            "trained 5 step(s) in 0:00:01; saving final/",
            "saved runs/x/final",
            "evaluation written to runs/x/eval.json",
            "saved something else later",
        ):
            log.info("%s", line)
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    clock.mark(None)
    names = [name for name, _, _ in clock.phases]
    assert names == [
        "python + imports",
        "data",
        "build",
        "train loop",
        "save final/",
        "evaluation",
        "wrap-up",
    ]
    wall, cpu = clock.total()
    assert sum(w for _, w, _ in clock.phases) == pytest.approx(wall, abs=0.05)
    assert all(w >= 0 and c >= 0 for _, w, c in clock.phases) and cpu > 0


class _Clock:
    def __init__(self, wall: float):
        self.wall, self.phases = wall, [("train loop", wall - 1.0, wall / 2)]

    def total(self) -> tuple[float, float]:
        return self.wall, self.wall / 2


@pytest.mark.parametrize("wall,judged", [(352.0, "met"), (quickstart.TIME_GOAL_S + 1.0, "NOT MET")])
def test_the_time_row_is_judged_against_its_stated_goal(wall, judged, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    quickstart.print_summary(_records(0.5, 0.02), _Clock(wall), tmp_path)
    row = next(ln for ln in capsys.readouterr().out.splitlines() if "time: total" in ln)
    assert "<= 10 min on 2 CPU cores" in row and row.rstrip(" │|").endswith(judged), row
    assert (quickstart.time_verdict(wall) is None) == (judged == "met")


@pytest.mark.integration
def test_quickstart_prints_targets_time_and_phases(tmp_path, monkeypatch):
    """The command itself, in a fresh folder holding a small data/shapes (so it is not
    regenerated), on the micro towers for 3 steps: the summary names each target with its
    value and threshold, the total time and every phase."""
    shapes.generate(tmp_path / "data" / "shapes", n_train=64, n_val=40, per_shard=40)
    sets = [
        "model.preset=micro",
        "model.image_size=16",
        "data.workers=0",
        "data.shuffle_buffer=20",
        "data.train=data/shapes/train/{00000..00001}.tar",
        "train.global_batch_size=16",
        "train.steps=3",
        "train.warmup_steps=1",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
    ]
    args = ["quickstart"] + [a for s in sets for a in ("--set", s)]
    monkeypatch.setenv("COLUMNS", "160")  # the rich table's width in the child: rows unwrapped
    res = run_cli(*args, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    assert "generating the synthetic shapes" not in out  # data/shapes was complete
    for row in ("shape zero-shot top-1", "text->image R@5", ">= 0.333 (2x chance)", ">= 0.375 (3x chance)"):
        assert row in out, row
    for phase in (
        "python + imports",
        "data",
        "setup",
        "build",
        "train loop",
        "save final/",
        "evaluation",
        "total",
    ):
        assert f"time: {phase} " in out, phase
    assert "quickstart finished in" in out and "s CPU" in out
    assert (tmp_path / "runs" / "quickstart" / "final" / "model.safetensors").is_file()


def test_the_recipes_text_context_holds_every_caption_and_prompt():
    """configs/quickstart.yaml cuts the text context to 16 tokens: no training caption or eval
    prompt may be truncated. The CLIP BPE splits on words, so a template's longest filling takes
    each slot's longest value (checked against the whole product for one template below)."""
    import itertools

    import yaml

    from data_pipelines.shapes import TEMPLATES
    from mmalign.config import load_config
    from mmalign.data.shapes_scene import BACKGROUNDS, COLOURS, POSITIONS, SHAPES, SIZES
    from mmalign.models.tokenizers import build_tokenizer
    from mmalign.resources import RECIPES, SUITES, shipped

    cfg = load_config(str(shipped(RECIPES, "quickstart")), [])
    context = cfg.model.text["context_length"]
    tok = build_tokenizer({"text_cfg": {"context_length": 10_000}})

    def length(text: str) -> int:  # tokens with start and end
        return int((tok([text])[0] != 0).sum())

    slots = {
        "size": list(SIZES),
        "colour": list(COLOURS),
        "shape": list(SHAPES),
        "position": list(POSITIONS.values()),
        "background": list(BACKGROUNDS),
    }
    longest = {k: max(v, key=lambda w: length(w)) for k, v in slots.items()}
    lengths = [length(t.format(**longest)) for t in TEMPLATES]
    brute = max(
        length(TEMPLATES[0].format(size=s, colour=c, shape=sh, position=p, background="x"))
        for s, c, sh, p in itertools.product(*(slots[k] for k in ("size", "colour", "shape", "position")))
    )
    assert brute == lengths[0]
    suite = yaml.safe_load(shipped(SUITES, "shapes").read_text())
    for task in suite["tasks"]:
        for template in task.get("templates", []):
            lengths += [length(template.format(c=c)) for c in task["classnames"]]
    assert max(lengths) <= context, (max(lengths), context)
    assert max(lengths) > context - 4  # the bound is tight, not a loose guess
