"""mmalign.losses.distill: the KL distillation term against a naive float64 reference (explicit
loops over rows and candidates, tests/harness/distill_ref.py), against open_clip's own
DistillClipLoss (same gradient: its cross-entropy form differs by the teacher's entropy only),
and sharded over 2 gloo ranks: the ranks' mean loss and their feature / scale gradients equal
the full batch's, with the contrastive term beside it in one objective."""

from __future__ import annotations

import pytest
import torch

from mmalign.data.batch import Batch
from mmalign.dist import distributed as mdist
from mmalign.losses.distill import distill_kl, softmax_kl_rows
from mmalign.models.embeddings import Embeddings
from mmalign.objective import Contrastive, Objective
from mmalign.objective.distill import Distill, StoredTeacher
from tests.harness import naive_clip_loss, run_ranks, unit
from tests.harness.distill_ref import naive_distill, open_clip_distill

WORLD, B_LOCAL, D, D_T = 2, 5, 8, 12  # the teacher is wider than the student


def _inputs(gen, n):
    x, y = unit(gen, n, D, torch.float64), unit(gen, n, D, torch.float64)
    tx, ty = unit(gen, n, D_T, torch.float64), unit(gen, n, D_T, torch.float64)
    s = torch.tensor([3.0 + 20 * torch.rand(1, generator=gen).item()], dtype=torch.float64)
    ts = torch.tensor(10.0 + 40 * torch.rand(1, generator=gen).item(), dtype=torch.float64)
    return x, y, s, tx, ty, ts


def _rel(got, want):
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-12)).item()


def test_kernel_equals_the_naive_reference_in_float64_and_float32(gen):
    x, y, s, tx, ty, ts = _inputs(gen, 7)
    refs = [t.clone().requires_grad_() for t in (x, y, s)]
    want = naive_distill(*refs, tx, ty, ts)
    want.backward()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        leaves = [t.to(dtype).clone().requires_grad_() for t in (x, y, s)]
        got = distill_kl(*leaves, tx.to(dtype), ty.to(dtype), ts.to(dtype))
        got.backward()
        assert got.item() == pytest.approx(want.item(), rel=tol, abs=1e-7), dtype
        for leaf, ref in zip(leaves, refs):
            assert _rel(leaf.grad, ref.grad) < tol, dtype


def test_same_gradient_as_open_clip_and_zero_when_the_student_is_the_teacher(gen):
    x, y, s, tx, ty, ts = _inputs(gen, 6)
    ty = unit(gen, 6, D, torch.float64)
    tx = x.clone()  # a teacher of the student's width, for open_clip's own code
    ours = [t.clone().requires_grad_() for t in (x, y, s)]
    theirs = [t.clone().requires_grad_() for t in (x, y, s)]
    ce = open_clip_distill(*theirs, tx, ty, ts)
    kl = distill_kl(*ours, tx, ty, ts)
    ce.backward()
    kl.backward()
    for a, b in zip(ours, theirs):
        assert _rel(a.grad, b.grad) < 1e-10
    # the cross-entropy is the KL plus the teacher's entropy (a constant of the student)
    logits = ts * tx @ ty.T
    entropy = 0.5 * sum(
        -(torch.softmax(m, 1) * torch.log_softmax(m, 1)).sum(1).mean() for m in (logits, logits.T)
    )
    assert ce.item() == pytest.approx(kl.item() + entropy.item(), rel=1e-10)
    # the student equal to the teacher: no divergence, no gradient
    same = [t.clone().requires_grad_() for t in (tx, ty, ts.reshape(1))]
    zero = distill_kl(*same, tx, ty, ts)
    zero.backward()
    assert abs(zero.item()) < 1e-12 and all(t.grad.abs().max() < 1e-12 for t in same)


