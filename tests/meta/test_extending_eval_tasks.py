"""docs/architecture.md, "Adding an eval task", followed as written from outside the package: the
guide's task kind (its Python block, taken from the page) imported from a module of its own, the
guide's suite YAML run by ``mmalign eval`` on the generated shapes, its record in eval.json and its
rows in the printed table, its typed keys checked, then the kind unregistered."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest
import torch
import yaml

from tests.harness import ROOT, cli_main
from tests.harness.doc_snippets import blocks, snippet

GUIDE = "docs/architecture.md"
TEST = "tests/meta/test_extending_eval_tasks.py::test_the_guide_s_task_kind_runs_in_a_suite"


def _guide_suite() -> dict:
    """The YAML block of the guide's section."""
    text = (ROOT / GUIDE).read_text(encoding="utf-8")
    section = text.split("## Adding an eval task", 1)[1].split("\n## ", 1)[0]
    (found,) = [b.code for b in blocks(ROOT / GUIDE, section) if b.lang == "yaml"]
    return yaml.safe_load(found)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.arch import resolve_arch
    from mmalign.models.io import save_pretrained
    from mmalign.models.two_tower import TwoTower

    torch.manual_seed(0)
    model = TwoTower(resolve_arch(ModelConfig(preset="micro")))
    out = tmp_path_factory.mktemp("toy_task") / "model"
    save_pretrained(model, out, preprocess=preprocess_cfg(model.image_size))
    return out


def test_the_guide_s_task_kind_runs_in_a_suite(shapes_dir, model_dir, tmp_path):
    from mmalign.evaluation.tasks import registered_tasks, unregister_task

    code = snippet(GUIDE, TEST)
    kind = re.search(r'@register_task\("(\w+)"\)', code).group(1)
    (tmp_path / "my_tasks.py").write_text(code)  # the user's own module, outside mmalign
    suite = _guide_suite()
    suite["dataset"] = str(shapes_dir / "val" / "00000.tar")  # the guide's data/val/00000.tar
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(suite))
    out = tmp_path / "eval.json"
    sys.path.insert(0, str(tmp_path))
    try:
        importlib.import_module("my_tasks")  # step 2: importing the module registers the kind
        assert registered_tasks()[-1] == kind == "norms"
        run = cli_main("eval", "--model", model_dir, "--suite", path, "--output", out)
        assert run.returncode == 0, run.stderr
        (record,) = json.loads(out.read_text())
        assert record["dataset"] == "mine/norms" and record["task"] == "embedding_norms"
        assert record["scale"] == 2.0 and record["n_images"] == 120
        assert record["n_captions"] >= 120  # needs() asked for them: every shapes image has one or more
        # the features are L2-normalised rows, so each mean norm is the scale
        assert record["metrics"] == pytest.approx({"image_norm_mean": 2.0, "text_norm_mean": 2.0}, abs=1e-5)
        # its rows in the table: the default summary, every metric
        rows = [line for line in run.stdout.splitlines() if "mine/norms" in line]
        assert len(rows) == 2 and "image_norm_mean" in rows[0] and "2.000" in rows[0]

        # its keys are typed like a built-in kind's: one line naming the file, the task and the key
        suite["tasks"][0]["scale"] = "big"
        path.write_text(yaml.safe_dump(suite))
        bad = cli_main("eval", "--model", model_dir, "--suite", path, "--output", out)
        assert bad.returncode == 2
        assert bad.stderr.strip() == (
            f"mmalign: error: suite {path}: task 'norms': key 'scale' expects a number, got 'big'"
        )
    finally:
        unregister_task(kind)
        sys.path.remove(str(tmp_path))
        sys.modules.pop("my_tasks", None)

    # unregistered, the type is unknown again: the line lists the registered kinds
    gone = cli_main("eval", "--model", model_dir, "--suite", path, "--output", out)
    assert gone.returncode == 2
    assert gone.stderr.strip() == (
        f"mmalign: error: suite {path}: task 'norms': key 'type' must be one of "
        "zeroshot, retrieval, probe, diagnostics, counterfactual, got 'norms'"
    )
