"""The manual's clip_benchmark route (docs/evaluation.md): its snippet, run as written (paths swapped for generated
data), runs clip_benchmark's own CLI on an mmalign model for zero-shot retrieval (numbers equal
to Recall@k computed here from mmalign's embeddings) and zero-shot classification (numbers equal
to ``mmalign eval --cb-dataset`` on the same folder), the latter thanks to
``mmalign.pretrained.patch_clip_benchmark`` (clip_benchmark 1.6.2's ``accuracy`` fails under
numpy >= 2.4); and that shim's own contract."""

from __future__ import annotations

import io
import json
import math
import sys
import tarfile

import numpy as np
import pytest
import torch

pytest.importorskip("clip_benchmark", reason="clip_benchmark is a test extra: pip install -e '.[test]'")
pytest.importorskip("requests", reason="clip_benchmark's CLI imports requests: pip install -e '.[test]'")

from clip_benchmark.metrics import zeroshot_classification as cb_zs  # noqa: E402

import mmalign  # noqa: E402
from mmalign import pretrained  # noqa: E402
from mmalign.cli import main  # noqa: E402
from mmalign.data.transforms import preprocess_cfg  # noqa: E402
from mmalign.models import TwoTower  # noqa: E402
from mmalign.models.io import save_pretrained  # noqa: E402
from mmalign.models.presets import PRESETS  # noqa: E402
from tests.harness.cb_wds_gen import write_wds  # noqa: E402
from tests.harness.doc_snippets import snippet  # noqa: E402

PAGE = "docs/evaluation.md"
TEST = "tests/evaluation/test_pretrained_clip_benchmark.py::test_readme_snippet_retrieval_equals_a_reference"
N = 40


def _snippet() -> str:
    """The block of docs/evaluation.md marked to run here."""
    return snippet(PAGE, TEST)


@pytest.fixture(scope="module")
def snippet_run(tmp_path_factory):
    """The manual's snippet run once on two generated datasets; (tmp, run dir, retrieval captions)."""
    from clip_benchmark import models

    tmp = tmp_path_factory.mktemp("cbsnippet")
    torch.manual_seed(0)
    model = TwoTower(PRESETS["micro"], init_logit_scale=math.log(50.0))
    save_pretrained(model, tmp / "run" / "final", preprocess=preprocess_cfg(model.image_size))
    captions = [s["captions"] for s in write_wds(tmp / "wds_flickr8k", "retrieval", n=N, seed=1)]
    write_wds(tmp / "wds_cifar10", "classification", n=N, seed=2)
    code = _snippet().replace("runs/exp1", str(tmp / "run")).replace("data/wds_", f"{tmp}/wds_")
    argv = sys.argv
    try:
        exec(compile(code, PAGE, "exec"), {"__name__": "__snippet__"})
    finally:
        sys.argv = argv  # the snippet sets sys.argv
        while "mmalign" in models.MODEL_TYPES:  # the snippet registers the type
            models.MODEL_TYPES.remove("mmalign")
        models.TYPE2FUNC.pop("mmalign", None)
    return tmp, tmp / "run", captions


def test_readme_snippet_retrieval_equals_a_reference(snippet_run):
    tmp, run, captions = snippet_run
    record = json.loads((run / "cb_flickr8k_zeroshot_retrieval.json").read_text())
    assert record["model"] == "mmalign" and record["task"] == "zeroshot_retrieval"
    # reference: Recall@k by definition from mmalign.load's embeddings of the same samples
    ours = mmalign.load(run)
    with tarfile.open(tmp / "wds_flickr8k" / "test" / "0.tar") as tar:
        from PIL import Image

        images = [
            Image.open(io.BytesIO(tar.extractfile(f"s{i:05d}.png").read())).convert("RGB") for i in range(N)
        ]
    img = ours.encode_image(torch.stack([ours.preprocess(x) for x in images])).double()  # (N, D)
    flat = [c for caps in captions for c in caps]
    owner = torch.tensor([i for i, caps in enumerate(captions) for _ in caps])  # (T,)
    txt = ours.encode_text(flat).double()  # (T, D)
    sims = txt @ img.T  # (T, N)
    for k in (1, 5, 10):
        t2i = (sims.topk(k, dim=1).indices == owner[:, None]).any(1).double().mean()
        i2t = np.mean(
            [
                bool(set(sims.T[i].topk(k).indices.tolist()) & set((owner == i).nonzero().flatten().tolist()))
                for i in range(N)
            ]
        )
        assert abs(record["metrics"][f"image_retrieval_recall@{k}"] - float(t2i)) <= 1e-6
        assert abs(record["metrics"][f"text_retrieval_recall@{k}"] - float(i2t)) <= 1e-6
    assert 0 < record["metrics"]["text_retrieval_recall@10"] < 1  # neither trivially 0 nor 1


