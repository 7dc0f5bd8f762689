"""Mined hard negatives in the loss: per-image extra image->text candidates, against a naive
float64 reference with explicit loops (values and gradients), untiled, tiled, with ids."""

from __future__ import annotations

import pytest
import torch

from mmalign.losses import clip_loss
from tests.harness import objectives, unit


def ref_loss(x, y, n, mask, s, ids=None):
    """Symmetric InfoNCE where image row i also competes with its own valid mined negatives n[i, m]."""
    b, k = x.shape[0], n.shape[1]
    ids = list(range(b)) if ids is None else ids.tolist()
    i2t, t2i = 0.0, 0.0
    for i in range(b):
        row = [s * x[i] @ y[j] for j in range(b)] + [s * x[i] @ n[i, m] for m in range(k) if mask[i, m]]
        pos = [s * x[i] @ y[j] for j in range(b) if ids[j] == ids[i]]
        i2t = i2t + torch.logsumexp(torch.stack(row), 0) - sum(pos) / len(pos)
        col = [s * y[i] @ x[j] for j in range(b)]
        pos = [s * y[i] @ x[j] for j in range(b) if ids[j] == ids[i]]
        t2i = t2i + torch.logsumexp(torch.stack(col), 0) - sum(pos) / len(pos)
    return 0.5 * (i2t / b + t2i / b)


def _inputs(gen, b=7, k=3, d=6):
    x, y = unit(gen, b, d), unit(gen, b, d)
    n = unit(gen, b * k, d).reshape(b, k, d)
    mask = torch.rand(b, k, generator=gen) < 0.6
    mask[0] = False  # a row without any mined negative
    mask[1] = True  # a full row
    s = torch.tensor([4.0 + 10 * torch.rand(1, generator=gen).item()])
    return x, y, n, mask, s


@pytest.mark.parametrize("tile, with_ids", [(0, False), (3, False), (0, True), (3, True)])
def test_matches_naive_loop_values_and_gradients(gen, tile, with_ids):
    x, y, n, mask, s = _inputs(gen)
    ids = torch.randint(0, 4, (x.shape[0],), generator=gen) if with_ids else None
    leaves = [t.clone().requires_grad_() for t in (x, y, n, s)]
    out = objectives.loss(leaves[0], leaves[1], leaves[3], tile=tile, ids=ids, neg=leaves[2], neg_mask=mask)
    out.loss.backward()
    refs = [t.double().clone().requires_grad_() for t in (x, y, n, s)]
    want = ref_loss(refs[0], refs[1], refs[2], mask, refs[3][0], ids)
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    for got, ref in zip(leaves, refs):
        torch.testing.assert_close(got.grad.double(), ref.grad, rtol=1e-5, atol=1e-6)
    # the negatives of the empty row and the masked slots get no gradient at all
    assert leaves[2].grad[~mask].abs().max().item() == 0.0
    assert 0.0 < out.stats["mined_neg_prob"] < 1.0
    assert out.stats["mined_neg_valid"] == pytest.approx(mask.float().mean().item())


def test_mined_negatives_raise_the_loss_and_none_change_nothing(gen):
    x, y, n, mask, s = _inputs(gen)
    plain = clip_loss(x, y, s)
    none = objectives.loss(x, y, s, neg=n, neg_mask=torch.zeros_like(mask)).loss
    assert none.item() == plain.item()
    # a mined negative identical to the positive caption: the row's softmax gets a second copy
    hard = y[:, None, :].expand(-1, 2, -1).clone()
    got = objectives.loss(x, y, s, neg=hard, neg_mask=torch.ones(x.shape[0], 2, dtype=torch.bool)).loss
    p_pos = torch.softmax(s.double() * x.double() @ y.double().T, dim=1).diagonal()  # (B,)
    # each image row's LSE grows by log(1 + 2 p_ii); the text->image half is unchanged
    assert got.item() == pytest.approx(plain.item() + 0.5 * torch.log1p(2 * p_pos).mean().item(), rel=1e-5)


def test_refused_where_not_defined(gen):
    x, y, n, mask, s = _inputs(gen)
    # terms put together by hand (a config is refused earlier: mmalign.config.loss_rules)
    with pytest.raises(ValueError, match="infonce"):
        objectives.loss(x, y, s, torch.zeros(1), name="siglip", neg=n, neg_mask=mask)
    with pytest.raises(ValueError, match="plain infonce"):
        objectives.loss(x, y, s, beta=0.5, neg=n, neg_mask=mask)
    with pytest.raises(ValueError, match="neg_mask"):
        objectives.loss(x, y, s, neg=n, neg_mask=mask[:, :2])
