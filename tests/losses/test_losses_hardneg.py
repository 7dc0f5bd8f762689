"""Hard-negative weighting (Robinson et al. 2021) and debiased InfoNCE
(Chuang et al. 2020): values and gradients against a naive float64
reference written row by row from the formulas, untiled and tiled, paired
and with id groups; the reductions to plain InfoNCE and the clamp.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmalign.losses import clip_loss
from mmalign.objective import Contrastive, build_objective
from tests.harness import (
    objectives,
    unit,  # noqa: F401  (the `gen` fixture lives there too)
)


def rel_err(got, ref, floor=1e-3):
    got, ref = got.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    return ((got - ref).norm() / max(ref.norm().item(), floor)).item()


def ref_row(logits_row, is_pos, s, beta, prior):
    """One anchor, written straight from the papers' formulas (float64)."""
    pos = [logits_row[j] for j in range(len(is_pos)) if is_pos[j]]
    neg = [logits_row[j] for j in range(len(is_pos)) if not is_pos[j]]
    mean_pos = sum(pos) / len(pos)
    sum_pos = sum(torch.exp(p) for p in pos)
    if not neg:
        return torch.log(sum_pos) - mean_pos
    m = len(neg)
    imp = [torch.exp(beta * l) for l in neg]
    mean_imp = sum(imp) / m
    r = sum(w / mean_imp * torch.exp(l) for w, l in zip(imp, neg))
    if prior > 0:
        e_pos = sum_pos / len(pos)
        ng = (r - prior * m * e_pos) / (1 - prior)
        ng = torch.maximum(ng, m * torch.exp(-s))
    else:
        ng = r
    return torch.log(sum_pos + ng) - mean_pos


def ref_loss(x, y, s, ids, beta, prior):
    logits = s * x @ y.T
    same = ids[:, None] == ids[None, :]
    b = x.shape[0]
    i2t = sum(ref_row(logits[i], same[i], s, beta, prior) for i in range(b)) / b
    t2i = sum(ref_row(logits.T[i], same.T[i], s, beta, prior) for i in range(b)) / b
    return (i2t + t2i) / 2


