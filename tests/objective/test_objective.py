"""mmalign.objective: every pair of parts (terms and contrastive options) either composes, and
then its loss and gradients equal a naive float64 reference written here with explicit loops,
or is refused by exactly one rule, as one ConfigError line naming that rule's config key."""

from __future__ import annotations

import itertools

import pytest
import torch

from mmalign.config import ConfigError, load_config, validate
from mmalign.config.loss_rules import PARTS
from mmalign.data.batch import Batch
from mmalign.losses import caption_ids
from mmalign.losses.metadata import encode_subset_code
from mmalign.models import build_model
from mmalign.models.embeddings import Embeddings
from mmalign.objective import build_objective
from tests.harness import unit  # noqa: F401  (the `gen` fixture lives there too)
from tests.harness.distill_ref import naive_distill

B, K, Q = 6, 2, 5
BASE = ["model.preset=micro"]
BY_NAME = {p.name: p for p in PARTS}
POOL = ["a dog", "A  dog", "a cat", "a red car", "a cat ", "two birds"]  # equal after normalising: 0~1, 2~4


def _norm(caption: str) -> str:
    return " ".join(caption.split()).casefold()


def _inputs(gen, dim):
    captions = [POOL[int(i)] for i in torch.randint(0, len(POOL), (B,), generator=gen)]
    vals = torch.randint(0, 3, (B, 3), generator=gen)
    ment = torch.rand(B, 3, generator=gen) < 0.5
    codes = torch.tensor([encode_subset_code(vals[i].tolist(), ment[i].tolist()) for i in range(B)])
    neg_mask = torch.rand(B, K, generator=gen) < 0.6
    feats = {
        "image": unit(gen, B, dim),
        "text": unit(gen, B, dim),
        "image2": unit(gen, B, dim),
        "neg_text": unit(gen, B * K, dim).reshape(B, K, dim),
        "logit_scale": torch.tensor([3.0 + 7 * torch.rand(1, generator=gen).item()]),
        "logit_bias": torch.tensor([-2.0 * torch.rand(1, generator=gen).item()]),
    }
    queue_captions = [POOL[int(i)] for i in torch.randint(0, len(POOL), (Q,), generator=gen)]
    queue = (unit(gen, Q, dim), unit(gen, Q, dim), queue_captions)
    # a stored distillation teacher of another width, and its scale
    teacher = (unit(gen, B, dim + 3), unit(gen, B, dim + 3), 5.0 + 10 * torch.rand(1, generator=gen).item())
    return captions, codes, (vals, ment), neg_mask, feats, queue, teacher


def _ref_row(logits, is_pos, extra, s, beta, prior):
    """One anchor: multi-positive InfoNCE over its candidates + ``extra`` negative logits, with
    the hard-negative estimators (Robinson et al. 2021; Chuang et al. 2020) written out."""
    pos = [logits[j] for j in range(len(is_pos)) if is_pos[j]]
    neg = [logits[j] for j in range(len(is_pos)) if not is_pos[j]] + list(extra)
    sum_pos, mean_pos = sum(torch.exp(p) for p in pos), sum(pos) / len(pos)
    if not neg:
        return torch.log(sum_pos) - mean_pos
    m = len(neg)
    imp = [torch.exp(beta * l) for l in neg]
    ng = sum(w / (sum(imp) / m) * torch.exp(l) for w, l in zip(imp, neg))
    if prior > 0:
        ng = torch.maximum((ng - prior * m * sum_pos / len(pos)) / (1 - prior), m * torch.exp(-s))
    return torch.log(sum_pos + ng) - mean_pos


def _reference(on, cfg, captions, subsets, neg_mask, f, queue, teacher):
    x, y, s, bias = f["image"], f["text"], f["logit_scale"].reshape(()), f["logit_bias"].reshape(())
    same = [[_norm(captions[i]) == _norm(captions[j]) for j in range(B)] for i in range(B)]
    if "mask" in on:  # image i has every attribute caption j mentions
        vals, ment = subsets
        pos = [
            [all(not ment[j, k] or vals[i, k] == vals[j, k] for k in range(3)) for j in range(B)]
            for i in range(B)
        ]
    elif "ids" in on:
        pos = same
    else:
        pos = [[i == j for j in range(B)] for i in range(B)]
    if "siglip" in on:
        total = 0.0
        for i in range(B):
            for j in range(B):
                z = 1.0 if pos[i][j] else -1.0
                total = total - torch.nn.functional.logsigmoid(z * (s * x[i] @ y[j] + bias))
        loss = total / B
    else:
        beta, prior = cfg.loss.hard_negative_beta, cfg.loss.debias_prior
        i2t = t2i = 0.0
        for i in range(B):
            extra_i, extra_t = [], []
            if "queue" in on:
                qx, qy, qcap = queue
                keep = [k for k in range(Q) if "ids" not in on or _norm(qcap[k]) != _norm(captions[i])]
                extra_i += [s * x[i] @ qy[k] for k in keep]
                extra_t += [s * y[i] @ qx[k] for k in keep]
            if "mined" in on:
                extra_i += [s * x[i] @ f["neg_text"][i, m] for m in range(K) if neg_mask[i, m]]
            i2t = i2t + _ref_row([s * x[i] @ y[j] for j in range(B)], pos[i], extra_i, s, beta, prior)
            t2i = t2i + _ref_row(
                [s * y[i] @ x[j] for j in range(B)], [pos[j][i] for j in range(B)], extra_t, s, beta, prior
            )
        loss = 0.5 * (i2t / B + t2i / B)
    if "views" in on:  # + weight x NT-Xent of the two views at 1 / temperature
        z = torch.cat([x, f["image2"]])
        st, nt = 1.0 / cfg.loss.image_image_temperature, 0.0
        for a in range(2 * B):
            others = torch.stack([st * z[a] @ z[c] for c in range(2 * B) if c != a])
            nt = nt + torch.logsumexp(others, 0) - st * z[a] @ z[(a + B) % (2 * B)]
        loss = loss + cfg.loss.image_image_weight * nt / (2 * B)
    if "distill" in on:  # + weight x KL(teacher || student), both directions
        loss = loss + cfg.loss.distill.weight * naive_distill(x, y, s, *teacher)
    return loss