def test_row_kl_is_nonnegative_and_shift_invariant(gen):
    t, s = torch.randn(4, 9, generator=gen), torch.randn(4, 9, generator=gen)
    kl = softmax_kl_rows(t, s)
    assert (kl >= 0).all()
    assert torch.allclose(softmax_kl_rows(t + 3.0, s - 2.0), kl, atol=1e-6)


def _objective(weight: float, stats: bool = True) -> Objective:
    return Objective([Contrastive("infonce", 0), Distill(StoredTeacher(), weight)], compute_stats=stats)


def _batch(tx, ty, ts) -> Batch:
    b = tx.shape[0]
    return Batch(
        images=torch.empty(b, 0),
        tokens=torch.empty(b, 0, dtype=torch.long),
        teacher_image=tx,
        teacher_text=ty,
        teacher_scale=ts.reshape(1, 1).expand(b, 1).float(),
    )


def _worker(rank: int, world: int, path: str, weight: float) -> dict:
    data = torch.load(path)
    sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    x, y = data["x"][sl].float().clone().requires_grad_(), data["y"][sl].float().clone().requires_grad_()
    s = data["s"].float().clone().requires_grad_()
    batch = _batch(data["tx"][sl].float(), data["ty"][sl].float(), data["ts"])
    out = _objective(weight)(Embeddings(image=x, text=y, logit_scale=s), batch)
    out.loss.backward()
    assert mdist.get_world_size() == world
    return {"loss": out.loss.detach(), "dx": x.grad, "dy": y.grad, "ds": s.grad, "stats": out.stats}


def _full_reference(x, y, s, tx, ty, ts, weight):
    leaves = [t.clone().requires_grad_() for t in (x, y, s)]
    distill = naive_distill(*leaves, tx, ty, ts)
    total = naive_clip_loss(leaves[0], leaves[1], leaves[2].reshape(())) + weight * distill
    total.backward()
    return total, distill, [t.grad for t in leaves]


def test_one_rank_objective_equals_the_reference(gen):
    x, y, s, tx, ty, ts = _inputs(gen, 8)
    want, distill, grads = _full_reference(x, y, s, tx, ty, ts, 0.7)
    leaves = [t.float().clone().requires_grad_() for t in (x, y, s)]
    out = _objective(0.7)(
        Embeddings(image=leaves[0], text=leaves[1], logit_scale=leaves[2]), _batch(tx, ty, ts)
    )
    out.loss.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert out.stats["distill_loss"] == pytest.approx(distill.item(), rel=1e-5, abs=1e-6)
    assert out.stats["loss"] == pytest.approx(want.item(), rel=1e-5)
    for leaf, ref in zip(leaves, grads):
        assert _rel(leaf.grad, ref) < 1e-5


@pytest.mark.integration
def test_two_ranks_equal_the_full_batch_reference(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y, s, tx, ty, ts = _inputs(gen, WORLD * B_LOCAL)
    path = str(tmp_path / "in.pt")
    torch.save({"x": x, "y": y, "s": s, "tx": tx, "ty": ty, "ts": ts}, path)
    weight = 1.5
    ranks = run_ranks(_worker, WORLD, path, weight, pooled=True)
    want, distill, (gx, gy, gs) = _full_reference(x, y, s, tx, ty, ts, weight)
    # each rank's loss is its local rows' mean: their mean is the full batch's
    assert torch.stack([r["loss"] for r in ranks]).mean().item() == pytest.approx(want.item(), rel=1e-5)
    assert ranks[0]["stats"]["distill_loss"] == pytest.approx(distill.item(), rel=1e-5, abs=1e-6)
    # after the data-parallel average (/ W) a rank's feature gradients are its rows of the full one
    for r, part in enumerate(ranks):
        rows = slice(r * B_LOCAL, (r + 1) * B_LOCAL)
        assert _rel(part["dx"] / WORLD, gx[rows]) < 1e-5
        assert _rel(part["dy"] / WORLD, gy[rows]) < 1e-5
    assert _rel(torch.stack([r["ds"] for r in ranks]).mean(0), gs) < 1e-5
