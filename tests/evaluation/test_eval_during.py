"""Evaluators on their own schedules during training (``eval.during``, issue 32 point 4).

One 1-rank run of 6 steps with two suites (A every 2 steps on a 40-image draw, B every 3 on
all 120 images) and ``eval.suite: shapes`` is shared by the tests: which steps evaluated
which suite; the values in metrics.jsonl and TensorBoard against the same suite evaluated
directly (``run_suite``) on the step checkpoints' weights; one classifier build per zero-shot
task per evaluation; the final evaluation holding every suite, whole; a 2-rank run giving
the 1-rank run's numbers; bad entries as one line before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.harness import cli_main, run_ranks

pytestmark = pytest.mark.integration

STEPS = 6
LIMIT = 40  # of the 120 validation images
SUITE_A = """name: suite_a
tasks:
  - {name: shape, type: zeroshot, label_field: shape, templates: ["a {c}.", "a drawing of a {c}."],
     classnames: [circle, square, triangle, star, cross, diamond]}
"""
# a counterfactual task scores the zero-shot classifiers built before it: no second build
SUITE_B = """name: suite_b
tasks:
  - {name: colour, type: zeroshot, label_field: colour, templates: ["a {c} shape.", "something {c}."],
     classnames: [red, green, blue, yellow, purple, orange, pink]}
  - {name: flips, type: counterfactual, edits: [{name: hflip}], tasks: [colour], limit: 8}