def _owner(a: str, b: str) -> str | None:
    owners = [p for p, o in ((a, b), (b, a)) if o in BY_NAME[p].refuses]
    assert len(owners) <= 1, f"both {a} and {b} claim the rule"
    return owners[0] if owners else None


@pytest.mark.parametrize("a, b", list(itertools.combinations([p.name for p in PARTS], 2)))
def test_every_pair_composes_or_is_refused_by_one_rule(gen, a, b):
    overrides = BASE + list(BY_NAME[a].example) + list(BY_NAME[b].example)
    owner = _owner(a, b)
    if owner is not None:
        with pytest.raises(ConfigError) as err:
            load_config(None, overrides)
        msg = str(err.value)
        assert "\n" not in msg and msg.startswith("config key") and BY_NAME[owner].keys[0] in msg, msg
        return
    cfg = load_config(None, overrides)
    model = build_model(cfg.model)
    objective = build_objective(cfg, 1, model=model)
    captions, codes, subsets, neg_mask, feats, queue, teacher = _inputs(gen, model.embed_dim)
    if objective.queue is not None:
        qids = caption_ids(queue[2]) if objective.queue.queue.with_ids else None
        objective.queue.queue.enqueue(queue[0], queue[1], qids)
    on = {a, b}
    need = objective.embeddings
    leaves = {k: v.clone().requires_grad_() for k, v in feats.items() if k in need}
    batch = Batch(
        torch.zeros(B, 1),
        torch.zeros(B, 1, dtype=torch.long),
        captions=captions,
        ids=codes,
        neg_mask=neg_mask,
        teacher_image=teacher[0],
        teacher_text=teacher[1],
        teacher_scale=torch.full((B, 1), teacher[2]),
    )
    out = objective.loss_for(objective.select(batch))(Embeddings(**leaves))
    out.loss.backward()
    refs = {k: v.double().clone().requires_grad_() for k, v in feats.items() if k in need}
    want = _reference(
        on,
        cfg,
        captions,
        subsets,
        neg_mask,
        {**{k: v.double() for k, v in feats.items()}, **refs},
        tuple(t.double() if torch.is_tensor(t) else t for t in queue),
        (teacher[0].double(), teacher[1].double(), torch.tensor(teacher[2], dtype=torch.float64)),
    )
    want.backward()
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-5), (a, b)
    for k in leaves:
        got, ref = leaves[k].grad.double(), refs[k].grad
        assert ((got - ref).norm() / ref.norm().clamp_min(1e-6)).item() < 1e-5, (a, b, k)
    assert out.stats["loss"] == pytest.approx(want.item(), rel=1e-5)


def test_one_process_rule_and_part_table():
    cfg = load_config(None, BASE + list(BY_NAME["mask"].example))
    with pytest.raises(ConfigError, match="config key 'loss.positive_mask' needs one process") as err:
        validate(cfg, world_size=2)
    assert "\n" not in str(err.value)
    # debias_prior alone names itself, not its sibling key
    with pytest.raises(ConfigError, match="'loss.debias_prior'") as err:
        load_config(None, BASE + ["loss.name=siglip", "model.init_logit_bias=-10", "loss.debias_prior=0.1"])
    assert "loss.hard_negative_beta" not in str(err.value)


def test_the_objective_feeds_the_model_only_what_its_terms_read():
    cfg = load_config(None, BASE + ["data.views=2"])  # a second view made, but no image-image term
    objective = build_objective(cfg)
    batch = Batch(
        torch.zeros(2, 1),
        torch.zeros(2, 1, dtype=torch.long),
        images2=torch.zeros(2, 1),
        neg_tokens=torch.zeros(2, 1, 1, dtype=torch.long),
    )
    assert set(objective.select(batch).model_inputs()) == {"images", "texts"}
    cfg = load_config(None, BASE + ["data.views=2", "loss.image_image_weight=0.5", "data.hard_negatives=1"])
    assert set(build_objective(cfg).select(batch).model_inputs()) == {
        "images",
        "texts",
        "images2",
        "neg_texts",
    }
