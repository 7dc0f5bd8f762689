"""NT-Xent between two image views (SimCLR / SLIP) against a naive float64
reference with explicit loops, untiled and tiled."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from mmalign.losses.ntxent import ntxent_loss


def ref_ntxent(z1, z2, s):
    z = torch.cat([z1, z2])
    n, b = z.shape[0], z1.shape[0]
    total = 0.0
    for a in range(n):
        p = (a + b) % n
        logits = [s * z[a] @ z[c] for c in range(n) if c != a]
        total = total + torch.logsumexp(torch.stack(logits), 0) - s * z[a] @ z[p]
    return total / n


U32 = 2.0**-24  # float32 unit roundoff


def ntxent_grad_bound(z1, z2, s):
    """(2B, D) per-element bounds on the float32 rounding error of the NT-Xent gradient (float64 in).

    dL/dz_k = (s/n) (sum_c (P_kc + P_ck) z_c - 2 z_pos(k)), P the softmax over the other rows (n = 2B):
    a sum of terms that cancel, so its rounding error is relative to the sum of the terms' absolute
    values, S_k = (s/n) (P + P^T + 2 Pos) |z|, not to the element (which may be near zero). To first
    order, a float32 logit s z_a.z_c of unit D-vectors is off by at most s D u, which moves a softmax
    weight by at most 2 s D u of itself; summing the n terms (and the ranks' partial gradients) adds
    at most (n + 2) u of S. Hence |error| <= (2 s D + n + 2) u S, element by element."""
    z = torch.cat([z1, z2]).double()  # (n, D)
    n, b, d = z.shape[0], z1.shape[0], z.shape[1]
    logits = s * z @ z.T  # (n, n)
    logits.fill_diagonal_(float("-inf"))
    pos = torch.zeros(n, n, dtype=torch.float64)
    pos[torch.arange(n), (torch.arange(n) + b) % n] = 1.0  # symmetric: a view's positive is its other view
    p = logits.softmax(1)
    terms = (s / n) * (p + p.T + 2 * pos) @ z.abs()  # (n, D)
    return (2 * s * d + n + 2) * U32 * terms


@pytest.mark.parametrize("tile", [None, 3])
def test_matches_naive_reference(gen, tile):
    b = 5
    z1 = F.normalize(torch.randn(b, 8, generator=gen), dim=1).requires_grad_()
    z2 = F.normalize(torch.randn(b, 8, generator=gen), dim=1).requires_grad_()
    got = ntxent_loss(z1, z2, 10.0, tile_size=tile)
    got.backward()
    r1, r2 = (t.detach().double().requires_grad_() for t in (z1, z2))
    ref = ref_ntxent(r1, r2, 10.0)
    ref.backward()
    assert abs(got.item() - ref.item()) < 1e-5 * max(1.0, abs(ref.item()))
    for g, r in ((z1.grad, r1.grad), (z2.grad, r2.grad)):
        assert ((g.double() - r).norm() / r.norm()).item() < 1e-5


def test_identical_uninformative_views_give_log_of_candidates():
    # All embeddings equal: every logit equal, loss = log(2B - 1).
    z = F.normalize(torch.ones(4, 3), dim=1)
    assert math.isclose(ntxent_loss(z, z, 5.0).item(), math.log(7), rel_tol=1e-6)


def test_image_image_term_adds_weighted_ntxent_at_fixed_temperature(gen):
    from tests.harness import objectives

    b, w, tau = 6, 0.3, 0.1
    x, x2, y = (F.normalize(torch.randn(b, 8, generator=gen), dim=1).requires_grad_() for _ in range(3))
    s = torch.tensor([12.0])
    out = objectives.loss(x, y, s, x2=x2, views=(w, tau))
    out.loss.backward()
    r = [t.detach().double().requires_grad_() for t in (x, x2, y)]
    logits = s.double() * r[0] @ r[2].T
    clip = (torch.logsumexp(logits, 1) - logits.diagonal()).mean() / 2 + (
        torch.logsumexp(logits, 0) - logits.diagonal()
    ).mean() / 2
    ref = clip + w * ref_ntxent(r[0], r[1], 1 / tau)
    ref.backward()
    assert out.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    for got, want in zip(
        (x, x2, y), r
    ):  # relative to the whole gradient: float32 rounding is per-norm, not per-entry
        assert ((got.grad.double() - want.grad).norm() / want.grad.norm()).item() < 1e-5
    assert out.stats["image_image_loss"] == pytest.approx(ref_ntxent(*r[:2], 1 / tau).item(), rel=1e-5)
    assert out.stats["contrastive_loss"] == pytest.approx(clip.item(), rel=1e-5)
    assert out.stats["loss"] == pytest.approx(ref.item(), rel=1e-5)
    with pytest.raises(ValueError, match="image2"):
        objectives.loss(x, y, s, views=(w, tau))


def _sharded_worker(rank, world, in_path):
    data = torch.load(in_path)
    b = data["z1"].shape[0] // world
    results = {}
    for tile in (None, 3):
        z1, z2 = (data[k][rank * b : (rank + 1) * b].clone().requires_grad_() for k in ("z1", "z2"))
        loss = ntxent_loss(z1, z2, 10.0, tile_size=tile)
        loss.backward()
        results[tile] = (loss.detach(), z1.grad, z2.grad)
    return results


@pytest.mark.integration
def test_sharded_views_are_gathered_and_give_the_full_batch_gradient(gen, tmp_path):
    from tests.harness import run_ranks

    world, b = 2, 5
    z1, z2 = (
        F.normalize(torch.randn(world * b, 8, generator=gen, dtype=torch.float64), dim=1).float()
        for _ in range(2)
    )
    torch.save({"z1": z1, "z2": z2}, tmp_path / "in.pt")
    parts = run_ranks(_sharded_worker, world, str(tmp_path / "in.pt"), pooled=True)
    r1, r2 = (t.double().requires_grad_() for t in (z1, z2))
    ref = ref_ntxent(r1, r2, 10.0)
    ref.backward()
    for tile in (None, 3):
        # mean over ranks = the global loss; DeepSpeed's average of the gradients = the global gradient
        assert sum(p[tile][0].item() for p in parts) / world == pytest.approx(ref.item(), rel=1e-5)
        g1 = torch.cat([p[tile][1] for p in parts]) / world
        g2 = torch.cat([p[tile][2] for p in parts]) / world
        # float32 conditioning (see ntxent_grad_bound): an element's error is relative to the terms
        # it sums, not to itself (a per-element rtol failed about once in a few hundred seeds, e.g.
        # 507426779: 1.9e-7 off an element of 6e-3)
        for got, want, bound in zip((g1, g2), (r1.grad, r2.grad), ntxent_grad_bound(z1, z2, 10.0).chunk(2)):
            ratio = float(((got.double() - want).abs() / bound).max())
            assert ratio <= 1.0, f"worst error {ratio:.2f} x its float32 bound"


@pytest.mark.integration
def test_training_with_two_views_logs_a_falling_image_image_loss(micro_overrides):
    import json

    from mmalign.config import load_config
    from mmalign.run.train import train

    cfg = load_config(
        None,
        micro_overrides + ["data.views=2", "loss.image_image_weight=0.5", "train.grad_cache_chunk_size=12"],
    )
    out = train(cfg, show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 21))
    term = [r["image_image_loss"] for r in records]
    assert all(math.isfinite(v) for v in term)
    # the total is the contrastive loss + 0.5 x the NT-Xent (rank-averaged stats of one process)
    for r in records:
        assert r["loss"] == pytest.approx(r["contrastive_loss"] + 0.5 * r["image_image_loss"], rel=1e-5)
    assert sum(term[-5:]) / 5 < sum(term[:5]) / 5 - 0.1, term


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["loss.image_image_weight=0.5"], "loss.image_image_weight"),  # needs data.views: 2
        (["data.views=2", "loss.image_image_weight=-1"], "loss.image_image_weight"),
        (
            ["data.views=2", "loss.image_image_weight=1", "loss.image_image_temperature=0"],
            "loss.image_image_temperature",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    from mmalign.config import ConfigError, load_config

    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and "\n" not in str(err.value)
    assert (
        load_config(None, ["data.views=2", "loss.image_image_weight=0.5"]).loss.image_image_temperature == 0.1
    )
