"""Our zero-shot and Recall@k numbers equal clip_benchmark's on the same model and data.

clip_benchmark (the pin: clip_benchmark==1.6.2) is a test dependency; these tests skip
without it.  Its ``zeroshot_classification.evaluate`` breaks under numpy >= 2.4 (it calls
float() on a 1-element array), so classification goes through its
``zero_shot_classifier`` + ``run_classification`` and our code computes the metrics from
its logits by sklearn's definitions.  ``amp=False``: on CPU its autocast would run the
towers in bfloat16.
"""

import random

import numpy as np
import pytest
import torch
from sklearn.metrics import balanced_accuracy_score

cb_models = pytest.importorskip("clip_benchmark.models")
from clip_benchmark.metrics import zeroshot_classification as cb_zs  # noqa: E402
from clip_benchmark.metrics import zeroshot_retrieval as cb_ret  # noqa: E402

from data_pipelines import shapes  # noqa: E402
from data_pipelines.writer import ShardWriter  # noqa: E402
from mmalign.data.shards import read_samples  # noqa: E402
from mmalign.evaluation import load_suite, run_suite  # noqa: E402
from mmalign.pretrained import clip_benchmark_loader  # noqa: E402

BATCH = 32  # the same on both sides, so both encode identical batches


@pytest.fixture(scope="module")
def parity_setup(tmp_path_factory):
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.arch import resolve_arch
    from mmalign.models.io import save_pretrained
    from mmalign.models.two_tower import TwoTower

    root = tmp_path_factory.mktemp("parity")
    torch.manual_seed(11)
    model = TwoTower(resolve_arch(ModelConfig(preset="micro")))
    save_pretrained(model, root / "model", preprocess=preprocess_cfg(model.image_size))
    # 70 scenes, 1-3 captions each; a per-sample suffix makes every caption distinct, so no
    # wrong caption exactly ties a right one (where the two libraries' tie rules differ).
    rng = random.Random(5)
    with ShardWriter(root / "val", samples_per_shard=1000) as writer:
        for i in range(70):
            attrs = shapes.sample_attributes(rng)
            caps = [f"{c} ({i})" for c in shapes.captions_for(attrs, rng, n=rng.randint(1, 3))]
            writer.write(
                shapes.draw(attrs, 32), "\n".join(caps), {k: v for k, v in attrs.items() if k != "jitter"}
            )
    cb_models.TYPE2FUNC["mmalign"] = clip_benchmark_loader
    cb_models.MODEL_TYPES.append("mmalign")
    model, transform, tokenizer = cb_models.load_clip("mmalign", "micro", str(root / "model"), None, "cpu")
    return model, transform, tokenizer, str(root / "val" / "00000.tar")


def _loader(samples, transform, target):
    items = [(transform(s["image"]), target(s)) for s in samples]

    def collate(batch):
        images = torch.stack([b[0] for b in batch])
        targets = [b[1] for b in batch]
        return images, (torch.tensor(targets) if isinstance(targets[0], int) else targets)

    return torch.utils.data.DataLoader(items, batch_size=BATCH, shuffle=False, collate_fn=collate)


def test_zero_shot_matches_clip_benchmark(parity_setup):
    model, transform, tokenizer, shard = parity_setup
    suite = load_suite("shapes")
    records = {
        r["dataset"].split("/")[1]: r
        for r in run_suite(model, transform, tokenizer, suite, shard, batch_size=BATCH)
    }
    samples = list(read_samples([shard]))
    for task in (t for t in suite["tasks"] if t["type"] == "zeroshot"):
        names = task["classnames"]
        weights = cb_zs.zero_shot_classifier(model, tokenizer, names, task["templates"], "cpu", amp=False)
        loader = _loader(samples, transform, lambda s: names.index(s["json"][task["label_field"]]))
        logits, true = cb_zs.run_classification(model, weights, loader, "cpu", amp=False)
        top5 = logits.topk(5, dim=1).indices
        want = {
            "acc1": float((logits.argmax(1) == true).float().mean()),
            "acc5": float((top5 == true[:, None]).any(1).float().mean()),
            "mean_per_class_recall": float(balanced_accuracy_score(true.numpy(), logits.argmax(1).numpy())),
        }
        got = records[task["name"]]["metrics"]
        for key, value in want.items():
            assert abs(got[key] - value) <= 1e-6, (task["name"], key, got[key], value)


def test_retrieval_matches_clip_benchmark(parity_setup):
    model, transform, tokenizer, shard = parity_setup
    suite = {"name": "parity", "tasks": [{"name": "retrieval", "type": "retrieval", "ks": [1, 2, 5, 10]}]}
    got = run_suite(model, transform, tokenizer, suite, shard, batch_size=BATCH)[0]["metrics"]
    samples = list(read_samples([shard]))
    assert sum(len(s["captions"]) for s in samples) > len(samples)  # several captions per image
    want = cb_ret.evaluate(
        model,
        _loader(samples, transform, lambda s: s["captions"]),
        tokenizer,
        "cpu",
        amp=False,
        recall_k_list=[1, 2, 5, 10],
    )
    assert set(got) == set(want)
    for key, value in want.items():
        assert abs(got[key] - value) <= 1e-6, (key, got[key], value)
    assert 0 < np.mean(list(want.values())) < 1  # neither trivially 0 nor 1
