"""A small searchable corpus for the search/serve tests (a helper module, not a test file).

Class folders of solid-colour images -> ``mmalign shards imagefolder`` (two templates, both
written into every ``.txt``: each caption is repeated by every image of its class) ->
``mmalign embed`` -> ``mmalign index``, with a random micro model.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from mmalign.cli import main

CLASSES = ("bird", "cat", "dog")
PER_CLASS = 4
TEMPLATES = ("a photo of a {c}", "a blurry photo of a {c}")


def save_random_model(path: Path, seed: int, embed_dim: int = 32) -> str:
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models import TwoTower
    from mmalign.models.io import save_pretrained
    from mmalign.models.presets import PRESETS

    arch = copy.deepcopy(PRESETS["micro"])
    arch["embed_dim"] = embed_dim
    torch.manual_seed(seed)
    model = TwoTower(arch, init_logit_scale=math.log(10.0))
    save_pretrained(model, path, preprocess=preprocess_cfg(model.image_size))
    return str(path)


def class_folders(root: Path, seed: int = 0) -> dict[str, tuple[int, int, int]]:
    """``root/CLASS/000i.png``, each one solid colour; returns source path -> colour."""
    rng = np.random.default_rng(seed)
    colours = {}
    for name in CLASSES:
        (root / name).mkdir(parents=True)
        for i in range(PER_CLASS):
            colour = tuple(int(v) for v in rng.integers(0, 256, 3))
            Image.new("RGB", (32, 32), colour).save(root / name / f"{i:04d}.png")
            colours[f"{name}/{i:04d}.png"] = colour
    return colours


def build_corpus(root: Path) -> dict:
    """Shards (3 of them), embeddings, an exact index and the model, all under ``root``."""
    colours = class_folders(root / "src")
    (root / "templates.yaml").write_text("templates:\n" + "".join(f"  - '{t}'\n" for t in TEMPLATES))
    assert (
        main(
            [
                "shards",
                "imagefolder",
                "--input",
                str(root / "src"),
                "--out",
                str(root / "shards"),
                "--templates",
                str(root / "templates.yaml"),
                "--templates-per-image",
                "all",
                "--per-shard",
                "5",
                "--no-progress",
            ]
        )
        == 0
    )
    model = save_random_model(root / "model", seed=5)
    assert (
        main(
            [
                "embed",
                "--model",
                model,
                "--data",
                str(root / "shards"),
                "--out",
                str(root / "emb"),
                "--batch-size",
                "8",
            ]
        )
        == 0
    )
    assert main(["index", "--emb", str(root / "emb"), "--out", str(root / "idx")]) == 0
    return {
        "root": root,
        "model": model,
        "colours": colours,
        "shards": root / "shards",
        "emb": root / "emb",
        "idx": root / "idx",
    }


def serve_corpus(corpus: dict):
    """A search server over ``corpus`` on a free loopback port, its access-log lines in
    ``.lines`` and its URL in ``.base``; a generator for fixtures (shut down after the yield)."""
    import threading

    from mmalign.search.searcher import Searcher
    from mmalign.search.serve import make_server

    lines: list[str] = []
    srv = make_server(Searcher(corpus["idx"], corpus["model"]), "127.0.0.1", 0, access_log=lines.append)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    srv.base, srv.lines = f"http://127.0.0.1:{srv.server_address[1]}", lines
    yield srv
    srv.shutdown()
    srv.server_close()
