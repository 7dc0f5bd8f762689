"""Suite YAML is checked like the experiment config: every shipped suite parses into its
typed tasks, and an unknown key, a wrong type or a missing required key is one line
naming the suite file, the task and the key."""

from __future__ import annotations

import typing

import pytest
import yaml

from mmalign import resources
from mmalign.errors import UsageError
from mmalign.evaluation import load_suite
from mmalign.evaluation.features import FEATURE_KINDS
from mmalign.evaluation.suite_schema import parse_suite
from mmalign.evaluation.tasks import CounterfactualTask, ProbeTask, ZeroShotTask, registered_tasks, task_class
from mmalign.evaluation.tasks.probe import FEATURES

GOOD = """\
name: mine
dataset: {type: digits, size: 16}
tasks:
  - name: digit
    type: zeroshot
    label_field: classname
    classnames: [zero, one]
    templates: ["a {c}."]
  - name: probe
    type: probe
    label_field: classname
    classnames: [zero, one]
    features: pre_projection
    knn_k: [1, 3]
  - name: cf
    type: counterfactual
    tasks: [digit]
    edits: [{name: hflip}, {name: crop, scale: 0.8}]
"""


def test_schema_covers_every_task_kind_and_feature():
    assert registered_tasks() == ["zeroshot", "retrieval", "probe", "diagnostics", "counterfactual"]
    assert [task_class(k).record_task for k in registered_tasks()] == [
        "zeroshot_classification",  # clip_benchmark's task names, where it has the task
        "zeroshot_retrieval",
        "linear_probe",
        "embedding_diagnostics",
        "counterfactual",
    ]
    assert set(typing.get_args(FEATURES)) == set(FEATURE_KINDS)


@pytest.mark.parametrize("name", resources.names(resources.SUITES))
def test_every_shipped_suite_parses(name):
    path = resources.shipped(resources.SUITES, name)
    suite = parse_suite(yaml.safe_load(path.read_text()), str(path))
    assert suite.name == name and all(type(t) is task_class(t.kind) for t in suite.tasks)
    # the mapping evaluation reads is the file's own: no key added, none lost
    raw = yaml.safe_load(path.read_text())
    assert suite.to_dict()["tasks"] == raw.get("tasks", [])
    assert load_suite(name)["tasks"][-len(raw["tasks"]) :] == raw["tasks"]


def test_a_good_suite_gives_typed_tasks(tmp_path):
    (tmp_path / "mine.yaml").write_text(GOOD)
    suite = parse_suite(yaml.safe_load(GOOD), "mine.yaml")
    zs, probe, cf = suite.tasks
    assert isinstance(zs, ZeroShotTask) and zs.classnames == ["zero", "one"] and zs.slices is None
    assert isinstance(probe, ProbeTask) and probe.features == "pre_projection" and probe.knn_k == [1, 3]
    assert isinstance(cf, CounterfactualTask) and [e.name for e in cf.edits] == ["hflip", "crop"]
    assert cf.edits[1].scale == 0.8 and cf.limit is None  # not given: the reader's default (256)
    assert load_suite(str(tmp_path / "mine.yaml")) == {
        **yaml.safe_load(GOOD),
        "tasks": yaml.safe_load(GOOD)["tasks"],
    }


def _error(tmp_path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(UsageError) as e:
        load_suite(str(path))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"suite {path}: "), message
    return message[len(f"suite {path}: ") :]


@pytest.mark.parametrize(
    "old, new, expected",
    [
        # an unknown key: in a task, at the top, in the dataset, in an edit
        (
            "    knn_k: [1, 3]\n",
            "    knn_k: [1, 3]\n    knn: 5\n",
            "task 'probe': unknown key 'knn' (valid: Cs, classnames, episodes, features, knn_k, label_field, methods, name, "
            "seed, shots, test_fraction, type, val_fraction)",
        ),
        (
            "name: mine\n",
            "name: mine\ntemplate_caption: true\n",
            "unknown key 'template_caption' (valid: dataset, extends, name, tasks, template_captions)",
        ),
        (
            "size: 16}",
            "size: 16, sise: 3}",
            "dataset: unknown key 'sise' (valid: caption_templates, limit, per_class, "
            "seed, size, stratify, type)",
        ),
        (
            "{name: crop, scale: 0.8}",
            "{name: crop, scal: 0.8}",
            "task 'cf': edit 2: unknown key 'scal' (valid: field, label, name, scale)",
        ),
        # a wrong type
        (
            "knn_k: [1, 3]",
            "knn_k: [1, three]",
            "task 'probe': key 'knn_k' expects a list of integers, got [1, 'three']",
        ),
        (
            "classnames: [zero, one]\n    templates",
            "classnames: zero\n    templates",
            "task 'digit': key 'classnames' expects a list of strings, got 'zero'",
        ),
        (
            "features: pre_projection",
            "features: backbone",
            "task 'probe': key 'features' expects one of joint, pre_projection, got 'backbone'",
        ),
        (
            "type: probe",
            "type: probes",
            "task 'probe': key 'type' must be one of zeroshot, retrieval, probe, "
            "diagnostics, counterfactual, got 'probes'",
        ),
        (
            "{name: hflip}",
            "{name: vflip}",
            "task 'cf': edit 1: key 'name' expects one of hflip, crop, rerender, got 'vflip'",
        ),
        ("size: 16}", "size: 1.5}", "dataset: key 'size' expects an integer, got 1.5"),
        (
            "knn_k: [1, 3]",
            "knn_k: [1, 3]\n    methods: [linear, svm]",
            "task 'probe': key 'methods' expects a list of linear, knn, fewshot, got ['linear', 'svm']",
        ),
        (
            "dataset: {type: digits, size: 16}",
            "dataset: 3",
            "key 'dataset' expects a shard spec or a mapping with a type, got 3",
        ),
        # a missing required key
        ('    templates: ["a {c}."]\n', "", "task 'digit': missing required key 'templates'"),
        ("name: mine\n", "", "missing required key 'name'"),
        (
            "    edits: [{name: hflip}, {name: crop, scale: 0.8}]\n",
            "",
            "task 'cf': missing required key 'edits'",
        ),
        # a counterfactual task scores zero-shot tasks listed before it
        (
            "tasks: [digit]",
            "tasks: [digits]",
            "task 'cf': key 'tasks' names ['digits'], which are not zeroshot tasks listed before it",
        ),
    ],
)
def test_a_suite_mistake_is_one_line_naming_the_file_and_key(tmp_path, old, new, expected):
    assert old in GOOD
    assert _error(tmp_path, GOOD.replace(old, new, 1)) == expected


def test_a_suite_that_is_not_a_mapping_or_not_yaml(tmp_path):
    assert _error(tmp_path, "- a\n- b\n") == "not a suite (a YAML mapping), got list"
    assert _error(tmp_path, "name: [unclosed\n").startswith("not valid YAML: ")
    assert _error(tmp_path, "name: x\ntasks: [3]\n") == "task 1 is not a mapping, got 3"


def test_a_mistake_in_an_extending_suite_names_that_file(tmp_path):
    (tmp_path / "child.yaml").write_text(
        "name: child\nextends: shapes\ntasks:\n  - {name: g, type: diagnostics, k: 1}\n"
    )
    with pytest.raises(UsageError, match=rf"^suite {tmp_path}/child.yaml: task 'g': unknown key 'k' "):
        load_suite(str(tmp_path / "child.yaml"))
