import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmalign.evaluation.retrieval import recall_at_k
from mmalign.evaluation.zeroshot import build_classifier, zero_shot_metrics


def _naive_recalls(img, txt, owner, ks):
    """clip_benchmark's definitions, written out with full matrices and loops."""
    scores = (txt @ img.T).numpy()  # (M, N)
    out = {}
    for k in ks:
        t2i = [owner[j] in np.argsort(-scores[j])[:k] for j in range(len(owner))]
        out[f"image_retrieval_recall@{k}"] = float(np.mean(t2i))
        i2t = []
        for i in range(img.shape[0]):
            top = np.argsort(-scores[:, i])[:k]
            i2t.append(any(owner[j] == i for j in top))
        out[f"text_retrieval_recall@{k}"] = float(np.mean(i2t))
    return out


@pytest.mark.parametrize("budget", [7, 1 << 24])
def test_recall_matches_naive_definition_with_several_captions(budget):
    n, d = 40, 8
    img = F.normalize(torch.randn(n, d), dim=-1)
    owner = [i for i in range(n) for _ in range(random.randint(1, 3))]
    txt = F.normalize(img[owner] + 0.8 * torch.randn(len(owner), d), dim=-1)
    got = recall_at_k(img, txt, torch.tensor(owner), ks=(1, 5, 10), budget_elems=budget)
    want = _naive_recalls(img, txt, owner, (1, 5, 10))
    assert got == pytest.approx(want)
    assert 0 < got["text_retrieval_recall@1"] < 1


def test_zero_shot_classifier_and_metrics():
    # One table row per prompt, not hash(): hash() changes with each process, and two prompts
    # sharing a row could make two classes tie, where argmax and topk may pick differently.
    c, d, t = 6, 16, 3
    table = torch.randn(c * t, d)
    vocab: dict[str, int] = {}

    def tokenizer(texts):
        return torch.tensor([vocab.setdefault(s, len(vocab)) for s in texts])

    def encode_text(tokens):
        return table[tokens] * 3.0  # unnormalised on purpose

    names = [f"class{i}" for i in range(c)]
    templates = ["a {c}.", "the {c}!", "{c}"]
    w = build_classifier(encode_text, tokenizer, names, templates)
    for i, name in enumerate(names):
        emb = F.normalize(encode_text(tokenizer([tt.format(c=name) for tt in templates])), dim=-1)
        torch.testing.assert_close(w[:, i], F.normalize(emb.mean(0), dim=0))
    feats = F.normalize(torch.randn(50, d), dim=-1)
    labels = torch.randint(0, c, (50,))
    m = zero_shot_metrics(feats, w, labels)
    logits = (feats @ w).numpy()
    top1 = logits.argmax(1)
    assert m["acc1"] == pytest.approx(float((top1 == labels.numpy()).mean()))
    top5 = np.argsort(-logits, 1)[:, :5]
    assert m["acc5"] == pytest.approx(float(np.mean([labels[i].item() in top5[i] for i in range(50)])))
    recalls = [np.mean(top1[labels.numpy() == k] == k) for k in range(c) if (labels.numpy() == k).any()]
    assert m["mean_per_class_recall"] == pytest.approx(float(np.mean(recalls)))


def test_acc5_is_nan_with_fewer_than_5_classes():
    w = F.normalize(torch.randn(4, 3), dim=0)
    m = zero_shot_metrics(F.normalize(torch.randn(10, 4), dim=-1), w, torch.randint(0, 3, (10,)))
    assert math.isnan(m["acc5"])


def test_classifier_batched_over_classes_equals_one_class_at_a_time():
    """A real text tower and tokenizer: prompts of different lengths, batches that cut across
    classes (7 prompts a call), against clip_benchmark's one-class-per-call construction."""
    from mmalign.models import TwoTower
    from mmalign.models.presets import PRESETS
    from mmalign.models.tokenizers import build_tokenizer

    torch.manual_seed(0)
    model = TwoTower(PRESETS["micro"]).eval()
    tokenizer = build_tokenizer(PRESETS["micro"])
    names = ["cat", "sea lion", "a very long and winding class name", "t-shirt"]
    templates = ["a photo of a {c}.", "{c}", "a blurry photo of the big {c} in the wild, seen from afar."]
    w = build_classifier(model.encode_text, tokenizer, names, templates, batch_size=7)  # (D, C)
    with torch.no_grad():
        for i, name in enumerate(names):
            emb = F.normalize(model.encode_text(tokenizer([tt.format(c=name) for tt in templates])), dim=-1)
            torch.testing.assert_close(w[:, i], F.normalize(emb.mean(0), dim=0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mean_per_class_recall_is_sklearns_balanced_accuracy(seed):
    """Against sklearn itself, with a class that is only predicted and one never predicted."""
    from sklearn.metrics import balanced_accuracy_score

    from mmalign.evaluation.zeroshot import _balanced_accuracy

    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 6, 200)  # classes 0..5 present
    pred = np.where(rng.random(200) < 0.5, labels, rng.integers(0, 8, 200))  # 6, 7 only predicted
    pred[pred == 3] = 4  # class 3 never predicted
    assert _balanced_accuracy(labels, pred) == balanced_accuracy_score(labels, pred)
