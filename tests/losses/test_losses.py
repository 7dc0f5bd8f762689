"""Spec tests for mmalign.losses (single process).

Every numeric check compares against an independent float64 reference
written with explicit loops over an explicit logit matrix, against open_clip,
or against the worked vectors of shared/REFERENCE.md. Inputs are drawn fresh
on every run; the seed is printed so a failure can be replayed.
"""

from __future__ import annotations

import hashlib
import math
import os

import pytest
import torch

from mmalign.dist import distributed as mdist
from mmalign.losses import caption_ids, clip_loss, siglip_loss
from mmalign.models.embeddings import Embeddings
from mmalign.objective import LossOutput, build_objective
from tests.harness import (
    objectives,
    unit,  # noqa: F401  (the `gen` fixture lives there too)
)

TOL = 1e-5  # relative, float32 vs float64 reference


# ----------------------------------------------------------------- helpers
def uniform(gen: torch.Generator, lo: float, hi: float) -> float:
    return lo + (hi - lo) * torch.rand((), generator=gen, dtype=torch.float64).item()


def dup_ids(gen: torch.Generator, b: int) -> torch.Tensor:
    """(b,) ids with real duplicates (about b/3 groups), shuffled."""
    ids = torch.randint(0, max(2, b // 3), (b,), generator=gen)
    ids[1] = ids[0]  # at least one duplicate pair, whatever the draw
    return ids


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 1e-3) -> float:
    got, ref = got.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    return ((got - ref).norm() / max(ref.norm().item(), floor)).item()


def assert_close_rel(got, ref, what: str, tol: float = TOL, floor: float = 1e-3) -> None:
    err = rel_err(got, ref, floor)
    assert err <= tol, f"{what}: relative error {err:.3g} > {tol:g}"


def lse(values: list[torch.Tensor]) -> torch.Tensor:
    m = max(v.item() for v in values)
    return m + torch.log(sum(torch.exp(v - m) for v in values))


def ref_infonce(x, y, s, ids=None) -> torch.Tensor:
    """Naive float64 symmetric InfoNCE with uniform multi-positive targets."""
    b = x.shape[0]
    ids = list(range(b)) if ids is None else ids.tolist()
    logits = s * x @ y.T  # explicit (B, B)
    total = 0.0
    for mat in (logits, logits.T):  # image->text rows, then text->image rows
        for i in range(b):
            row = [mat[i, j] for j in range(b)]
            pos = [row[j] for j in range(b) if ids[j] == ids[i]]
            total = total + (lse(row) - sum(pos) / len(pos)) / b
    return total / 2


def ref_siglip(x, y, s, bias, ids=None) -> torch.Tensor:
    b = x.shape[0]
    ids = list(range(b)) if ids is None else ids.tolist()
    total = 0.0
    for i in range(b):
        for j in range(b):
            z = 1.0 if ids[i] == ids[j] else -1.0
            logit = s * torch.dot(x[i], y[j]) + bias
            total = total + torch.log1p(torch.exp(-z * logit))  # -log sigmoid(z l)
    return total / b


def ref_grads(fn, x, y, *scalars):
    """Value and grads of a float64 reference at the float32 inputs."""
    leaves = [t.detach().double().clone().requires_grad_() for t in (x, y, *scalars)]
    val = fn(*leaves)
    return (val.detach(), *torch.autograd.grad(val, leaves))


def our_grads(fn, x, y, *scalars):
    leaves = [t.detach().clone().requires_grad_() for t in (x, y, *scalars)]
    val = fn(*leaves)
    return (val.detach(), *torch.autograd.grad(val, leaves))


def scalar_param(v: float, shape=()) -> torch.Tensor:
    return torch.full(shape, v, dtype=torch.float32)


# ------------------------------------------------ values and gradients
@pytest.mark.parametrize("tile", [None, 5])
@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("scale_shape", [(), (1,)])
def test_infonce_matches_naive_reference(gen, tile, with_ids, scale_shape):
    b, d = int(torch.randint(9, 20, (1,), generator=gen)), 16
    x, y = unit(gen, b, d), unit(gen, b, d)
    s = scalar_param(uniform(gen, 1.0, 50.0), scale_shape)
    ids = dup_ids(gen, b) if with_ids else None
    got = our_grads(lambda a, c, k: clip_loss(a, c, k, positive_ids=ids, tile_size=tile), x, y, s)
    ref = ref_grads(lambda a, c, k: ref_infonce(a, c, k, ids), x, y, s)
    for name, g, r in zip(["loss", "d_image", "d_text", "d_scale"], got, ref):
        assert_close_rel(g, r, name)
    assert got[3].shape == s.shape


@pytest.mark.parametrize("tile", [None, 4])
@pytest.mark.parametrize("with_ids", [False, True])
def test_siglip_matches_naive_reference(gen, tile, with_ids):
    b, d = int(torch.randint(9, 20, (1,), generator=gen)), 16
    x, y = unit(gen, b, d), unit(gen, b, d)
    s, bias = scalar_param(uniform(gen, 1.0, 20.0)), scalar_param(uniform(gen, -10.0, 0.0))
    ids = dup_ids(gen, b) if with_ids else None
    got = our_grads(
        lambda a, c, k, o: siglip_loss(a, c, k, o, positive_ids=ids, tile_size=tile), x, y, s, bias
    )
    ref = ref_grads(lambda a, c, k, o: ref_siglip(a, c, k, o, ids), x, y, s, bias)
    for name, g, r in zip(["loss", "d_image", "d_text", "d_scale", "d_bias"], got, ref):
        # d_scale / d_bias sum O(1) sigmoid terms of both signs that can cancel to ~1e-4;
        # float32 then leaves ~5e-8 absolute error, so measure them against the terms' scale (1)
        assert_close_rel(g, r, name, floor=1.0 if name in ("d_scale", "d_bias") else 1e-3)


def test_positive_ids_change_the_loss(gen):
    # Guard against ids being silently ignored.
    x, y = unit(gen, 12, 8), unit(gen, 12, 8)
    s = scalar_param(10.0)
    ids = dup_ids(gen, 12)
    assert not torch.allclose(clip_loss(x, y, s), clip_loss(x, y, s, positive_ids=ids))


# ---------------------------------------------------------- open_clip
@pytest.mark.parametrize("tile", [None, 7])
def test_matches_open_clip(gen, tile):
    from open_clip.loss import ClipLoss, SigLipLoss

    x, y = unit(gen, 24, 32), unit(gen, 24, 32)
    s = scalar_param(math.exp(uniform(gen, 0.0, math.log(100.0))))  # open_clip passes exp(logit_scale)
    bias = scalar_param(uniform(gen, -10.0, 0.0))
    got = our_grads(lambda a, c, k: clip_loss(a, c, k, tile_size=tile), x, y, s)
    ref = our_grads(lambda a, c, k: ClipLoss()(a, c, k), x, y, s)
    for name, g, r in zip(["clip loss", "d_image", "d_text", "d_scale"], got, ref):
        assert_close_rel(g, r, name)
    got = our_grads(lambda a, c, k, o: siglip_loss(a, c, k, o, tile_size=tile), x, y, s, bias)
    ref = our_grads(lambda a, c, k, o: SigLipLoss()(a, c, k, o), x, y, s, bias)
    for name, g, r in zip(["siglip loss", "d_image", "d_text", "d_scale", "d_bias"], got, ref):
        assert_close_rel(g, r, name)


# ------------------------------------------- REFERENCE.md worked vectors
def circulant_features(sims: list[float]):
    """x_i . y_j = sims[(j - i) mod n]: every row and every column holds the
    same similarities with the positive first, so the symmetric mean loss is
    the single-row loss. (Unnormalised y is fine: only x.y enters.)"""
    n = len(sims)
    c = torch.tensor([[sims[(j - i) % n] for j in range(n)] for i in range(n)])
    return torch.eye(n), c.T.contiguous()  # X = I, Y = C^T  =>  X Y^T = C


def row_probabilities(sims, tau, tile=None):
    """(loss, softmax probabilities of one row read off the gradient).

    With X = I, dL/dY = scale * G^T and G_ij = (q_(j-i) - 1[i=j]) / n."""
    x, y = circulant_features(sims)
    y.requires_grad_()
    s = scalar_param(1.0 / tau)
    loss = clip_loss(x, y, s, tile_size=tile)
    (gy,) = torch.autograd.grad(loss, [y])
    g = gy.T / s
    q = len(sims) * g[0].double()
    q[0] += 1.0
    return loss.item(), q


@pytest.mark.parametrize("tile", [None, 2])
def test_worked_vector_three_candidates(tile):
    loss, q = row_probabilities([0.8, 0.6, 0.1], 0.2, tile)
    assert loss == pytest.approx(0.3351, abs=5e-5)
    assert q.tolist() == pytest.approx([0.7153, 0.2631, 0.0216], abs=5e-5)


@pytest.mark.parametrize(
    "tau,loss,hard_p,hard_share,easy_share",
    [
        (0.01, 0.0000, 0.000, 1.000, 0.000),
        (0.05, 0.1359, 0.118, 0.930, 0.001),
        (0.07, 0.2546, 0.186, 0.827, 0.006),
        (0.10, 0.4325, 0.239, 0.680, 0.021),
        (1.00, 1.5617, 0.190, 0.240, 0.169),
    ],
)
def test_worked_vector_temperature_table(tau, loss, hard_p, hard_share, easy_share):
    sims = [0.65, 0.55, 0.40, 0.35, 0.30, 0.20]
    got_loss, q = row_probabilities(sims, tau, tile=4)
    neg_mass = q[1:].sum().item()
    assert got_loss == pytest.approx(loss, abs=5e-5)
    assert q[1].item() == pytest.approx(hard_p, abs=5e-4)
    assert q[1].item() / neg_mass == pytest.approx(hard_share, abs=5e-4)
    assert q[-1].item() / neg_mass == pytest.approx(easy_share, abs=5e-4)
    # The monitor reports the same hardest-negative probability.
    x, y = circulant_features(sims)
    for tile in (None, 4):
        stats = objectives.loss(x, y, scalar_param(1.0 / tau), tile=tile or 0).stats
        assert stats["hardest_neg_prob"] == pytest.approx(hard_p, abs=5e-4)


def test_worked_vector_positive_probability():
    _, q = row_probabilities([0.85, 0.15, 0.10, 0.05], 0.5)
    assert q[0].item() == pytest.approx(0.598, abs=5e-4)


@pytest.mark.parametrize("n,floor", [(8, 2.079), (256, 5.545)])
def test_loss_floor(gen, n, floor):
    # Indistinguishable candidates (all logits equal) score exactly log N.
    v = unit(gen, 1, 16).expand(n, 16).contiguous()
    out = objectives.loss(v, v, scalar_param(uniform(gen, 1.0, 100.0)))
    assert out.stats["loss_floor"] == pytest.approx(floor, abs=5e-4)
    assert out.loss.item() == pytest.approx(math.log(n), rel=TOL)  # float32: ulp(100) ~ 8e-6
    assert clip_loss(v, v, scalar_param(30.0), tile_size=3).item() == pytest.approx(math.log(n), rel=TOL)


# --------------------------------- multi-positive with distinct ids == plain
@pytest.mark.parametrize("tile", [None, 4])
def test_distinct_ids_equal_plain_exactly(gen, tile):
    b = 13
    x, y = unit(gen, b, 16), unit(gen, b, 16)
    s = scalar_param(uniform(gen, 1.0, 100.0))
    ids = torch.randperm(b, generator=gen) * 7919 - 50_000  # distinct, unordered, negative too
    plain = our_grads(lambda a, c, k: clip_loss(a, c, k, tile_size=tile), x, y, s)
    multi = our_grads(lambda a, c, k: clip_loss(a, c, k, positive_ids=ids, tile_size=tile), x, y, s)
    for name, p, m in zip(["loss", "d_image", "d_text", "d_scale"], plain, multi):
        assert torch.equal(p, m), name


def test_identical_duplicates_give_plain_infonce_gradients(gen):
    # REFERENCE.md: with token-identical captions (identical text embeddings),
    # plain InfoNCE and the multi-positive loss give the same gradient to the
    # image features and to the shared text embedding (summed over copies).
    b = 10
    x, y = unit(gen, b, 16), unit(gen, b, 16)
    y[3] = y[7]
    ids = torch.arange(b)
    ids[3] = ids[7]
    s = scalar_param(uniform(gen, 5.0, 30.0))
    plain = our_grads(lambda a, c, k: clip_loss(a, c, k), x, y, s)
    multi = our_grads(lambda a, c, k: clip_loss(a, c, k, positive_ids=ids), x, y, s)
    torch.testing.assert_close(plain[1], multi[1], rtol=1e-5, atol=1e-7)
    keep = [i for i in range(b) if i not in (3, 7)]
    torch.testing.assert_close(plain[2][keep], multi[2][keep], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(plain[2][3] + plain[2][7], multi[2][3] + multi[2][7], rtol=1e-5, atol=1e-7)
    # With identical text embeddings the value is unchanged as well: in every
    # positive group, mean_j s_ij = s_ii because all y_j in the group coincide.
    torch.testing.assert_close(plain[0], multi[0], rtol=1e-6, atol=0)


# ------------------------------------------------------ tiled == untiled
@pytest.mark.parametrize("tile", [1, 3, 8, 17, 40])
@pytest.mark.parametrize("with_ids", [False, True])
def test_tiled_equals_untiled_infonce(gen, tile, with_ids):
    b = 17  # not divisible by 3 or 8
    x, y = unit(gen, b, 24), unit(gen, b, 24)
    s = scalar_param(uniform(gen, 1.0, 100.0), (1,))
    ids = dup_ids(gen, b) if with_ids else None
    full = our_grads(lambda a, c, k: clip_loss(a, c, k, positive_ids=ids), x, y, s)
    tiled = our_grads(lambda a, c, k: clip_loss(a, c, k, positive_ids=ids, tile_size=tile), x, y, s)
    for name, f, t in zip(["loss", "d_image", "d_text", "d_scale"], full, tiled):
        assert_close_rel(t, f, name)


@pytest.mark.parametrize("tile", [1, 5, 17, 64])
@pytest.mark.parametrize("with_ids", [False, True])
def test_tiled_equals_untiled_siglip(gen, tile, with_ids):
    b = 17
    x, y = unit(gen, b, 24), unit(gen, b, 24)
    s, bias = scalar_param(uniform(gen, 1.0, 30.0), (1,)), scalar_param(uniform(gen, -12.0, 0.0), (1,))
    ids = dup_ids(gen, b) if with_ids else None
    full = our_grads(lambda a, c, k, o: siglip_loss(a, c, k, o, positive_ids=ids), x, y, s, bias)
    tiled = our_grads(
        lambda a, c, k, o: siglip_loss(a, c, k, o, positive_ids=ids, tile_size=tile), x, y, s, bias
    )
    for name, f, t in zip(["loss", "d_image", "d_text", "d_scale", "d_bias"], full, tiled):
        # scale / bias: sums of O(1) terms that can cancel (see test_siglip_matches_naive_reference)
        assert_close_rel(t, f, name, floor=1.0 if name in ("d_scale", "d_bias") else 1e-3)


def test_tiled_does_not_underflow_with_extreme_spread(gen):
    # Logits spread over ~+-2000: a constant shift would underflow whole tiles
    # (exp(-2000) == 0 in float64 too); the running max must not.
    b = 16
    x, y = unit(gen, b, 8), unit(gen, b, 8)
    s = scalar_param(2000.0)
    ref = ref_grads(lambda a, c, k: ref_infonce(a, c, k), x, y, s)
    got = our_grads(lambda a, c, k: clip_loss(a, c, k, tile_size=4), x, y, s)
    assert all(torch.isfinite(g).all() for g in got)
    assert_close_rel(got[0], ref[0], "loss", tol=1e-4)
    assert_close_rel(got[1], ref[1], "d_image", tol=1e-4)


def test_tiled_float64_is_tight(gen):
    x, y = unit(gen, 11, 8, torch.float64), unit(gen, 11, 8, torch.float64)
    s = torch.tensor(20.0, dtype=torch.float64)
    a = our_grads(lambda p, q, k: clip_loss(p, q, k, tile_size=3), x, y, s)
    r = ref_grads(lambda p, q, k: ref_infonce(p, q, k), x, y, s)
    for g, want in zip(a, r):
        assert rel_err(g, want) < 1e-12


# --------------------------------------------------------------- monitors
def naive_monitor_rows(logits: torch.Tensor, ids: list[int]):
    """Per-row (rank, top1, hardest-neg softmax prob, hardest-neg logit, margin)."""
    out = []
    n = logits.shape[1]
    for i in range(logits.shape[0]):
        row = [logits[i, j].item() for j in range(n)]
        pos = [row[j] for j in range(n) if ids[j] == ids[i]]
        neg = [row[j] for j in range(n) if ids[j] != ids[i]]
        best = max(pos)
        rank = 1 + sum(1 for v in neg if v > best)
        hard = max(neg)
        m = max(row)
        p_hard = math.exp(hard - m) / sum(math.exp(v - m) for v in row)
        margin = min(abs(v - best) for v in neg)
        out.append((rank, float(best > hard), p_hard, hard, margin))
    return out


def draw_until_no_near_ties(gen, b, d, s, ids_list):
    # float32 vs float64 may order a negative within ~1e-6 of the positive
    # differently; redraw such (rare) inputs instead of loosening the test.
    for _ in range(20):
        x, y = unit(gen, b, d), unit(gen, b, d)
        logits = s * x.double() @ y.double().T
        rows = naive_monitor_rows(logits, ids_list) + naive_monitor_rows(logits.T, ids_list)
        if min(r[4] for r in rows) > 1e-3:
            return x, y, logits
    pytest.fail("could not draw inputs without near ties")


@pytest.mark.parametrize("tile", [0, 4])
@pytest.mark.parametrize("with_ids", [False, True])
def test_infonce_monitors_match_naive(gen, tile, with_ids):
    b, d = 14, 8
    s = uniform(gen, 2.0, 20.0)
    ids = dup_ids(gen, b) if with_ids else torch.arange(b)
    x, y, logits = draw_until_no_near_ties(gen, b, d, s, ids.tolist())
    rows = naive_monitor_rows(logits, ids.tolist()) + naive_monitor_rows(logits.T, ids.tolist())
    out = objectives.loss(x, y, scalar_param(s), tile=tile, ids=ids if with_ids else None)
    assert isinstance(out, LossOutput)
    st = out.stats
    assert st["pos_rank"] == pytest.approx(sum(r[0] for r in rows) / len(rows), abs=1e-6)
    assert st["top1"] == pytest.approx(sum(r[1] for r in rows) / len(rows), abs=1e-6)
    assert st["hardest_neg_prob"] == pytest.approx(sum(r[2] for r in rows) / len(rows), rel=1e-5)
    assert st["loss_floor"] == pytest.approx(math.log(b), rel=1e-6)
    assert st["n_candidates"] == b
    assert st["logit_scale"] == pytest.approx(s, rel=1e-6)
    assert st["loss"] == pytest.approx(out.loss.item())


@pytest.mark.parametrize("tile", [0, 5])
@pytest.mark.parametrize("with_ids", [False, True])
def test_siglip_monitors_match_naive(gen, tile, with_ids):
    b, d = 13, 8
    s, bias = uniform(gen, 2.0, 20.0), uniform(gen, -10.0, 0.0)
    ids = dup_ids(gen, b) if with_ids else torch.arange(b)
    x, y, logits = draw_until_no_near_ties(gen, b, d, s, ids.tolist())
    rows = naive_monitor_rows(logits + bias, ids.tolist())
    out = objectives.loss(
        x, y, scalar_param(s), scalar_param(bias), name="siglip", tile=tile, ids=ids if with_ids else None
    )
    st = out.stats
    assert st["pos_rank"] == pytest.approx(sum(r[0] for r in rows) / b, abs=1e-6)
    assert st["top1"] == pytest.approx(sum(r[1] for r in rows) / b, abs=1e-6)
    sig_hard = sum(1 / (1 + math.exp(-r[3])) for r in rows) / b
    assert st["hardest_neg_prob"] == pytest.approx(sig_hard, rel=1e-5)
    # Best constant logit c: sigmoid(c) = 1/N.
    floor = -(math.log(1 / b) + (b - 1) * math.log(1 - 1 / b))
    assert st["loss_floor"] == pytest.approx(floor, rel=1e-6)
    assert st["logit_bias"] == pytest.approx(bias, rel=1e-6)


# ------------------------------------------------------------ caption ids
def test_caption_ids():
    ids = caption_ids(["A  dog on grass", "a dog on grass ", "a cat", "A\tDOG on\ngrass", "a cat."])
    assert ids.dtype == torch.int64 and ids.shape == (5,)
    assert ids[0] == ids[1] == ids[3]
    assert len({ids[0].item(), ids[2].item(), ids[4].item()}) == 3
    # Stable across processes: it is blake2b of the normalised text, not hash().
    want = int.from_bytes(hashlib.blake2b(b"a cat", digest_size=8).digest(), "little", signed=True)
    assert ids[2].item() == want
    assert caption_ids([]).shape == (0,)


def test_caption_ids_drive_positives(gen):
    caps = ["a red car", "A red  car", "a blue car", "a dog"]
    ids = caption_ids(caps)
    x, y = unit(gen, 4, 8), unit(gen, 4, 8)
    s = scalar_param(10.0)
    want = ref_infonce(x.double(), y.double(), torch.tensor(10.0, dtype=torch.float64), ids)
    assert clip_loss(x, y, s, positive_ids=ids).item() == pytest.approx(want.item(), rel=TOL)


# ----------------------------------------------------- module and config
def test_build_objective_from_config(gen):
    from mmalign.config import load_config
    from mmalign.data.batch import Batch
    from mmalign.objective import Contrastive

    (term,) = build_objective(load_config(None, [])).terms
    assert isinstance(term, Contrastive) and term.kind == "infonce" and term.tile_size == "auto"
    assert term.tile_budget_mb == 256.0
    assert build_objective(load_config(None, ["loss.tile_size=0"])).terms[0].tile_size is None
    obj = build_objective(
        load_config(
            None,
            [
                "loss.name=siglip",
                "model.init_logit_bias=-10",
                "loss.tile_size=64",
                "loss.false_negative_ids=caption",
            ],
        )
    )
    assert (
        obj.terms[0].kind == "siglip" and obj.terms[0].tile_size == 64 and obj.positives.ids_mode == "caption"
    )
    obj = build_objective(load_config(None, ["loss.false_negative_ids=class_id"]))
    assert obj.positives.ids_mode == "field" and obj.batch_fields == {"ids"}
    with pytest.raises(ValueError):
        Contrastive("triplet")
    x, y = unit(gen, 4, 8), unit(gen, 4, 8)
    batch = Batch(torch.zeros(4, 1), torch.zeros(4, 1, dtype=torch.long))
    with pytest.raises(ValueError):
        obj.loss_for(batch)(
            Embeddings(image=x, text=y, logit_scale=scalar_param(10.0))
        )  # ids required but missing


def test_module_loss_equals_function(gen):
    x, y = unit(gen, 9, 8), unit(gen, 9, 8)
    s, bias = scalar_param(12.0), scalar_param(-5.0)
    ids = dup_ids(gen, 9)
    out = objectives.loss(x, y, s, tile=4, ids=ids)
    assert out.loss.item() == pytest.approx(clip_loss(x, y, s, positive_ids=ids).item(), rel=1e-6)
    out = objectives.loss(x, y, s, bias, name="siglip")
    assert out.loss.item() == pytest.approx(siglip_loss(x, y, s, bias).item(), rel=1e-6)
    with pytest.raises(ValueError):
        objectives.loss(x, y, s, name="siglip")  # bias required


# --------------------------------------------------------------- distributed
def _run_fresh(code: str, env: dict | None = None) -> None:
    """Run ``code`` in a new interpreter: other tests (training runs) leave a process
    group initialised in this one, and these checks are about having none."""
    import subprocess
    import sys
    import textwrap

    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS")
    }
    full_env.update(env or {})
    res = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]


