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
    txt = F.normalize(
        torch.tensor(
            [
                [1.0, 0.2, 0.0],  # image 0's caption, right: t2i rank 0
                [0.1, 1.0, 0.0],  # image 0's caption, closest to image 1: t2i rank 1
                [0.0, 1.0, 0.5],  # image 1's caption, right: rank 0
                [0.0, 1.0, 0.9],  # image 2's caption, image 1 scores higher: rank 1
            ]
        ),
        dim=-1,
    )
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


# ---- exact ties: clip_benchmark's torch.topk rule


def test_ties_are_broken_as_topk_breaks_them_hand_computed():
    # 64 images = 32 one-hot embeddings, each twice (images 2i and 2i+1 identical); caption j is
    # image j's embedding. Every score row has exactly two maxima (1.0) at 2i and 2i+1. With 64
    # candidates topk(k=1) is a partial sort that keeps the first maximum it meets (a later one
    # must be strictly greater), so the lower index wins: captions/images 2i hit, 2i+1 miss.
    img = torch.eye(32).repeat_interleave(2, dim=0)  # (64, 32)
    txt = img.clone()
    owner = torch.arange(64)
    assert torch.topk(txt[1] @ img.T, 1).indices.item() == 0  # the premise, on torch itself
    for budget in (1, 13, 1 << 24):
        m = recall_at_k(img, txt, owner, ks=(1, 2), budget_elems=budget)
        assert m["image_retrieval_recall@1"] == 0.5 and m["text_retrieval_recall@1"] == 0.5
        assert m["image_retrieval_recall@2"] == 1.0 and m["text_retrieval_recall@2"] == 1.0
    # the strict ranks (report plots) still give ties to the query
    t2i, i2t = retrieval_ranks(img, txt, owner, kmax=2)
    assert t2i.tolist() == [0] * 64 and i2t.tolist() == [0] * 64


def _clip_benchmark_recall(img, txt, owner, ks):
    """clip_benchmark 1.6.2's own metric code (the tail of zeroshot_retrieval.evaluate)."""
    cb_ret = pytest.importorskip("clip_benchmark.metrics.zeroshot_retrieval")
    scores = txt @ img.t()
    positive_pairs = torch.zeros_like(scores, dtype=bool)
    positive_pairs[torch.arange(len(scores)), owner] = True
    out = {}
    for k in ks:
        out[f"image_retrieval_recall@{k}"] = (
            (cb_ret.batchify(cb_ret.recall_at_k, scores, positive_pairs, 32, "cpu", k=k) > 0)
            .float()
            .mean()
            .item()
        )
        out[f"text_retrieval_recall@{k}"] = (
            (cb_ret.batchify(cb_ret.recall_at_k, scores.T, positive_pairs.T, 32, "cpu", k=k) > 0)
            .float()
            .mean()
            .item()
        )
    return out


@pytest.mark.parametrize(
    "kind, budget",
    [("quantised", 1), ("quantised", 13 * 90), ("quantised", 1 << 24), ("duplicated", 1 << 24)],
)
def test_recall_with_exact_ties_equals_clip_benchmark(kind, budget, gen):
    # Float scores equal clip_benchmark's only where the matmul of a caption block gives the
    # numbers of the whole matrix (here: one block; few-row blocks differ in the last bit);
    # quantised embeddings make every product exact, so any blocking must agree.
    if kind == "quantised":  # 3 levels in 6 dimensions: exact dot products, ties everywhere
        n = 90
        img = torch.randint(-1, 2, (n, 6), generator=gen).float() / 4
        owner = torch.randint(0, n, (200,), generator=gen)
        owner[:n] = torch.arange(n)  # every image has a caption
        txt = img[owner] + torch.randint(-1, 2, (200, 6), generator=gen).float() / 4
    else:  # duplicated float embeddings: equal scores from equal rows
        base = F.normalize(torch.randn(25, 8, generator=gen), dim=-1)
        img = base[torch.randint(0, 25, (70,), generator=gen)]  # 70 images, 25 distinct
        owner = torch.arange(70).repeat_interleave(2)
        cap = F.normalize(img + 0.3 * torch.randn(70, 8, generator=gen), dim=-1)
        txt = cap[owner]
        # each image's second caption copies a random image's first: wrong captions tie right ones
        txt[1::2] = cap[torch.randint(0, 70, (70,), generator=gen)]
    ks = (1, 2, 3, 5, 10)  # both of topk's algorithms (partial sort when 64 k <= candidates)
    want = _clip_benchmark_recall(img, txt, owner, ks)
    got = recall_at_k(img, txt, owner, ks=ks, budget_elems=budget)
    assert got == want
    t2i, i2t = retrieval_ranks(img, txt, owner, kmax=10)
    # the old rule (ties to the query) is optimistic here: the test data has ties that matter
    assert any(
        (t2i < k).float().mean().item() > want[f"image_retrieval_recall@{k}"]
        or (i2t < k).float().mean().item() > want[f"text_retrieval_recall@{k}"]
        for k in ks
    )
