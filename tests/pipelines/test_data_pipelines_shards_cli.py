"""`mmalign shards SOURCE`: one sub-parser per source (its --help shows its own flags, another
source's flag is one line naming its sources), and imagefolder's `--limit N` per class (issue 39,
point 6)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.harness import cli_main

OWN = {  # a few flags each source's --help must show, and a few it must not
    "shapes": ({"--n-train", "--n-val", "--seed", "--out", "--per-shard"}, {"--input", "--limit", "--root"}),
    "imagefolder": (
        {"--input", "--classes", "--limit", "--templates", "--no-shuffle", "--resize"},
        {"--n-train", "--root", "--label-col", "--image-col"},
    ),
    "table": (
        {"--input", "--image-col", "--caption-col", "--root"},
        {"--limit", "--templates", "--label-col"},
    ),
    "hf": (
        {"--input", "--label-col", "--format", "--split", "--templates"},
        {"--limit", "--classes", "--root"},
    ),
}


@pytest.mark.parametrize("source", sorted(OWN))
def test_each_source_helps_with_its_own_flags_only(source):
    res = cli_main("shards", source, "--help")
    assert res.returncode == 0 and res.stdout.startswith(f"usage: mmalign shards {source}")
    shown = {w.strip("[],") for w in res.stdout.split() if w.startswith(("--", "[--"))}
    own, other = OWN[source]
    assert own <= shown, own - shown
    assert not other & shown, other & shown


def test_another_sources_flag_is_one_line_naming_its_sources(tmp_path):
    res = cli_main("shards", "table", "--input", "x.csv", "--out", tmp_path / "o", "--limit", "3")
    assert res.returncode == 2 and res.stderr.count("\n") == 1
    assert "mmalign shards table: --limit does not apply to this source (a flag of imagefolder;" in res.stderr
    res = cli_main("shards", "shapes", "--out", tmp_path / "o", "--no-dedupe")
    assert res.returncode == 2 and "a flag of imagefolder, table, hf" in res.stderr
    assert not (tmp_path / "o").exists()


def _images(n_per_class: dict[str, int], seed: int = 0) -> dict[str, bytes]:
    """``CLASS/000i.png`` -> PNG bytes, each image a distinct random colour (no duplicates)."""
    rng = np.random.default_rng(seed)
    files = {}
    for c, n in n_per_class.items():
        for i in range(n):
            buf = io.BytesIO()
            Image.new("RGB", (8, 8), tuple(int(v) for v in rng.integers(0, 256, 3))).save(buf, "PNG")
            files[f"{c}/{i:04d}.png"] = buf.getvalue()
    return files


def _written(out: Path) -> list[str]:
    """The ``source_path`` of every sample written, in shard order."""
    paths = []
    for shard in sorted(out.glob("*.tar")):
        with tarfile.open(shard) as tar:
            paths += [json.load(tar.extractfile(m))["source_path"] for m in tar if m.name.endswith(".json")]
    return paths


@pytest.mark.parametrize("shuffle", [True, False])
def test_limit_takes_the_first_n_images_of_each_class_from_a_folder(tmp_path, shuffle):
    files = _images({"cat": 5, "dog": 3, "owl": 1})
    for name, data in files.items():
        (tmp_path / "src" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "src" / name).write_bytes(data)
    res = cli_main(
        "shards",
        "imagefolder",
        "--input",
        tmp_path / "src",
        "--out",
        tmp_path / "out",
        "--limit",
        "2",
        "--no-progress",
        *(() if shuffle else ("--no-shuffle",)),
    )
    assert res.returncode == 0, res.stderr
    # a brute-force reference: sorted names per class, the first two of each
    expected = [
        n for c in ("cat", "dog", "owl") for n in sorted(f for f in files if f.startswith(c + "/"))[:2]
    ]
    written = _written(tmp_path / "out")
    assert sorted(written) == sorted(expected)
    if not shuffle:
        assert written == expected


def test_limit_follows_a_tars_member_order(tmp_path):
    files = _images({"cat": 4, "dog": 4}, seed=1)
    order = [
        "cat/0003.png",
        "dog/0002.png",
        "cat/0000.png",
        "dog/0000.png",
        "cat/0002.png",
        "dog/0003.png",
        "cat/0001.png",
        "dog/0001.png",
    ]  # the archive's order, not the names'
    with tarfile.open(tmp_path / "src.tar", "w") as tar:
        for name in order:
            info = tarfile.TarInfo(name)
            info.size = len(files[name])
            tar.addfile(info, io.BytesIO(files[name]))
    res = cli_main(
        "shards",
        "imagefolder",
        "--input",
        tmp_path / "src.tar",
        "--out",
        tmp_path / "out",
        "--limit",
        "1",
        "--no-shuffle",
        "--no-progress",
    )
    assert res.returncode == 0, res.stderr
    assert sorted(_written(tmp_path / "out")) == ["cat/0003.png", "dog/0002.png"]


def test_limit_below_one_is_one_line(tmp_path):
    (tmp_path / "src" / "cat").mkdir(parents=True)
    res = cli_main(
        "shards", "imagefolder", "--input", tmp_path / "src", "--out", tmp_path / "out", "--limit", "0"
    )
    assert res.returncode == 2 and res.stderr.count("\n") == 1 and "--limit must be >= 1" in res.stderr
