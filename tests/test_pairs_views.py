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
