"""Embedding diagnostics against naive loops and hand-made embeddings with known answers."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from mmalign.evaluation import diagnostics as dg


def test_alignment_and_modality_gap_known_values():
    a = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    b = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # first pair orthogonal (|a-b|^2 = 2), second identical
    assert dg.alignment(a, b) == pytest.approx(1.0)
    assert dg.alignment(a, -a) == pytest.approx(4.0)  # antipodal: the maximum
    assert dg.modality_gap(a, b) == pytest.approx(math.hypot(0.5, 0.5))


def test_uniformity_matches_pairwise_loop():
    x = F.normalize(torch.randn(25, 5), dim=-1)
    vals = [math.exp(-2 * float((x[i] - x[j]).pow(2).sum())) for i in range(25) for j in range(25) if i != j]
    assert dg.uniformity(x) == pytest.approx(math.log(np.mean(vals)), abs=1e-5)
    collapsed = F.normalize(torch.ones(10, 5), dim=-1)
    assert dg.uniformity(collapsed) == pytest.approx(0.0, abs=1e-6)  # all one point: the worst value


def test_effective_rank_known_values():
    # k orthogonal directions with equal spread: singular values equal -> exp(H) = k
    for k in (1, 2, 4):
        x = torch.cat([torch.eye(8)[:k], -torch.eye(8)[:k]])  # centred, k equal singular values
        assert dg.effective_rank(x) == pytest.approx(k, rel=1e-5)
    # singular values 3 and 1 (not squared): p = (0.75, 0.25)
    x = torch.tensor([[3.0, 0.0], [-3.0, 0.0], [0.0, 1.0], [0.0, -1.0]])
    p = np.array([0.75, 0.25])
    assert dg.effective_rank(x) == pytest.approx(math.exp(-(p * np.log(p)).sum()), rel=1e-5)


def test_nn_diversity_against_loop_and_known_cases():
    x = F.normalize(torch.randn(40, 6), dim=-1)
    sims = (x @ x.T).fill_diagonal_(-2)
    want = len({int(sims[i].argmax()) for i in range(40)}) / 40
    assert dg.nn_diversity(x, budget_elems=7) == pytest.approx(want)
    # a hub: the mean direction of 4 orthogonal spokes (cosine 0.5 to each, the spokes 0 to each
    # other) is every spoke's nearest neighbour
    spokes = torch.eye(4)
    hub = F.normalize(torch.ones(1, 4), dim=-1)
    assert dg.nn_diversity(torch.cat([hub, spokes])) == pytest.approx(
        2 / 5
    )  # the hub, and the hub's own neighbour


def test_positive_negative_auc_matches_sklearn_with_ties():
    pos = torch.tensor([0.9, 0.5, 0.5, 0.2])
    neg = torch.tensor([0.5, 0.1, 0.3, 0.5, 0.95])
    want = roc_auc_score([1] * 4 + [0] * 5, torch.cat([pos, neg]).numpy())
    assert dg.positive_negative_auc(pos, neg) == pytest.approx(want)


def test_similarity_samples_are_positives_and_true_negatives():
    img = F.normalize(torch.randn(6, 4), dim=-1)
    owner = torch.tensor([0, 0, 1, 2, 3, 4, 5, 5])
    txt = F.normalize(torch.randn(8, 4), dim=-1)
    s = dg.similarity_samples(img, txt, owner, n_negatives=500, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(s["positive"], torch.tensor([float(txt[j] @ img[owner[j]]) for j in range(8)]))
    all_neg = {round(float(txt[j] @ img[i]), 5) for j in range(8) for i in range(6) if owner[j] != i}
    assert {round(v, 5) for v in s["negative"].tolist()} <= all_neg
    assert 400 < len(s["negative"]) <= 500


def test_embedding_diagnostics_separates_aligned_from_shuffled():
    img = F.normalize(torch.randn(200, 16), dim=-1)
    owner = torch.arange(400) % 200
    txt = F.normalize(img[owner] + 0.3 * torch.randn(400, 16), dim=-1)
    good = dg.embedding_diagnostics(img, txt, owner)
    bad = dg.embedding_diagnostics(img, txt[torch.randperm(400)], owner)
    assert good["positive_negative_auc"] > 0.95 > 0.7 > bad["positive_negative_auc"]
    assert good["alignment"] < bad["alignment"]
    assert good["positive_similarity_mean"] > good["negative_similarity_mean"] + 0.5
    assert set(good) >= {
        "uniformity_image",
        "uniformity_text",
        "effective_rank_image",
        "dim_std_min_text",
        "modality_gap",
        "nn_diversity_image",
        "nn_diversity_text",
    }
