"""The fine-tuning recipe (configs/finetune_cifar10_cpu.yaml) and its parts, on a tiny case.

The flow of its first line, with the micro towers on a generated class folder named after
four CIFAR-10 classes: shards of two classes only (``--classes``) -> a few training steps
-> ``mmalign export --format open_clip`` -> the recipe's LiT run initialised from that
export, on all four classes -> the image tower is bitwise the exported one, the text
tower moved, and the held-out task of ``eval/cifar10_heldout.yaml`` scored the held-out
classes' images.  The held-out metric (``classes`` in a zero-shot task) is checked
against a naive float64 computation written here.
"""

from __future__ import annotations

import io
import json
import random
import shutil

import pytest
import torch
import yaml
from PIL import Image
from safetensors.torch import load_file

from mmalign.cli import main
from mmalign.config import load_config, validate
from mmalign.data.shards import iter_tar_groups
from mmalign.errors import UsageError
from mmalign.evaluation import load_suite, run_suite
from mmalign.models.arch import resolve_arch
from tests.harness import ROOT, cli_main

RECIPE = ROOT / "configs" / "finetune_cifar10_cpu.yaml"
SEEN, HELD = ["airplane", "automobile"], ["dog", "frog"]
CIFAR = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _png(rng: random.Random) -> bytes:
    img = Image.new("RGB", (16, 16), tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _folder(root, rng, per_class: int):
    for c in SEEN + HELD:
        (root / c).mkdir(parents=True)
        for i in range(per_class):
            (root / c / f"{i:04d}.png").write_bytes(_png(rng))


def _shards(src, out, *extra) -> list[dict]:
    assert (
        main(
            [
                "shards",
                "imagefolder",
                "--input",
                str(src),
                "--out",
                str(out),
                "--templates",
                "cifar10",
                "--per-shard",
                "100",
                "--no-progress",
                *extra,
            ]
        )
        == 0
    )
    return [json.loads(g["json"]) for p in sorted(out.glob("*.tar")) for g in iter_tar_groups(str(p))]


@pytest.fixture(scope="module")
def flow(tmp_path_factory):
    """Half-class shards, a 3-step run on them, its open_clip export, and the recipe's LiT run from it."""
    tmp = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    _folder(tmp / "train_src", rng, 12)
    _folder(tmp / "test_src", rng, 5)
    half = _shards(tmp / "train_src", tmp / "half", "--classes", ",".join(SEEN))
    _shards(tmp / "train_src", tmp / "all")
    test = _shards(tmp / "test_src", tmp / "test")
    common = [
        "--set",
        f"data.val={tmp}/test/00000.tar",
        "--set",
        "data.workers=0",
        "--set",
        "data.shuffle_buffer=20",
        "--set",
        "train.steps=3",
        "--set",
        "train.warmup_steps=1",
        "--set",
        "train.global_batch_size=8",
        "--set",
        "train.log_every=1",
        "--set",
        "monitor.tensorboard=false",
        "--set",
        "eval.suite=cifar10_heldout",
    ]
    res = cli_main(
        "train",
        "--config",
        "configs/cifar10_cpu.yaml",
        "--output",
        str(tmp / "half_run"),
        "--set",
        "model.preset=micro",
        "--set",
        f"data.train={tmp}/half/00000.tar",
        *common,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp / "half_run"),
                "--format",
                "open_clip",
                "--out",
                str(tmp / "export"),
            ]
        )
        == 0
    )
    res = cli_main(
        "train",
        "--config",
        str(RECIPE),
        "--output",
        str(tmp / "lit_run"),
        "--set",
        f"model.pretrained={tmp / 'export'}",
        "--set",
        f"data.train={tmp}/all/00000.tar",
        *common,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return {"tmp": tmp, "half": half, "test": test}


def test_classes_keeps_only_those_classes_with_their_full_list_ids(flow, tmp_path):
    assert {m["classname"] for m in flow["half"]} == set(SEEN) and len(flow["half"]) == 12 * len(SEEN)
    assert all(m["label"] == CIFAR.index(m["classname"]) for m in flow["half"] + flow["test"])
    with pytest.raises(UsageError, match=r"no class folders \['horse'\]"):
        from data_pipelines.sources import Captioner, image_folder

        image_folder(flow["tmp"] / "train_src", Captioner(["a {c}"]), CIFAR, only=["dog", "horse"])
    assert (
        main(
            [
                "shards",
                "table",
                "--input",
                str(tmp_path / "x.csv"),
                "--out",
                str(tmp_path / "o"),
                "--classes",
                "dog",
            ]
        )
        == 2
    )  # imagefolder only


def test_recipe_validates_with_its_export_in_place(flow, tmp_path, monkeypatch):
    """The recipe as written: its model.pretrained (relative to the working directory) is the export."""
    first = RECIPE.read_text().splitlines()[0]
    path = yaml.safe_load(RECIPE.read_text())["model"]["pretrained"]
    assert f"--out {path} " in first and "--classes " in first and "--set eval.suite=cifar10_heldout" in first
    shutil.copytree(flow["tmp"] / "export", tmp_path / path)
    monkeypatch.chdir(tmp_path)
    cfg = load_config(RECIPE)
    validate(cfg)
    assert cfg.model.lock_image and not cfg.model.lock_text and cfg.model.pretrained == path
    assert (
        resolve_arch(cfg.model)["vision_cfg"]["layers"] == 1
    )  # the export's (micro) architecture, not a preset
    suite = load_suite(cfg.eval.suite)
    (held,) = [t for t in suite["tasks"] if t["name"] == "heldout"]
    # the held-out classes are those the recipe's first line leaves out of the pretraining shards
    seen = first.split("--classes ")[1].split()[0].split(",")
    assert sorted(held["classes"] + seen) == sorted(CIFAR) and held["classnames"] == CIFAR


def test_lit_run_from_the_export_keeps_the_image_tower_and_scores_the_held_out_classes(flow):
    exported = load_file(str(flow["tmp"] / "export" / "open_clip_model.safetensors"))
    tuned = load_file(str(flow["tmp"] / "lit_run" / "final" / "model.safetensors"))
    visual = [k for k in tuned if k.startswith("visual.")]
    assert visual and all(torch.equal(tuned[k], exported[k]) for k in visual)
    text = [k for k in tuned if k.startswith("text.")]
    assert text and any(not torch.equal(tuned[k], exported[k]) for k in text)  # the text tower trained
    for run in ("half_run", "lit_run"):
        records = {r["dataset"]: r for r in json.loads((flow["tmp"] / run / "eval.json").read_text())}
        held = records["cifar10_heldout/heldout"]
        assert held["n_images"] == sum(m["classname"] in HELD for m in flow["test"]) == 10
        assert held["metrics"]["chance_acc1"] == pytest.approx(1 / 5)
        assert records["cifar10_heldout/zeroshot"]["n_images"] == len(flow["test"])


class _Text(torch.nn.Module):
    """A text tower of fixed random vectors: enough for the classifier; images come embedded."""

    def __init__(self, seed: int):
        super().__init__()
        self.table = torch.randn(128, 8, generator=torch.Generator().manual_seed(seed))

    def encode_text(self, tokens):
        return self.table[tokens].mean(dim=1)  # (T, 8)


def _tokenize(texts):
    return torch.tensor([[ord(ch) % 128 for ch in t[:20].ljust(20)] for t in texts])  # (T, 20)


def test_held_out_accuracy_equals_a_naive_computation(tmp_path, seed):
    classnames, classes = ["a", "b", "c", "d", "e", "f"], ["e", "b", "d"]
    templates = ["a {c}.", "the {c} here", "{c}!"]
    (tmp_path / "s.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "dataset": "x.tar",
                "tasks": [
                    {
                        "name": "held",
                        "type": "zeroshot",
                        "label_field": "classname",
                        "classnames": classnames,
                        "templates": templates,
                        "classes": classes,
                    }
                ],
            }
        )
    )
    g = torch.Generator().manual_seed(seed)
    n = 60
    labels = torch.randint(0, len(classnames), (n,), generator=g)
    feats = torch.nn.functional.normalize(torch.randn(n, 8, generator=g), dim=-1)
    emb = {
        "image_features": feats,
        "metas": [{"classname": classnames[i]} for i in labels],
        "keys": [str(i) for i in range(n)],
        "text_to_image": torch.zeros(0, dtype=torch.long),
    }
    model = _Text(seed)
    (rec,) = run_suite(model, None, _tokenize, load_suite(str(tmp_path / "s.yaml")), embedded=emb)

    # naive, float64: per held-out image, the best of the held-out classes' template-mean prompts
    def prompt(c):
        vecs = [model.encode_text(_tokenize([t.format(c=c)]))[0].double() for t in templates]
        mean = sum(v / v.norm() for v in vecs) / len(vecs)
        return mean / mean.norm()

    weights = {c: prompt(c) for c in classes}
    hits = total = 0
    for i in range(n):
        name = classnames[labels[i]]
        if name in classes:
            best = max(classes, key=lambda c: float(feats[i].double() @ weights[c]))
            hits += best == name
            total += 1
    assert 0 < total < n and rec["n_images"] == total
    assert rec["metrics"]["acc1"] == pytest.approx(hits / total, abs=1e-6)  # a float32 mean of hits
    assert rec["metrics"]["chance_acc1"] == pytest.approx(1 / 3)


def test_a_classes_key_outside_the_classnames_is_one_line(tmp_path):
    (tmp_path / "s.yaml").write_text(
        yaml.safe_dump(
            {
                "name": "s",
                "tasks": [
                    {
                        "name": "held",
                        "type": "zeroshot",
                        "label_field": "classname",
                        "classnames": ["a", "b"],
                        "templates": ["{c}"],
                        "classes": ["a", "z"],
                    }
                ],
            }
        )
    )
    with pytest.raises(
        UsageError, match=r"task 'held': key 'classes' must list distinct names of its classnames"
    ):
        load_suite(str(tmp_path / "s.yaml"))