def check(gen, b, tile, with_ids, beta, prior, scale_val=None, tol=2e-5, aligned=False):
    x, y = unit(gen, b, 8), unit(gen, b, 8)
    if aligned:  # a confident model: each caption near its image
        y = F.normalize(x + 0.1 * y, dim=1)
    scale = torch.tensor([scale_val if scale_val else 2.0 + 18.0 * torch.rand((), generator=gen).item()])
    ids = torch.randint(0, max(2, b // 3), (b,), generator=gen) if with_ids else None
    if ids is not None:
        ids[1] = ids[0]
    leaves = [t.clone().requires_grad_() for t in (x, y, scale)]
    got = clip_loss(*leaves, positive_ids=ids, tile_size=tile, hard_negative_beta=beta, debias_prior=prior)
    got.backward()
    refs = [t.double().clone().requires_grad_() for t in (x, y, scale)]
    ref = ref_loss(
        refs[0], refs[1], refs[2].reshape(()), ids if ids is not None else torch.arange(b), beta, prior
    )
    ref.backward()
    assert rel_err(got, ref) < tol, (got.item(), ref.item())
    for g, r, what in zip((l.grad for l in leaves), (r.grad for r in refs), ("dx", "dy", "dscale")):
        assert torch.isfinite(g).all(), what
        assert rel_err(g, r) < tol, (what, rel_err(g, r))


@pytest.mark.parametrize("tile", [None, 3])
@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("beta,prior", [(0.5, 0.0), (0.0, 0.1), (1.0, 0.1), (0.3, 0.5)])
def test_matches_naive_reference(gen, tile, with_ids, beta, prior):
    check(gen, 7, tile, with_ids, beta, prior)


@pytest.mark.parametrize("tile", [None, 2])
def test_clamp_binds_and_is_exact(gen, tile):
    # A large prior with a confident model drives the corrected sum below the floor M e^{-s}
    # for every row (R_i << tau+ M e^{l_ii}); mixed with rows where it does not bind below.
    check(gen, 6, tile, False, 0.0, 0.9, scale_val=30.0, aligned=True)
    check(gen, 6, tile, False, 0.5, 0.5, scale_val=30.0)


@pytest.mark.parametrize("tile", [None, 4])
def test_rows_with_only_positives_are_finite(gen, tile):
    # All ids equal: no row has a negative; the loss is log|P| - mean + logsumexp, finite gradients.
    x, y = unit(gen, 5, 8).requires_grad_(), unit(gen, 5, 8).requires_grad_()
    s = torch.tensor(10.0, requires_grad=True)
    ids = torch.zeros(5, dtype=torch.int64)
    loss = clip_loss(x, y, s, positive_ids=ids, tile_size=tile, hard_negative_beta=0.5, debias_prior=0.1)
    loss.backward()
    plain = clip_loss(x.detach(), y.detach(), s.detach(), positive_ids=ids)
    assert torch.isclose(loss.detach(), plain, rtol=1e-5)
    assert all(torch.isfinite(t.grad).all() for t in (x, y, s))


@pytest.mark.parametrize("tile", [None, 3])
@pytest.mark.parametrize("with_ids", [False, True])
def test_tiny_options_approach_plain_infonce(gen, tile, with_ids):
    # beta -> 0 and tau+ -> 0 is plain (multi-positive) InfoNCE; the estimator path is continuous there.
    x, y = unit(gen, 9, 8), unit(gen, 9, 8)
    s = torch.tensor(8.0)
    ids = torch.randint(0, 3, (9,), generator=gen) if with_ids else None
    plain = clip_loss(x, y, s, positive_ids=ids, tile_size=tile)
    est = clip_loss(x, y, s, positive_ids=ids, tile_size=tile, hard_negative_beta=1e-7, debias_prior=1e-9)
    assert abs(plain.item() - est.item()) < 1e-5


def test_hard_weighting_raises_the_hardest_negatives_weight(gen):
    # With beta > 0 the loss grows (weights favour the larger logits) and the hardest
    # negative's gradient share grows.
    x, y = unit(gen, 16, 8).requires_grad_(), unit(gen, 16, 8)
    s = torch.tensor(10.0)
    plain = clip_loss(x, y, s)
    hard = clip_loss(x, y, s, hard_negative_beta=2.0)
    assert hard.item() > plain.item()


def test_objective_term_and_build_objective(gen):
    from mmalign.config import load_config

    cfg = load_config(None, ["loss.hard_negative_beta=0.5", "loss.debias_prior=0.1"])
    (term,) = build_objective(cfg).terms
    assert (term.hard_negative_beta, term.debias_prior) == (0.5, 0.1)
    x, y = unit(gen, 6, 8), unit(gen, 6, 8)
    s = torch.tensor(7.0)
    out = objectives.loss(x, y, s, beta=0.5, prior=0.1)
    want = clip_loss(x, y, s, hard_negative_beta=0.5, debias_prior=0.1)
    assert torch.allclose(out.loss, want)
    assert math.isfinite(out.stats["hardest_neg_prob"]) and out.stats["n_candidates"] == 6
    with pytest.raises(ValueError):
        Contrastive("infonce", debias_prior=1.0)


def test_config_keys_and_checks():
    from mmalign.config import ConfigError, load_config

    cfg = load_config(None, ["loss.hard_negative_beta=0.5", "loss.debias_prior=0.1"])
    assert (cfg.loss.hard_negative_beta, cfg.loss.debias_prior) == (0.5, 0.1)
    for bad, key in [
        ("loss.hard_negative_beta=-1", "loss.hard_negative_beta"),
        ("loss.debias_prior=1.0", "loss.debias_prior"),
    ]:
        with pytest.raises(ConfigError, match=key):
            load_config(None, [bad])
    with pytest.raises(ConfigError, match="infonce"):
        load_config(None, ["loss.name=siglip", "model.init_logit_bias=-10", "loss.debias_prior=0.1"])
