"""Sharded losses: 2 gloo ranks on CPU must reproduce the full-batch gradient.

One spawn runs every case. Each rank holds its slice of a global batch, runs
the objective's contrastive term (gather-with-grad, local rows vs all candidates) and
backpropagates its own loss. The parent checks, against a float64
single-process reference on the full batch, that

* rank k's feature gradients divided by W (the data-parallel average) equal
  the full-batch gradient rows of slice k,
* the mean over ranks of the logit_scale / logit_bias gradients equals the
  full-batch one (no x W scale-gradient bug as in Inf-CL's ring),
* the mean over ranks of the losses and of the (rank-averaged) stats equal
  the full-batch values.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mmalign.dist import distributed as mdist
from tests.harness import objectives, run_ranks

pytestmark = pytest.mark.integration

WORLD = 2
B_LOCAL = 6  # global batch 12; tile 5 divides neither
CASES = [  # (name, loss, tile, with_ids)
    ("infonce", "infonce", 0, False),
    ("infonce_ids", "infonce", 0, True),
    ("siglip", "siglip", 0, False),
    ("siglip_ids", "siglip", 0, True),
    ("infonce_tiled", "infonce", 5, False),
    ("infonce_ids_tiled", "infonce", 5, True),
    ("siglip_tiled", "siglip", 5, False),
    ("hardneg", "infonce", 0, False),
    ("debias_ids", "infonce", 0, True),
    ("hardneg_debias_tiled", "infonce", 5, False),
    ("hardneg_debias_ids_tiled", "infonce", 5, True),
]
ESTIMATOR = {  # (hard_negative_beta, debias_prior) of the hardneg cases (Robinson / Chuang)
    "hardneg": (0.7, 0.0),
    "debias_ids": (0.0, 0.1),
    "hardneg_debias_tiled": (0.5, 0.1),
    "hardneg_debias_ids_tiled": (1.0, 0.2),
}


def _worker(rank: int, world: int, in_path: str) -> dict:
    assert (mdist.get_rank(), mdist.get_world_size()) == (rank, world) == (rank, WORLD)
    data = torch.load(in_path)
    sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    results = {}
    for name, loss_name, tile, with_ids in CASES:
        x = data["x"][sl].clone().requires_grad_()
        y = data["y"][sl].clone().requires_grad_()
        s = data["scale"].clone().requires_grad_()
        b = data["bias"].clone().requires_grad_()
        beta, prior = ESTIMATOR.get(name, (0.0, 0.0))
        out = objectives.loss(
            x,
            y,
            s,
            b if loss_name == "siglip" else None,
            name=loss_name,
            tile=tile,
            ids=data["ids"][sl] if with_ids else None,
            beta=beta,
            prior=prior,
        )
        out.loss.backward()
        results[name] = {
            "loss": out.loss.detach(),
            "dx": x.grad,
            "dy": y.grad,
            "ds": s.grad,
            "db": b.grad,
            "stats": out.stats,
        }
    return results


def close(got, want, what, tol=1e-5):
    """Relative error in norm (float32 result vs float64 reference); per-element
    relative error is meaningless for entries that cancel to ~0."""
    got, want = got.double().reshape(-1), want.double().reshape(-1)
    err = ((got - want).norm() / want.norm().clamp_min(1e-3)).item()
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def ref_infonce(x, y, s, ids):
    logits = s * x @ y.T  # explicit (N, N), float64
    pos = (ids[:, None] == ids[None, :]).double()
    target = pos / pos.sum(dim=1, keepdim=True)  # uniform over positives
    i2t = (torch.logsumexp(logits, 1) - (target * logits).sum(1)).mean()
    t2i = (torch.logsumexp(logits.T, 1) - (target * logits.T).sum(1)).mean()
    return (i2t + t2i) / 2


def ref_hardneg(x, y, s, ids, beta, prior):
    """Robinson et al. / Chuang et al. estimator (formulas in mmalign/losses/hardneg.py), float64."""
    logits = s * x @ y.T
    same = ids[:, None] == ids[None, :]

    def one(lg, pos):
        n_pos, neg = pos.sum(1), ~pos
        m = neg.sum(1)
        pos_sum = (lg.exp() * pos).sum(1)
        mean_pos = (lg * pos).sum(1) / n_pos
        imp = (beta * lg).exp() * neg
        w = imp / (imp.sum(1, keepdim=True) / m[:, None])
        ng = (w * lg.exp()).sum(1)
        if prior:
            ng = torch.maximum((ng - prior * m * pos_sum / n_pos) / (1 - prior), m * torch.exp(-s))
        return (torch.log(pos_sum + ng) - mean_pos).mean()

    return (one(logits, same) + one(logits.T, same.T)) / 2


def ref_siglip(x, y, s, b, ids):
    logits = s * x @ y.T + b
    z = (ids[:, None] == ids[None, :]).double() * 2 - 1
    return -F.logsigmoid(z * logits).sum() / x.shape[0]


def test_sharded_gradients_equal_full_batch(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    n, d = WORLD * B_LOCAL, 16
    x = F.normalize(torch.randn(n, d, generator=g), dim=1)
    y = F.normalize(torch.randn(n, d, generator=g), dim=1)
    ids = torch.randint(0, 4, (n,), generator=g)
    ids[-1] = ids[0]  # a positive pair across the rank boundary, whatever the draw
    scale = torch.tensor([5.0 + 25.0 * torch.rand((), generator=g).item()])  # shape [1], as DeepSpeed needs
    bias = torch.tensor([-10.0 * torch.rand((), generator=g).item()])
    in_path = str(tmp_path / "inputs.pt")
    torch.save({"x": x, "y": y, "ids": ids, "scale": scale, "bias": bias}, in_path)

    ranks = run_ranks(_worker, WORLD, in_path, pooled=True)

    distinct = torch.arange(n)
    for name, loss_name, _tile, with_ids in CASES:
        case_ids = ids if with_ids else distinct
        leaves = [t.double().clone().requires_grad_() for t in (x, y, scale, bias)]
        if name in ESTIMATOR:
            ref = ref_hardneg(leaves[0], leaves[1], leaves[2], case_ids, *ESTIMATOR[name])
        elif loss_name == "infonce":
            ref = ref_infonce(leaves[0], leaves[1], leaves[2], case_ids)
        else:
            ref = ref_siglip(*leaves, case_ids)
        ref.backward()
        rx, ry, rs, rb = (t.grad for t in leaves)

        got_loss = sum(r[name]["loss"] for r in ranks) / WORLD
        close(got_loss.double(), ref.detach(), what=f"{name}: loss")
        for k, res in enumerate(ranks):
            sl = slice(k * B_LOCAL, (k + 1) * B_LOCAL)
            close(res[name]["dx"].double() / WORLD, rx[sl], what=f"{name}: rank {k} image grad")
            close(res[name]["dy"].double() / WORLD, ry[sl], what=f"{name}: rank {k} text grad")
        ds = sum(r[name]["ds"] for r in ranks) / WORLD
        close(ds.double(), rs, what=f"{name}: scale grad")
        if loss_name == "siglip":
            db = sum(r[name]["db"] for r in ranks) / WORLD
            close(db.double(), rb, what=f"{name}: bias grad")
        else:
            assert all(r[name]["db"] is None for r in ranks)

        # Stats are rank-averaged: both ranks report the full-batch values.
        beta, prior = ESTIMATOR.get(name, (0.0, 0.0))
        full = objectives.loss(
            x,
            y,
            scale,
            bias if loss_name == "siglip" else None,
            name=loss_name,
            ids=ids if with_ids else None,
            beta=beta,
            prior=prior,
        ).stats
        for key in ("pos_rank", "top1", "hardest_neg_prob", "loss_floor", "n_candidates", "loss"):
            for r in ranks:
                assert r[name]["stats"][key] == pytest.approx(full[key], rel=1e-5, abs=1e-6), (name, key)
