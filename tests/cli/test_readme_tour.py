"""The README's 5-minute tour, run as written: each ``mmalign`` line of its block, read from
README.md, in a folder holding a generated table of (image, caption) pairs, with tiny settings
appended (the micro preset, a few steps, small shards). Every stage must succeed and leave what
the README says it leaves."""

from __future__ import annotations

import csv
import json
import random
import shlex

import pytest
from PIL import Image, ImageDraw

from tests.harness import cli_main
from tests.harness.doc_snippets import commands, snippet

TEST = "tests/cli/test_readme_tour.py::test_readme_tour_runs_end_to_end"
COLOURS = {"red": (220, 20, 20), "green": (20, 200, 20), "blue": (20, 20, 220), "yellow": (230, 230, 20)}
# appended to each command so that the whole tour takes seconds on a CPU
TINY = {
    "shards": ["--per-shard", "32", "--no-progress"],  # 96 training pairs -> the tour's 3 shards
    "train": [
        f"--set={kv}"
        for kv in (
            "model.preset=micro",
            "train.steps=4",
            "train.warmup_steps=1",
            "train.global_batch_size=16",
            "data.workers=0",
            "data.shuffle_buffer=20",
            "train.log_every=1",
        )
    ],
    "report": ["--limit", "32"],
}


def _table(root, name: str, n: int, rng: random.Random) -> None:
    """``name``.csv: n squares of a random colour at a random place, captioned with their colour."""
    (root / "photos").mkdir(exist_ok=True)
    with open(root / f"{name}.csv", "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["image", "caption"])
        for i in range(n):
            colour = rng.choice(sorted(COLOURS))
            x, y = rng.randint(0, 30), rng.randint(0, 30)
            image = Image.new("RGB", (48, 48), (255, 255, 255))
            ImageDraw.Draw(image).rectangle([x, y, x + 16, y + 16], fill=COLOURS[colour])
            path = f"photos/{name}_{i}.png"
            image.save(root / path)
            out.writerow([path, f"a {colour} square"])


def test_the_tour_covers_every_stage():
    lines = commands(snippet("README.md", TEST))
    assert all(line.startswith("mmalign ") for line in lines), lines
    stages = [shlex.split(line)[1] for line in lines]
    for stage in ("shards", "train", "eval", "report", "export", "embed", "index", "search"):
        assert stage in stages, stage
    assert stages.index("shards") < stages.index("train") < stages.index("eval") < stages.index("search")
    train = next(line for line in lines if line.startswith("mmalign train"))
    assert "--resume latest" in train  # a killed run continues with the same line


@pytest.mark.integration
def test_readme_tour_runs_end_to_end(tmp_path, seed):
    rng = random.Random(seed)
    _table(tmp_path, "train", 96, rng)
    _table(tmp_path, "val", 32, rng)
    outputs = {}
    for line in commands(snippet("README.md", TEST)):
        argv = shlex.split(line, comments=True)[1:]
        res = cli_main(*argv, *TINY.get(argv[0], []), cwd=tmp_path)
        assert res.returncode == 0, f"{line}\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}"
        outputs[argv[0]] = res.stdout
    run = tmp_path / "runs" / "mine"
    assert len(list((tmp_path / "data/mine/train").glob("*.tar"))) == 3
    assert (run / "final" / "model.safetensors").is_file() and (run / "config.yaml").is_file()
    assert json.loads((run / "eval_cli_retrieval.json").read_text())
    assert (run / "report" / "index.html").is_file()
    assert (tmp_path / "exports/mine/open_clip_config.json").is_file()
    assert (tmp_path / "idx/index.json").is_file()
    hits = [row for row in outputs["search"].splitlines() if row.strip()[:1].isdigit()]
    assert len(hits) == 5 and all("square" in row for row in hits), outputs["search"]
