"""Linear probe, kNN, few-shot and slices against naive references."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from sklearn.linear_model import LogisticRegression

from mmalign.evaluation import probes
from mmalign.evaluation.slices import slice_metrics


def _clusters(n_per, c, d, noise, seed):
    g = torch.Generator().manual_seed(seed)
    centres = F.normalize(torch.randn(c, d, generator=g), dim=-1)
    y = torch.arange(c).repeat_interleave(n_per)
    return F.normalize(centres[y] + noise * torch.randn(len(y), d, generator=g), dim=-1), y


def test_split_is_a_seeded_partition():
    a = probes.split_indices(50, [0.3, 0.2], seed=4)
    assert [len(p) for p in a] == [15, 10, 25]
    assert sorted(torch.cat(a).tolist()) == list(range(50))
    assert all(torch.equal(x, y) for x, y in zip(a, probes.split_indices(50, [0.3, 0.2], seed=4)))
    assert not torch.equal(a[0], probes.split_indices(50, [0.3, 0.2], seed=5)[0])


def test_knn_matches_a_vote_loop():
    tr_x, tr_y = _clusters(15, 4, 8, 1.0, seed=1)
    te_x, _ = _clusters(5, 4, 8, 1.0, seed=2)
    k = 5
    pred = probes.knn_scores(tr_x, tr_y, te_x, k, 4).argmax(1)
    for i in range(len(te_x)):
        sims = (tr_x @ te_x[i]).numpy()
        near = np.argsort(-sims)[:k]
        votes = np.bincount(tr_y[near].numpy(), minlength=4)
        tied = np.flatnonzero(votes == votes.max())
        strength = [sims[near][tr_y[near].numpy() == c].sum() for c in tied]
        assert pred[i] == tied[int(np.argmax(strength))]


def test_knn_tie_goes_to_the_more_similar_class():
    tr_x = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    q = F.normalize(torch.tensor([[1.0, 0.5]]), dim=-1)
    assert probes.knn_scores(tr_x, torch.tensor([0, 1]), q, 2, 2).argmax(1).item() == 0  # 1 vote each
    assert probes.knn_scores(tr_x, torch.tensor([1, 0]), q, 2, 2).argmax(1).item() == 1


def test_few_shot_one_episode_matches_prototype_loop():
    tr_x, tr_y = _clusters(6, 3, 5, 0.8, seed=3)
    te_x, te_y = _clusters(4, 3, 5, 0.8, seed=4)
    shots = 6  # every training example: the draw no longer matters
    got = probes.few_shot(tr_x, tr_y, te_x, te_y, 3, shots, episodes=2, seed=0)
    protos = torch.stack([F.normalize(tr_x[tr_y == c].mean(0), dim=0) for c in range(3)])
    want = float(((te_x @ protos.T).argmax(1) == te_y).float().mean())
    assert got["acc1"] == pytest.approx(want)
    assert got["acc1_std"] == pytest.approx(0.0)


def test_linear_probe_picks_c_on_validation_and_refits():
    x, y = _clusters(30, 3, 6, 1.2, seed=5)
    tr, va, te = probes.split_indices(90, [0.4, 0.2], seed=0)[::-1]
    cs = [0.001, 1.0, 100.0]
    got = probes.linear_probe(x[tr], y[tr], x[va], y[va], x[te], y[te], 3, cs)
    val_acc = {
        c: (
            LogisticRegression(C=c, max_iter=1000, random_state=0)
            .fit(x[tr].numpy(), y[tr].numpy())
            .predict(x[va].numpy())
            == y[va].numpy()
        ).mean()
        for c in cs
    }
    best = max(cs, key=lambda c: (val_acc[c], -c))
    assert got["best_C"] == best
    final = LogisticRegression(C=best, max_iter=1000, random_state=0).fit(
        torch.cat([x[tr], x[va]]).numpy(), torch.cat([y[tr], y[va]]).numpy()
    )
    assert got["acc1"] == pytest.approx(float((final.predict(x[te].numpy()) == y[te].numpy()).mean()))
    assert got["val_acc1_by_C"] == {str(c): pytest.approx(a) for c, a in val_acc.items()}


def test_run_probes_reports_every_method_and_beats_chance_on_separable_data():
    x, y = _clusters(40, 4, 8, 0.1, seed=6)
    m = probes.run_probes(x, y, 4, {"knn_k": [3], "shots": [2], "Cs": [1.0]})
    assert m["n_train"] + m["n_val"] + m["n_test"] == 160
    for key in ("linear_acc1", "knn3_acc1", "fewshot2_acc1", "linear_mean_per_class_recall"):
        assert m[key] > 0.9, key


def test_slice_metrics_match_a_group_loop():
    logits = torch.randn(60, 4)
    labels = torch.randint(0, 4, (60,))
    metas = [{"background": ["white", "black", "gray"][i % 3], "grid": [i % 2, 0]} for i in range(60)]
    got = slice_metrics(logits, labels, metas, "background")
    assert list(got) == ["black", "gray", "white"]
    for value, stats in got.items():
        idx = [i for i, m in enumerate(metas) if m["background"] == value]
        assert stats["n"] == len(idx)
        assert stats["acc1"] == pytest.approx(float((logits[idx].argmax(1) == labels[idx]).float().mean()))
    assert set(slice_metrics(logits, labels, metas, "grid")) == {"[0, 0]", "[1, 0]"}
    assert set(slice_metrics(logits, labels, metas, "size")) == {"<missing>"}