def test_readme_snippet_classification_equals_mmalign_eval(snippet_run, tmp_path):
    tmp, run, _ = snippet_run
    theirs = json.loads((run / "cb_cifar10_zeroshot_classification.json").read_text())
    assert theirs["task"] == "zeroshot_classification" and theirs["dataset"] == "wds/cifar10"
    out = tmp_path / "ours.json"
    assert (
        main(["eval", "--model", str(run), "--cb-dataset", str(tmp / "wds_cifar10"), "--output", str(out)])
        == 0
    )
    mine = json.loads(out.read_text())
    assert list(mine["metrics"]) == list(theirs["metrics"]) == ["acc1", "acc5", "mean_per_class_recall"]
    for key, value in theirs["metrics"].items():
        assert isinstance(value, float) and abs(mine["metrics"][key] - value) <= 1e-6, (key, mine, theirs)
    assert 0 < theirs["metrics"]["acc5"] < 1


@pytest.mark.skipif(
    tuple(int(x) for x in np.__version__.split(".")[:2]) < (2, 4),
    reason="the breakage the shim answers is numpy >= 2.4's",
)
def test_the_installed_accuracy_is_the_one_the_shim_answers(monkeypatch):
    import importlib.metadata

    if importlib.metadata.version("clip_benchmark") != "1.6.2":
        pytest.skip("the breakage is clip_benchmark 1.6.2's")
    import importlib

    monkeypatch.setattr(cb_zs, "accuracy", cb_zs.accuracy)  # put back as it was after the test
    fresh = importlib.reload(cb_zs)  # the module as installed, without the shim
    with pytest.raises(TypeError, match="0-dimensional arrays"):
        fresh.accuracy(torch.randn(4, 6), torch.tensor([0, 1, 2, 3]), topk=(1, 5))
    assert pretrained.patch_clip_benchmark() is True  # needed here, so applied


def test_patch_replaces_only_a_failing_accuracy_once_with_the_same_values(monkeypatch):
    def working(output, target, topk=(1,)):
        return [0.5 for _ in topk]

    monkeypatch.setattr(cb_zs, "accuracy", working)
    assert pretrained.patch_clip_benchmark() is False and cb_zs.accuracy is working  # left alone

    def failing(output, target, topk=(1,)):
        raise TypeError("only 0-dimensional arrays can be converted to Python scalars")

    monkeypatch.setattr(cb_zs, "accuracy", failing)
    assert pretrained.patch_clip_benchmark() is True
    shim = cb_zs.accuracy
    assert (
        shim is not failing and pretrained.patch_clip_benchmark() is True and cb_zs.accuracy is shim
    )  # once

    # top-k accuracy by definition (a naive loop over rows) and plain floats
    g = torch.Generator().manual_seed(0)
    logits, target = torch.randn(50, 7, generator=g), torch.randint(0, 7, (50,), generator=g)
    got = shim(logits, target, topk=(1, 3, 5))
    order = np.argsort(-logits.numpy(), axis=1, kind="stable")
    want = [np.mean([target[i].item() in order[i, :k] for i in range(50)]) for k in (1, 3, 5)]
    assert all(type(v) is float for v in got) and got == pytest.approx(want, abs=1e-12)
    assert shim(logits, target) == [pytest.approx(want[0], abs=1e-12)]  # topk's default, as clip_benchmark's
