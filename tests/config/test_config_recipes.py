"""The recipes in ``configs/``: each loads and validates, and names its own command.

The CIFAR-10 recipe is also run end to end on a small subset of the real data
(shards built with the same builder and template set as its first line, 3 steps of
the micro towers, then its zero-shot suite); that part is skipped when
``../shared/data/cifar10`` is absent.
"""

from __future__ import annotations

import itertools
import json
import re
import tarfile
from pathlib import Path

import pytest
import yaml

from mmalign.config import load_config, validate
from mmalign.evaluation import load_suite
from mmalign.models.arch import resolve_arch
from tests.harness import ROOT, cli_main

RECIPES = sorted((ROOT / "configs").glob("*.yaml"))
CIFAR = ROOT.parent / "shared" / "data" / "cifar10"


def test_there_are_recipes():
    names = {p.name for p in RECIPES}
    assert {"cifar10_cpu.yaml", "vitb32_laion_gpu.yaml", "vitb16_laion_gpu.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_loads_and_validates(path: Path):
    # a fine-tuning recipe's model.pretrained is made by its first line; without it here the
    # rest is checked (tests/run/test_finetune_recipe.py validates it whole, with the export in place)
    named = bool((yaml.safe_load(path.read_text()).get("model") or {}).get("pretrained"))
    cfg = load_config(path, ["model.pretrained=null"] if named else [])
    validate(cfg, world_size=8)  # the GPU recipes' one-node launch (--nproc 8)
    resolve_arch(cfg.model)  # the architecture exists (no download)
    load_suite(cfg.eval.suite)  # the suite exists and parses


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_first_line_is_its_command(path: Path):
    first = path.read_text().splitlines()[0]
    assert first.startswith("# mmalign"), f"{path.name}: first line must be the command that runs it"
    if path.name != "quickstart.yaml":  # quickstart's command is `mmalign quickstart`
        assert f"--config configs/{path.name}" in first
    # every training launch in the header continues the run when run again (a restart, a relaunch)
    header = [line for line in path.read_text().splitlines() if line.startswith("#")]
    launches = [line for line in header if re.search(r"mmalign(\.cli)? train --config", line)]
    assert launches and all("--resume latest" in line for line in launches), launches
    # and says how long it takes: measured on 2 idle cores (CPU recipes) or what is known (GPU)
    text = " ".join(line.lstrip("# ") for line in header)
    assert re.search(r"Measured on 2 idle cores \(\d{4}-\d\d-\d\d\): [\d.]+ min", text) or (
        path.name.endswith("_gpu.yaml") and "Time:" in text
    ), f"{path.name}: the header states no time"


def test_committed_recipes_use_no_machine_specific_paths():
    outside = str(ROOT.parent)  # the folder holding this checkout
    for path in RECIPES:
        assert outside + "/" not in path.read_text(), path.name


def test_cifar10_suite_matches_the_template_set():
    """The suite scores with exactly the classes (in label order) and templates the shards are captioned from."""
    from data_pipelines.sources import load_templates

    tset = load_templates("cifar10")
    (task,) = [t for t in load_suite("cifar10")["tasks"] if t["type"] == "zeroshot"]
    assert task["classnames"] == tset["classnames"]
    assert task["templates"] == tset["templates"] and len(task["templates"]) == 18


def _subset_shards(src: Path, out: Path, every: int, seed: int) -> str:
    """Every ``every``-th image of a class-folder tar, captioned as the recipe's first line does."""
    from data_pipelines.build import build_shards
    from data_pipelines.sources import Captioner, image_folder, load_templates

    tset = load_templates("cifar10")
    _, items = image_folder(src, Captioner(tset["templates"], per_image=1, seed=seed), tset["classnames"])
    summary = build_shards(itertools.islice(items, 0, None, every), out, per_shard=100, progress=False)
    assert summary["failures"] == 0 and summary["written"] > 0
    return f"{out}/00000.tar"


@pytest.mark.integration
@pytest.mark.skipif(not (CIFAR / "test.tar").is_file(), reason="../shared/data/cifar10 not present")
def test_cifar10_recipe_trains_and_evaluates(tmp_path):
    train = _subset_shards(
        CIFAR / "train.tar", tmp_path / "train", every=500, seed=0
    )  # 100 images, all classes
    test = _subset_shards(CIFAR / "test.tar", tmp_path / "test", every=100, seed=1)  # 100 images
    with tarfile.open(train) as tar:  # the recipe's label fields: class id and class name
        meta = json.loads(tar.extractfile(next(m for m in tar if m.name.endswith(".json"))).read())
    assert (
        isinstance(meta["label"], int)
        and meta["classname"] in load_suite("cifar10")["tasks"][0]["classnames"]
    )
    out = tmp_path / "run"
    res = cli_main(
        "train",
        "--config",
        "configs/cifar10_cpu.yaml",
        "--output",
        str(out),
        "--set",
        "model.preset=micro",
        "--set",
        f"data.train={train}",
        "--set",
        f"data.val={test}",
        "--set",
        "data.workers=0",
        "--set",
        "data.shuffle_buffer=50",
        "--set",
        "train.steps=3",
        "--set",
        "train.warmup_steps=1",
        "--set",
        "train.global_batch_size=16",
        "--set",
        "train.log_every=1",
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    records = json.loads((out / "eval.json").read_text())
    (zs,) = [r for r in records if r["dataset"] == "cifar10/zeroshot"]
    assert zs["n_images"] == 100 and zs["metrics"]["chance_acc1"] == pytest.approx(0.1)
    assert 0.0 <= zs["metrics"]["acc1"] <= 1.0
    assert (out / "final" / "model.safetensors").is_file()