"""


def _overrides(shapes_dir: Path, out: Path, suites: Path) -> list[str]:
    return [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        f"train.steps={STEPS}",
        "train.warmup_steps=1",
        "train.lr=0.002",
        "train.log_every=3",
        "monitor.probe_size=0",
        "eval.batch_size=16",  # 40 images: 3 batches
        "eval.suite=shapes",
        f"output={out}",
        f"eval.during=[{{suite: {suites / 'a.yaml'}, every: 2, limit: {LIMIT}}}, "
        f"{{suite: {suites / 'b.yaml'}, every: 3}}]",
    ]


def _suites(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "a.yaml").write_text(SUITE_A)
    (folder / "b.yaml").write_text(SUITE_B)
    return folder


def _eval_records(out: Path) -> list[dict]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "eval" in r]


@pytest.fixture(scope="module")
def run(shapes_dir, tmp_path_factory):
    """The 1-rank run (step checkpoints kept for the reference), with every classifier build
    (the sharded evaluation assembles each from its prompts' embeddings once) and every suite
    evaluation counted in order."""
    from mmalign.config import load_config
    from mmalign.evaluation import sharded
    from mmalign.evaluation.tasks import zeroshot as zeroshot_kind
    from mmalign.run.train import train

    root = tmp_path_factory.mktemp("during")
    suites = _suites(root / "suites")
    overrides = _overrides(shapes_dir, root / "run", suites)
    events: list[tuple[str, str]] = []
    build, assemble, evaluate = (
        zeroshot_kind.build_classifier,
        sharded.classifier_from_prompts,
        sharded.evaluate,
    )

    def counted_build(encode, tokenizer, classnames, templates, *args):
        events.append(("classifier", classnames[0]))
        return build(encode, tokenizer, classnames, templates, *args)

    def counted_assemble(emb, n_classes, n_templates):
        events.append(("classifier", n_classes))
        return assemble(emb, n_classes, n_templates)

    def counted_evaluate(model, preprocess, tokenizer, suite, *args, **kwargs):
        events.append(("evaluate", suite["name"]))
        return evaluate(model, preprocess, tokenizer, suite, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(zeroshot_kind, "build_classifier", counted_build)
        mp.setattr(sharded, "classifier_from_prompts", counted_assemble)
        mp.setattr(sharded, "evaluate", counted_evaluate)
        cfg = load_config(None, overrides + ["train.checkpoint_every=1", f"train.keep_checkpoints={STEPS}"])
        out = train(cfg, show_progress=False)
    return {"out": out, "events": events, "suites": suites, "overrides": overrides, "root": root}


def test_each_suite_follows_its_own_schedule(run):
    out = run["out"]
    seen = [(r["step"], r["eval"], r["images"]) for r in _eval_records(out)]
    # in the loop: A at 2 and 4 (on its draw), B at 3; step 6 is the final evaluation's, whole
    assert seen == [
        (2, "suite_a", LIMIT),
        (3, "suite_b", 120),
        (4, "suite_a", LIMIT),
        (6, "suite_a", 120),
        (6, "suite_b", 120),
    ]
    steps = sorted(p.name for p in out.glob("eval_step*.json"))
    assert steps == ["eval_step00000002.json", "eval_step00000003.json", "eval_step00000004.json"]
    assert {r["dataset"] for r in json.loads((out / "eval_step00000003.json").read_text())} == {
        "suite_b/colour",
        "suite_b/flips",
    }
    train_records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in train_records if "eval" not in r] == [3, 6]  # train.log_every=3, untouched


def test_the_logged_numbers_are_the_suite_evaluated_directly_on_the_step_weights(run):
    """metrics.jsonl and the TensorBoard event files against run_suite on checkpoints/step_N."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mmalign.config import load_config
    from mmalign.evaluation import load_suite, run_suite
    from mmalign.evaluation.limited import limited_suite
    from mmalign.models.load import load
    from mmalign.run.runlog import eval_scalars

    out, suites = run["out"], run["suites"]
    val = load_config(None, run["overrides"]).data.val
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    board = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    checked = 0
    for record in _eval_records(out):
        step, name = record["step"], record["eval"]
        suite = load_suite(str(suites / ("a.yaml" if name == "suite_a" else "b.yaml")))
        if step != STEPS and name == "suite_a":
            suite = limited_suite(suite, LIMIT)
        weights = out / "checkpoints" / f"step_{step:08d}"
        loaded = load(weights if weights.is_dir() else out / "final")
        want = eval_scalars(
            run_suite(loaded.model, loaded.preprocess, loaded.tokenizer, suite, val, batch_size=16)
        )
        got = {k: v for k, v in record.items() if k.startswith("eval/")}
        assert got.keys() == want.keys() and len(want) >= 3, (step, name, sorted(got))
        for tag, value in want.items():
            assert got[tag] == pytest.approx(value, abs=1e-6), (step, tag)
            assert board[tag][step] == pytest.approx(value, abs=1e-6), (step, tag)
            checked += 1
    assert checked > 20
    # A: steps 2, 4 in the loop and 6 at the end; B: 3 and 6; eval.suite's shapes: the end only
    assert set(board["eval/suite_a/shape/acc1"]) == {2, 4, 6}
    assert set(board["eval/suite_b/colour/acc1"]) == {3, 6}
    assert set(board["eval/shapes/shape/acc1"]) == {6}


def test_one_classifier_per_zero_shot_task_per_evaluation(run):
    """40 images in batches of 16, a counterfactual task reusing B's classifier: still one build
    per zero-shot task and evaluation."""
    evaluations, current = [], None
    for kind, what in run["events"]:
        if kind == "evaluate":
            current = [what, []]
            evaluations.append(current)
        else:
            current[1].append(what)
    assert evaluations == [
        # a classifier named by its first class (built in one process) or its class count (assembled
        # by the sharded evaluation: 6 shapes, 7 colours)
        ["suite_a", [6]],
        ["suite_b", [7]],
        ["suite_a", [6]],  # steps 2, 3, 4
        ["shapes", [6, 7]],
        ["suite_a", [6]],
        ["suite_b", [7]],  # the final evaluation
    ]


def test_the_final_evaluation_holds_every_suite_once_and_whole(run):
    records = json.loads((run["out"] / "eval.json").read_text())
    datasets = [r["dataset"] for r in records]
    assert datasets == [
        "shapes/shape",
        "shapes/colour",
        "shapes/retrieval",
        "suite_a/shape",
        "suite_b/colour",
        "suite_b/flips",
    ]
    assert {r["n_images"] for r in records if r["task"] != "counterfactual"} == {120}


def _train_rank(rank: int, world: int, overrides: list[str]) -> None:
    from mmalign.config import load_config
    from mmalign.run.train import train

    train(load_config(None, overrides, world), show_progress=False)


def test_two_ranks_log_the_numbers_of_one(run, shapes_dir):
    """The same run on 2 ranks (each embedding half of every suite): the same evaluation records."""
    out = run["root"] / "two_ranks"
    run_ranks(_train_rank, 2, _overrides(shapes_dir, out, run["suites"]), group=False)
    one, two = _eval_records(run["out"]), _eval_records(out)
    assert [(r["step"], r["eval"]) for r in two] == [(r["step"], r["eval"]) for r in one]
    for a, b in zip(one, two):
        assert b.keys() == a.keys()
        for key in a:
            if key.startswith("eval/"):
                assert b[key] == pytest.approx(a[key], abs=1e-6), (a["step"], key)
    final_one = {r["dataset"]: r["metrics"] for r in json.loads((run["out"] / "eval.json").read_text())}
    final_two = {r["dataset"]: r["metrics"] for r in json.loads((out / "eval.json").read_text())}
    assert final_two.keys() == final_one.keys()


@pytest.mark.parametrize(
    "entry, message",
    [
        (
            "[{suite: shapes, every: 2, evry: 3}]",
            "unknown config key 'eval.during[0].evry' (valid: every, limit, suite)",
        ),
        ("[{suite: shapes, every: 0}]", "config key 'eval.during[0].every' must be >= 1 steps, got 0"),
        ("[{suite: shapes}]", "config key 'eval.during[0].every' is required"),
        (
            "[{suite: digits, every: 2, limit: -5}]",
            "config key 'eval.during[0].limit' must be >= 1 images, got -5",
        ),
        (
            "[{suite: digits, every: 2}, {suite: shapez, every: 3}]",
            "config key 'eval.during[1].suite': unknown suite 'shapez'",
        ),
        (
            "[{suite: digits, every: 2}, {suite: digits, every: 5, limit: 10}]",
            "config key 'eval.during[1].suite': suite 'digits' is already evaluated during training",
        ),
        (
            "[{suite: shapes, every: 3}]",
            "config key 'eval.during[0].suite': suite 'shapes' is already evaluated "
            "during training by train.eval_every",
        ),
    ],
)
def test_a_bad_entry_is_one_line_before_anything_runs(micro_overrides, tmp_path, entry, message):
    out = tmp_path / "bad"
    args = ["train", "--output", str(out)]
    for o in [o for o in micro_overrides if not o.startswith("output=")] + [
        "train.eval_every=2",
        f"eval.during={entry}",
    ]:
        args += ["--set", o]
    res = cli_main(*args)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "Traceback" not in res.stderr, res.stderr[-2000:]
    assert lines[0].startswith(f"mmalign: error: {message}"), lines[0]
    assert not out.exists()
