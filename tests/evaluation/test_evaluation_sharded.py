"""A 2-rank evaluation equals the 1-rank one (mmalign.evaluation.sharded).

Rank r embeds samples r, r+2, ...; rank 0 gathers, interleaves and runs the tasks.
Tolerances: the gathered features equal one process's to 1e-5 absolute (fp32
matrix products over other batch compositions may differ in the last bits), the
keys and caption order exactly, every metric to 1e-6 absolute.
The log states the other ranks' barrier timeout.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from tests.harness import run_ranks

pytestmark = pytest.mark.integration


def _worker(rank: int, world: int, val: str) -> dict:
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import eval_transform
    from mmalign.evaluation import load_suite
    from mmalign.evaluation.sharded import build_classifiers, embed_sharded, evaluate
    from mmalign.models import build_model
    from mmalign.models.tokenizers import build_tokenizer

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("mmalign.evaluation").addHandler(handler)
    logging.getLogger("mmalign.evaluation").setLevel(logging.INFO)
    torch.manual_seed(3)
    model = build_model(ModelConfig(preset="micro"))
    suite, tokenizer, transform = (
        load_suite("shapes"),
        build_tokenizer(model.arch),
        eval_transform(model.image_size),
    )
    emb, _ = embed_sharded(model, transform, tokenizer, suite, val, batch_size=16)
    records = evaluate(model, transform, tokenizer, suite, val, batch_size=16)
    encode, encoded = model.encode_text, []

    def counted(tokens, *args, **kwargs):  # the prompts this rank encodes
        encoded.append(len(tokens))
        return encode(tokens, *args, **kwargs)

    model.encode_text = counted
    classifiers = build_classifiers(model, tokenizer, suite)
    return {"emb": emb, "records": records, "log": lines, "classifiers": classifiers, "encoded": sum(encoded)}


def test_two_rank_evaluation_equals_one_rank(shapes_dir):
    val = str(shapes_dir / "val" / "00000.tar")
    one, two = run_ranks(_worker, 1, val, pooled=True)[0], run_ranks(_worker, 2, val, pooled=True)[0]
    a, b = one["emb"], two["emb"]
    assert a["keys"] == b["keys"] and a["captions"] == b["captions"] and len(a["keys"]) == 120
    assert torch.equal(a["text_to_image"], b["text_to_image"])
    for key in ("image_features", "text_features"):
        assert (a[key] - b[key]).abs().max() <= 1e-5, key
    assert [r["dataset"] for r in one["records"]] == [r["dataset"] for r in two["records"]]
    for r1, r2 in zip(one["records"], two["records"]):
        for name, value in r1["metrics"].items():
            if isinstance(value, float):
                assert r2["metrics"][name] == pytest.approx(value, abs=1e-6), (r1["dataset"], name)
    # the classifiers: each rank encoded half of every zero-shot task's prompts, and the gathered
    # classifier is clip_benchmark's construction, one class at a time, in one process
    suite, model, tokenizer = _reference_model()
    prompts, rank0_share = 0, 0
    for task in (t for t in suite["tasks"] if t["type"] == "zeroshot"):
        n = len(task["classnames"]) * len(task["templates"])
        prompts, rank0_share = prompts + n, rank0_share + (n + 1) // 2
        with torch.no_grad():
            want = torch.stack(
                [
                    F.normalize(
                        F.normalize(
                            model.encode_text(tokenizer([t.format(c=c) for t in task["templates"]])), dim=-1
                        ).mean(0),
                        dim=0,
                    )
                    for c in task["classnames"]
                ],
                1,
            )
        for got in (one["classifiers"][task["name"]], two["classifiers"][task["name"]]):
            assert (got - want).abs().max() <= 1e-5, task["name"]
    assert one["encoded"] == prompts and two["encoded"] == rank0_share
    assert any("wait for rank 0's tasks with a" in line for line in two["log"])
    assert not any("timeout" in line for line in one["log"])


def _reference_model():
    from mmalign.config import ModelConfig
    from mmalign.evaluation import load_suite
    from mmalign.models import build_model
    from mmalign.models.tokenizers import build_tokenizer

    torch.manual_seed(3)
    model = build_model(ModelConfig(preset="micro")).eval()  # the workers' model
    return load_suite("shapes"), model, build_tokenizer(model.arch)


def test_interleave_restores_dataset_order_with_uneven_shares():
    from mmalign.evaluation.sharded import interleave

    g = torch.Generator().manual_seed(0)
    n, world = 7, 3
    caps = [[f"c{i}.{k}" for k in range(1 + i % 3)] for i in range(n)]
    img = torch.randn(n, 4, generator=g)
    txt = {c: torch.randn(4, generator=g) for cs in caps for c in cs}
    parts = []
    for r in range(world):
        mine = list(range(r, n, world))
        parts.append(
            {
                "keys": [f"k{i}" for i in mine],
                "metas": [{"i": i} for i in mine],
                "image_features": img[mine],
                "captions": [c for i in mine for c in caps[i]],
                "text_to_image": torch.tensor([j for j, i in enumerate(mine) for _ in caps[i]]),
                "text_features": torch.stack([txt[c] for i in mine for c in caps[i]]),
            }
        )
    out = interleave(parts)
    assert out["keys"] == [f"k{i}" for i in range(n)]
    assert torch.equal(out["image_features"], img)
    assert out["captions"] == [c for cs in caps for c in cs]
    assert out["text_to_image"].tolist() == [i for i in range(n) for _ in caps[i]]
    assert torch.equal(out["text_features"], torch.stack([txt[c] for cs in caps for c in cs]))
