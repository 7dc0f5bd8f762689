"""Recall@k and retrieval ranks against naive full-matrix loops (clip_benchmark's definitions)."""

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from mmalign.evaluation.retrieval import recall_at_k, retrieval_ranks


def _naive(img, txt, owner, k):
    """Loops over the full (captions x images) score matrix."""
    scores = (txt @ img.T).numpy()
    t2i = np.mean([owner[j] in np.argsort(-scores[j])[:k] for j in range(len(owner))])
    i2t = np.mean([any(owner[j] == i for j in np.argsort(-scores[:, i])[:k]) for i in range(img.shape[0])])
    return float(t2i), float(i2t)


@pytest.mark.parametrize("budget", [1, 13, 1 << 24])  # one caption per block, odd blocks, one block
def test_recall_matches_naive_for_every_k(budget):
    n, d = 30, 6
    img = F.normalize(torch.randn(n, d), dim=-1)
    owner = [i for i in range(n) for _ in range(random.randint(1, 4))]
    txt = F.normalize(img[owner] + torch.randn(len(owner), d), dim=-1)
    ks = list(range(1, 12))
    got = recall_at_k(img, txt, torch.tensor(owner), ks=ks, budget_elems=budget)
    for k in ks:
        t2i, i2t = _naive(img, txt, owner, k)
        assert got[f"image_retrieval_recall@{k}"] == pytest.approx(t2i)
        assert got[f"text_retrieval_recall@{k}"] == pytest.approx(i2t)


def test_hand_made_example_with_known_answers():
    # 3 images on the axes; captions: two for image 0, one each for images 1 and 2.
    img = torch.eye(3)
    txt = F.normalize(torch.tensor([
        [1.0, 0.2, 0.0],   # image 0's caption, right: t2i rank 0
        [0.1, 1.0, 0.0],   # image 0's caption, closest to image 1: t2i rank 1
        [0.0, 1.0, 0.5],   # image 1's caption, right: rank 0
        [0.0, 1.0, 0.9],   # image 2's caption, image 1 scores higher: rank 1
    ]), dim=-1)
    owner = torch.tensor([0, 0, 1, 2])
    t2i, i2t = retrieval_ranks(img, txt, owner, kmax=3)
    assert t2i.tolist() == [0, 1, 0, 1]
    # image 0: its caption 0 is top; image 1: caption 1 (0.1, 1.0) and caption 3 (1.0, 0.9) vs own caption 2 (1.0, 0.5):
    # normalised, caption 1 scores 0.995 and caption 3 0.74 vs own 0.894 -> rank 1;
    # image 2: own caption 3 scores 0.669, caption 2 scores 0.447 -> rank 0
    assert i2t.tolist() == [0, 1, 0]
    m = recall_at_k(img, txt, owner, ks=(1, 2))
    assert m["image_retrieval_recall@1"] == pytest.approx(0.5)
    assert m["text_retrieval_recall@1"] == pytest.approx(2 / 3)
    assert m["image_retrieval_recall@2"] == m["text_retrieval_recall@2"] == 1.0


def test_ties_go_to_the_query():
    # a wrong caption identical to the right one does not push it out of the top 1
    img = torch.eye(2)
    txt = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    t2i, i2t = retrieval_ranks(img, txt, torch.tensor([0, 1, 1]), kmax=5)
    assert i2t.tolist() == [0, 0]
    assert t2i.tolist() == [0, 1, 0]


def test_k_larger_than_the_candidates_is_a_hit():
    img = F.normalize(torch.randn(3, 4), dim=-1)
    txt = F.normalize(torch.randn(4, 4), dim=-1)
    m = recall_at_k(img, txt, torch.tensor([0, 1, 2, 2]), ks=(10,))
    assert m == {"image_retrieval_recall@10": 1.0, "text_retrieval_recall@10": 1.0}
