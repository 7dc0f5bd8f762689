"""A total and an ETA wherever the total is known (issue 28, point 8): the shard builder, the
hard-negative miner and the evaluation's embedding counter. The progress lines come every 10 s by
default; the tests print one per item (``every_s=0``) to read an intermediate line."""

from __future__ import annotations

import functools
import io
import json
import random
import re
import shutil

import pytest
import torch
from PIL import Image

from mmalign import progress
from mmalign.data.imagefolder import Item

LINE = re.compile(
    r"mmalign: (?P<desc>.+): (?P<n>\d+) of (?P<total>\d+) (?P<unit>\w+) \(.*/s\), ETA \d+:\d\d:\d\d"
)


def _every_item(monkeypatch, module) -> None:
    monkeypatch.setattr(module, "track", functools.partial(progress.track, every_s=0.0))


def _png(rng: random.Random) -> bytes:
    buf = io.BytesIO()
    Image.frombytes("RGB", (8, 6), rng.randbytes(8 * 6 * 3)).save(buf, format="PNG")
    return buf.getvalue()


def _counted(out: str) -> list[tuple[int, int]]:
    return [(int(m["n"]), int(m["total"])) for m in map(LINE.fullmatch, out.splitlines()) if m]


def test_the_shard_builder_shows_the_total_and_an_eta(tmp_path, monkeypatch, capsys, seed):
    from data_pipelines import build

    rng = random.Random(seed)
    items = [Item(_png(rng), [f"caption {i}"], {}) for i in range(5)]
    _every_item(monkeypatch, build)
    summary = build.build_shards(items, tmp_path / "out", per_shard=2)  # a list: its length is the total
    assert summary["written"] == 5
    out = capsys.readouterr().out
    assert _counted(out) == [(n, 5) for n in range(1, 6)], out  # a line per item with "n of 5" and an ETA
    assert out.splitlines()[-1].startswith("mmalign: shards -> ") and "5 of 5 images" in out.splitlines()[-1]

    # a generator has no length: a total given by the caller, else none (and no ETA)
    build.build_shards((i for i in items), tmp_path / "given", per_shard=2, total=5)
    assert _counted(capsys.readouterr().out) == [(n, 5) for n in range(1, 6)]
    build.build_shards((i for i in items), tmp_path / "unknown", per_shard=2)
    out = capsys.readouterr().out
    assert _counted(out) == [] and "mmalign: shards -> " in out and "ETA" not in out


def test_the_evaluation_counter_total_comes_from_sizes_json(shapes_dir, tmp_path):
    from mmalign.evaluation.suite import embedding_total

    val = str(shapes_dir / "val" / "00000.tar")
    assert embedding_total({"type": "shards", "urls": val}) == 120
    assert embedding_total({"type": "shards", "urls": val, "limit": 50}) == 50
    assert embedding_total({"type": "shards", "urls": val, "limit": 500}) == 120  # a limit above the data
    assert embedding_total({"type": "shards", "urls": val, "per_class": 3}) is None  # drops an unknown share
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(val, bare / "00000.tar")  # a shard without sizes.json
    assert embedding_total({"type": "shards", "urls": str(bare / "00000.tar")}) is None
    assert embedding_total({"type": "shards", "urls": str(bare / "00000.tar"), "limit": 40}) == 40
    assert embedding_total({"type": "digits"}) is None


def test_the_evaluation_counter_shows_the_total_and_an_eta(shapes_dir, monkeypatch, capsys):
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import eval_transform
    from mmalign.evaluation import suite as suite_mod
    from mmalign.models import build_model
    from mmalign.models.tokenizers import build_tokenizer

    model = build_model(ModelConfig(preset="micro"))
    suite = {
        "name": "tiny",
        "dataset": str(shapes_dir / "val" / "00000.tar"),
        "tasks": [{"name": "retrieval", "type": "retrieval", "ks": [1]}],
    }
    _every_item(monkeypatch, suite_mod)
    with torch.no_grad():
        suite_mod.run_suite(
            model,
            eval_transform(model.image_size),
            build_tokenizer(model.arch),
            suite,
            batch_size=64,
            progress=True,
        )
    counted = _counted(capsys.readouterr().out)
    assert counted and counted[0] == (1, 120) and all(total == 120 for _, total in counted), counted


@pytest.fixture
def scorer(tmp_path):
    """A random micro model saved as a model folder (the miner needs some scorer)."""
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained

    model = build_model(ModelConfig(preset="micro"))
    save_pretrained(model, tmp_path / "scorer", preprocess=preprocess_cfg(model.image_size))
    return tmp_path / "scorer"


def test_the_miner_shows_the_total_and_an_eta(shapes_dir, scorer, tmp_path, monkeypatch, capsys):
    from data_pipelines import mine

    _every_item(monkeypatch, mine)
    stats = mine.mine(str(shapes_dir / "val"), scorer, tmp_path / "mined", k=2, batch_size=64)
    counted = _counted(capsys.readouterr().out)
    assert stats["mined_samples"] == 120 and counted[0] == (1, 120) and len(counted) == 120, counted[:3]
    assert json.loads((shapes_dir / "val" / "sizes.json").read_text()) == {"00000.tar": 120}  # the premise


def test_every_shard_source_states_its_count(tmp_path, seed):
    """`mmalign shards imagefolder|table|hf` read generators: each source states its item count
    (files, rows, dataset rows) so the builder's progress has a total; consuming counts it down."""
    import operator

    import datasets
    import pandas as pd

    from data_pipelines import sources
    from mmalign.data.imagefolder import Captioner

    rng = random.Random(seed)
    n_cat, n_dog = rng.randint(1, 4), rng.randint(1, 4)
    for name, n in (("cat", n_cat), ("dog", n_dog)):
        (tmp_path / "folder" / name).mkdir(parents=True)
        for i in range(n):
            (tmp_path / "folder" / name / f"{i}.png").write_bytes(_png(rng))
    _, items = sources.image_folder(tmp_path / "folder", Captioner(["a {c}"]))
    assert operator.length_hint(items) == n_cat + n_dog
    next(items)
    assert operator.length_hint(items) == n_cat + n_dog - 1 and len(list(items)) == n_cat + n_dog - 1

    files = sorted((tmp_path / "folder").rglob("*.png"))
    pd.DataFrame({"image": [str(f) for f in files], "caption": ["x"] * len(files)}).to_csv(
        tmp_path / "t.csv", index=False
    )
    rows = sources.table(tmp_path / "t.csv")
    assert operator.length_hint(rows) == len(files) == len(list(rows))

    datasets.Dataset.from_dict(
        {"image": [str(f) for f in files], "caption": ["x"] * len(files)}
    ).save_to_disk(str(tmp_path / "ds"))
    ds = sources.hf_dataset(tmp_path / "ds")
    assert operator.length_hint(ds) == len(files) == len(list(ds))


def test_the_synthetic_shapes_builder_shows_the_total(tmp_path, monkeypatch, capsys):
    from data_pipelines import shapes

    _every_item(monkeypatch, shapes)
    shapes.generate_split(tmp_path, "val", 4, per_shard=2, size=16)
    assert _counted(capsys.readouterr().out) == [(n, 4) for n in range(1, 5)]
