"""The README's clip_benchmark route: its snippet, run as written (paths swapped for
generated data), gives clip_benchmark's zero-shot retrieval numbers for an mmalign model,
equal to Recall@k computed here from mmalign's own embeddings; and its zero-shot
classification is the documented breakage under numpy >= 2.4 (when clip_benchmark fixes
it, this test fails and the README should say so)."""

from __future__ import annotations

import io
import json
import math
import random
import re
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("clip_benchmark", reason="clip_benchmark is a test extra: pip install -e '.[test]'")
pytest.importorskip("requests", reason="clip_benchmark's CLI imports requests: pip install -e '.[test]'")

import mmalign  # noqa: E402
from data_pipelines import shapes  # noqa: E402
from mmalign.data.transforms import preprocess_cfg  # noqa: E402
from mmalign.models import TwoTower  # noqa: E402
from mmalign.models.io import save_pretrained  # noqa: E402
from mmalign.models.presets import PRESETS  # noqa: E402

README = Path(__file__).resolve().parents[1] / "README.md"
N = 40


def _snippet() -> str:
    text = README.read_text()
    start = text.index("<!-- clip_benchmark snippet")
    return re.search(r"```python\n(.*?)```", text[start:], re.S).group(1)


def _wds(root: Path, retrieval: bool) -> list:
    """A dataset in clip_benchmark's WebDataset layout; returns the samples' captions or labels."""
    (root / "test").mkdir(parents=True)
    rng, truth = random.Random(1), []
    with tarfile.open(root / "test" / "0.tar", "w") as tar:
        for i in range(N):
            attrs = shapes.sample_attributes(rng)
            png = io.BytesIO()
            shapes.draw(attrs, 32).save(png, "PNG")
            # distinct captions: no wrong caption ties a right one
            extra = ([f"{c} ({i})" for c in shapes.captions_for(attrs, rng, n=2)] if retrieval
                     else shapes.SHAPES.index(attrs["shape"]))
            truth.append(extra)
            body = "\n".join(extra) if retrieval else str(extra)
            for ext, data in (("png", png.getvalue()), ("txt" if retrieval else "cls", body.encode())):
                info = tarfile.TarInfo(f"{i:05d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    (root / "test" / "nshards.txt").write_text("1")
    if retrieval:
        (root / "dataset_type.txt").write_text("retrieval")
    else:
        (root / "classnames.txt").write_text("\n".join(shapes.SHAPES))
        (root / "zeroshot_classification_templates.txt").write_text("a photo of a {c}.\na drawing of a {c}.")
    return truth


@pytest.fixture
def run(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = TwoTower(PRESETS["micro"], init_logit_scale=math.log(50.0))
    save_pretrained(model, tmp_path / "run" / "final", preprocess=preprocess_cfg(model.image_size))
    from clip_benchmark import models

    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the snippet sets sys.argv
    yield tmp_path / "run"
    while "mmalign" in models.MODEL_TYPES:  # the snippet registers the type
        models.MODEL_TYPES.remove("mmalign")
    models.TYPE2FUNC.pop("mmalign", None)


def _run_snippet(run: Path, data: Path, task: str | None = None) -> dict:
    code = _snippet().replace("runs/exp1", str(run)).replace("data/wds_flickr8k", str(data))
    code = code.replace("wds/flickr8k", f"wds/{data.name}")
    if task is not None:
        code = code.replace('"zeroshot_retrieval"', f'"{task}"')
    exec(compile(code, "README.md", "exec"), {"__name__": "__snippet__"})
    return json.loads(next(run.glob(f"cb_{data.name}_*.json")).read_text())


def test_readme_snippet_retrieval_equals_a_reference(run, tmp_path):
    data = tmp_path / "cbret"
    captions = _wds(data, retrieval=True)
    record = _run_snippet(run, data)
    assert record["model"] == "mmalign" and record["task"] == "zeroshot_retrieval"
    # reference: Recall@k by definition from mmalign.load's embeddings of the same samples
    ours = mmalign.load(run)
    with tarfile.open(data / "test" / "0.tar") as tar:
        from PIL import Image

        images = [Image.open(io.BytesIO(tar.extractfile(f"{i:05d}.png").read())).convert("RGB") for i in range(N)]
    img = ours.encode_image(torch.stack([ours.preprocess(x) for x in images])).double()  # (N, D)
    flat = [c for caps in captions for c in caps]
    owner = torch.tensor([i for i, caps in enumerate(captions) for _ in caps])  # (T,)
    txt = ours.encode_text(flat).double()  # (T, D)
    sims = txt @ img.T  # (T, N)
    for k in (1, 5, 10):
        t2i = (sims.topk(k, dim=1).indices == owner[:, None]).any(1).double().mean()
        i2t = np.mean([bool(set(sims.T[i].topk(k).indices.tolist()) & set((owner == i).nonzero().flatten().tolist()))
                       for i in range(N)])
        assert abs(record["metrics"][f"image_retrieval_recall@{k}"] - float(t2i)) <= 1e-6
        assert abs(record["metrics"][f"text_retrieval_recall@{k}"] - float(i2t)) <= 1e-6
    assert 0 < record["metrics"]["text_retrieval_recall@10"] < 1  # neither trivially 0 nor 1


@pytest.mark.skipif(tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4),
                    reason="the breakage is numpy >= 2.4's")
def test_readme_snippet_classification_is_the_documented_breakage(run, tmp_path):
    data = tmp_path / "cbcls"
    _wds(data, retrieval=False)
    with pytest.raises(TypeError, match="0-dimensional arrays"):
        _run_snippet(run, data, task="zeroshot_classification")
