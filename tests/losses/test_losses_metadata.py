"""Metadata positives: the (B, B) positive mask (attribute-subset captions) and
the shapes generator's subset caption mode.

Loss checks compare against float64 references written from the definition:
row i's target is uniform over its positives ``mask[i]`` (image->text) and
``mask[:, j]`` (text->image).
"""

from __future__ import annotations

import json
import tarfile

import pytest
import torch

from mmalign.losses import clip_loss
from mmalign.losses.metadata import encode_subset_code, subset_mask
from tests.harness import (
    objectives,
    unit,  # noqa: F401  (the `gen` fixture lives there too)
)


def rel_err(got, ref):
    got, ref = got.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    return ((got - ref).norm() / max(ref.norm().item(), 1e-3)).item()


def random_codes(gen, b, k=3, values=3):
    vals = torch.randint(0, values, (b, k), generator=gen)
    ment = torch.rand(b, k, generator=gen) < 0.5
    codes = [encode_subset_code(vals[i].tolist(), ment[i].tolist()) for i in range(b)]
    return torch.tensor(codes), vals, ment


def test_subset_mask_matches_attribute_rule(gen):
    codes, vals, ment = random_codes(gen, 12)
    mask = subset_mask(codes)
    for i in range(12):
        for j in range(12):
            want = all(vals[i, k] == vals[j, k] for k in range(3) if ment[j, k])
            assert bool(mask[i, j]) == want
    assert mask.diagonal().all()
    with pytest.raises(ValueError):
        subset_mask(torch.tensor([1, 2, 3]))  # not subset codes


def ref_mask_loss(x, y, s, mask):
    logits = s * x @ y.T
    w = mask.double()
    i2t = (torch.logsumexp(logits, 1) - (w * logits).sum(1) / w.sum(1)).mean()
    t2i = (torch.logsumexp(logits.T, 1) - (w.T * logits.T).sum(1) / w.T.sum(1)).mean()
    return (i2t + t2i) / 2


@pytest.mark.parametrize("tile", [None, 5])
def test_mask_loss_matches_reference(gen, tile):
    b = 11
    codes, _, _ = random_codes(gen, b)
    mask = subset_mask(codes)
    assert not torch.equal(mask, mask.T) or True  # asymmetric in general; both directions are checked
    x, y, s = unit(gen, b, 8), unit(gen, b, 8), torch.tensor([9.0])
    leaves = [t.clone().requires_grad_() for t in (x, y, s)]
    got = clip_loss(*leaves, positive_mask=mask, tile_size=tile)
    got.backward()
    refs = [t.double().clone().requires_grad_() for t in (x, y, s)]
    ref = ref_mask_loss(refs[0], refs[1], refs[2].reshape(()), mask)
    ref.backward()
    assert rel_err(got, ref) < 1e-5
    for g, r in zip((t.grad for t in leaves), (t.grad for t in refs)):
        assert rel_err(g, r) < 1e-5


def test_equivalence_mask_equals_ids(gen):
    b = 10
    ids = torch.randint(0, 3, (b,), generator=gen)
    x, y, s = unit(gen, b, 8), unit(gen, b, 8), torch.tensor(6.0)
    by_ids = clip_loss(x, y, s, positive_ids=ids)
    by_mask = clip_loss(x, y, s, positive_mask=ids[:, None] == ids[None, :])
    assert torch.allclose(by_ids, by_mask, rtol=1e-6)
    plain = clip_loss(x, y, s)
    assert torch.allclose(plain, clip_loss(x, y, s, positive_mask=torch.eye(b, dtype=torch.bool)), rtol=1e-6)


@pytest.mark.parametrize("tile", [None, 4])
def test_mask_with_hard_negatives_and_debias(gen, tile):
    # Estimator of mmalign/losses/hardneg.py with mask positives, vs a float64 row-wise reference.
    b, beta, prior = 9, 0.5, 0.1
    codes, _, _ = random_codes(gen, b)
    mask = subset_mask(codes)
    x, y, s = unit(gen, b, 8), unit(gen, b, 8), torch.tensor(7.0)
    got = clip_loss(x, y, s, positive_mask=mask, tile_size=tile, hard_negative_beta=beta, debias_prior=prior)
    xd, yd, sd = x.double(), y.double(), s.double()
    lg = sd * xd @ yd.T

    def one(lgm, pm):
        out = []
        for i in range(lgm.shape[0]):
            p, n = lgm[i][pm[i]], lgm[i][~pm[i]]
            if n.numel() == 0:
                out.append(torch.logsumexp(p, 0) - p.mean())
                continue
            w = torch.exp(beta * n) / torch.exp(beta * n).mean()
            ng = (w * n.exp()).sum()
            ng = torch.maximum(
                (ng - prior * n.numel() * p.exp().mean()) / (1 - prior), n.numel() * torch.exp(-sd)
            )
            out.append(torch.log(p.exp().sum() + ng) - p.mean())
        return torch.stack(out).mean()

    ref = (one(lg, mask) + one(lg.T, mask.T)) / 2
    assert rel_err(got, ref) < 1e-5