@pytest.mark.integration
def test_distributed_helpers_are_noops_without_group():
    _run_fresh("""
        import torch
        from mmalign.dist import distributed as mdist
        assert not mdist.is_initialized()
        assert mdist.get_rank() == 0 and mdist.get_world_size() == 1
        mdist.barrier()
        t = torch.randn(3, 2, requires_grad=True)
        assert mdist.all_gather_with_grad(t) is t
        assert torch.equal(mdist.all_gather_nograd(t), t)
        u = t.detach().clone()
        assert mdist.all_reduce_mean(u) is u and torch.equal(u, t.detach())
    """)


def test_env_parsing():
    info = mdist.env_dist_info(
        {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"}
    )
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.master_port) == (
        3,
        8,
        1,
        "10.0.0.1",
        "1234",
    )
    info = mdist.env_dist_info({"SLURM_PROCID": "5", "SLURM_NTASKS": "6", "SLURM_LOCALID": "2"})
    assert (info.rank, info.world_size, info.local_rank, info.master_addr, info.source) == (
        5,
        6,
        2,
        "127.0.0.1",
        "slurm",
    )
    assert mdist.env_dist_info({}).world_size == 1


@pytest.mark.integration
def test_init_from_env_is_noop_for_one_process():
    _run_fresh("""
        import os
        from mmalign.dist import distributed as mdist
        assert mdist.init_from_env().world_size == 1
        os.environ.update(RANK="0", WORLD_SIZE="1")
        assert mdist.init_from_env().world_size == 1
        assert not mdist.is_initialized()
    """)