def test_module_and_checks(gen):
    b = 6
    codes, _, _ = random_codes(gen, b)
    mask = subset_mask(codes)
    x, y, s = unit(gen, b, 8), unit(gen, b, 8), torch.tensor(5.0)
    out = objectives.loss(x, y, s, mask=mask)
    assert torch.allclose(out.loss, clip_loss(x, y, s, positive_mask=mask))
    bad = mask.clone()
    bad[0, 0] = False
    with pytest.raises(ValueError):
        clip_loss(x, y, s, positive_mask=bad)
    with pytest.raises(ValueError):
        objectives.loss(x, y, s, torch.tensor(-10.0), name="siglip", mask=mask)


def test_config_keys():
    from mmalign.config import ConfigError, load_config

    cfg = load_config(None, ["loss.positive_mask=attribute_subset", "data.id_field=subset_code"])
    assert cfg.loss.positive_mask == "attribute_subset"
    with pytest.raises(ConfigError, match="loss.positive_mask"):
        load_config(None, ["loss.positive_mask=attribute_subset"])  # no id field for the codes
    with pytest.raises(ConfigError, match="loss.positive_mask"):
        load_config(None, ["loss.positive_mask=maybe"])


def test_shapes_subset_mode(tmp_path):
    from data_pipelines import shapes

    shapes.generate_split(tmp_path, "train", 40, seed=5, per_shard=40, caption_mode="subset")
    metas, caps = {}, {}
    for tar in sorted((tmp_path / "train").glob("*.tar")):
        with tarfile.open(tar) as tf:
            for m in tf.getmembers():
                key, ext = m.name.rsplit(".", 1)
                if ext == "json":
                    metas[key] = json.loads(tf.extractfile(m).read())
                elif ext == "txt":
                    caps[key] = tf.extractfile(m).read().decode()
    keys = sorted(metas)
    assert len(keys) == 40
    sizes = set()
    for k in keys:
        meta, cap = metas[k], caps[k]
        assert "\n" not in cap and 1 <= len(meta["mentioned"]) <= 5
        sizes.add(len(meta["mentioned"]))
        for name in ("size", "colour", "shape", "background"):  # mentioned values appear, others do not
            assert (meta[name] in cap.split()) == (name in meta["mentioned"]), (cap, meta)
    assert len(sizes) > 1
    codes = torch.tensor([metas[k]["subset_code"] for k in keys])
    mask = subset_mask(codes)
    for i, ki in enumerate(keys):  # image i is a positive of caption j iff it has every mentioned attribute
        for j, kj in enumerate(keys):
            want = all(metas[ki][a] == metas[kj][a] for a in metas[kj]["mentioned"])
            assert bool(mask[i, j]) == want
    assert mask.sum() > 40  # captions describe several images
    # the default mode is unchanged: two captions, no subset fields
    shapes.generate_split(tmp_path / "full", "train", 3, seed=5, per_shard=3)
    with tarfile.open(next((tmp_path / "full" / "train").glob("*.tar"))) as tf:
        meta = json.loads(tf.extractfile(next(m for m in tf.getmembers() if m.name.endswith(".json"))).read())
    assert "subset_code" not in meta


def test_training_with_attribute_subset_mask(tmp_path, micro_overrides):
    from data_pipelines import shapes
    from mmalign.config import load_config
    from mmalign.run.train import train

    shapes.generate_split(tmp_path / "sub", "train", 64, seed=2, per_shard=64, caption_mode="subset")
    overrides = [o for o in micro_overrides if not o.startswith("data.train=")] + [
        f"data.train={tmp_path}/sub/train/00000.tar",
        "loss.positive_mask=attribute_subset",
        "data.id_field=subset_code",
        "train.steps=2",
        f"output={tmp_path}/run",
    ]
    cfg = load_config(None, overrides)
    out = train(cfg, show_progress=False)
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rec and all(r["loss"] == r["loss"] for r in rec)  # finite, ran
