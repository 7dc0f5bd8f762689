"""MoCo momentum queue (He et al. 2020): FIFO order, the EMA update, the loss with
queued negatives against a naive float64 reference written with loops (values,
gradients, monitors; same-id entries excluded), config checks, checkpoint resume
of a real run, and 2 gloo ranks (sharded loss, identical queues, ZeRO 0/2/3 EMA).
"""

from __future__ import annotations

import collections
import copy
import json
import math
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from mmalign.config import ConfigError, load_config
from mmalign.data.batch import Batch
from mmalign.losses import QueueEntries, clip_loss, queue_clip_loss
from mmalign.models.embeddings import Embeddings
from mmalign.objective.queue import FeatureQueue, MomentumQueue
from tests.harness import engine_batch, engine_cfg, objectives, run_cli, run_ranks, unit  # noqa: F401  (the `gen` fixture lives there too)

TOL = 2e-5


def rel_err(got, ref, floor=1e-3):
    got, ref = got.detach().double().reshape(-1), ref.detach().double().reshape(-1)
    return ((got - ref).norm() / max(ref.norm().item(), floor)).item()


# ------------------------------------------------------------ naive references


def naive_rows(rows, cols, qcols, s, ids, qids, exclude=True):
    """Per anchor (float64 loops): its logits over batch + kept queue entries and its positives."""
    out = []
    for i in range(rows.shape[0]):
        logits, is_pos = [], []
        for j in range(cols.shape[0]):
            logits.append(s * torch.dot(rows[i], cols[j]))
            is_pos.append(bool(j == i) if ids is None else bool(ids[j] == ids[i]))
        for k in range(qcols.shape[0]):
            if exclude and ids is not None and bool(qids[k] == ids[i]):
                continue  # a queued entry with the anchor's id is not a negative
            logits.append(s * torch.dot(rows[i], qcols[k]))
            is_pos.append(False)
        out.append((logits, is_pos))
    return out


def naive_loss(x, y, s, qx, qy, ids=None, qids=None, exclude=True):
    """x, y (N, D) the global batch; qx, qy (Q, D) the queue; ids (N,) / qids (Q,) or None."""

    def direction(rows, cols, qcols):
        total = 0.0
        for logits, is_pos in naive_rows(rows, cols, qcols, s, ids, qids, exclude):
            pos = [l for l, p in zip(logits, is_pos) if p]
            total = total + torch.logsumexp(torch.stack(logits), 0) - sum(pos) / len(pos)
        return total / rows.shape[0]

    return (direction(x, y, qy) + direction(y, x, qx)) / 2


@torch.no_grad()
def naive_stats(x, y, s, qx, qy, ids=None, qids=None):
    """pos_rank, top1, hardest_neg_prob over both directions' rows."""
    ranks, top1, probs = [], [], []
    for rows, cols, qcols in ((x, y, qy), (y, x, qx)):
        for logits, is_pos in naive_rows(rows, cols, qcols, s, ids, qids):
            lse = torch.logsumexp(torch.stack(logits), 0)
            pos_max = max(l for l, p in zip(logits, is_pos) if p)
            negs = [l for l, p in zip(logits, is_pos) if not p]
            neg_max = max(negs)
            ranks.append(1 + sum(int(l > pos_max) for l in negs))
            top1.append(float(pos_max > neg_max))
            probs.append(torch.exp(neg_max - lse).item())
    return {
        "pos_rank": sum(ranks) / len(ranks),
        "top1": sum(top1) / len(top1),
        "hardest_neg_prob": sum(probs) / len(probs),
    }


def draw(gen, b=6, q=7, d=8, with_ids=True):
    """A batch, a queue and ids; queue entry 0 is a stale near-copy of pair 0 with pair 0's id,
    so excluding it visibly changes the loss."""
    x, y = unit(gen, b, d), unit(gen, b, d)
    # pair 0 is well aligned, so its stale near-copy is one of the largest logits of rows 0
    # (an unaligned pair's copy can hide under a random large logit at high scale)
    y[0] = F.normalize(x[0] + 0.3 * y[0], dim=0)
    qx, qy = unit(gen, q, d), unit(gen, q, d)
    qx[0] = F.normalize(x[0] + 0.1 * qx[0], dim=0)
    qy[0] = F.normalize(y[0] + 0.1 * qy[0], dim=0)
    scale = torch.tensor([2.0 + 18.0 * torch.rand((), generator=gen).item()])
    ids = qids = None
    if with_ids:
        ids = torch.randint(0, 3, (b,), generator=gen)
        ids[1] = ids[0]  # a multi-positive group in the batch
        qids = torch.randint(0, 5, (q,), generator=gen)
        qids[0] = ids[0]
    return x, y, scale, qx, qy, ids, qids


# ------------------------------------------------------------------ the queue


def test_fifo_order_wraparound_and_batches_larger_than_the_queue(gen):
    q = FeatureQueue(5, 3, with_ids=True)
    assert q.entries().size == 0 and q.ordered().size == 0
    ref = collections.deque(maxlen=5)  # naive FIFO: (id, image row, text row)
    next_id = 0
    for n in (2, 2, 2, 3, 7, 1, 5):  # fills, wraps, overshoots, lands exactly
        ids = torch.arange(next_id, next_id + n)
        next_id += n
        image, text = unit(gen, n, 3), unit(gen, n, 3)
        q.enqueue(image, text, ids)
        ref.extend(zip(ids.tolist(), image, text))
        got = q.ordered()
        assert got.ids.tolist() == [r[0] for r in ref]
        assert torch.equal(got.image, torch.stack([r[1] for r in ref]))
        assert torch.equal(got.text, torch.stack([r[2] for r in ref]))
        assert q.fill == len(ref)
        # the storage-order view holds exactly the live entries
        live = q.entries()
        order = live.ids.argsort()
        assert live.size == len(ref) and live.ids[order].tolist() == sorted(r[0] for r in ref)
        assert torch.equal(live.image[order], got.image[got.ids.argsort()])
    with pytest.raises(ValueError):
        q.enqueue(unit(gen, 2, 3), unit(gen, 2, 3))  # a queue with ids needs ids
    with pytest.raises(ValueError):
        FeatureQueue(4, 3, with_ids=False).enqueue(unit(gen, 2, 3), unit(gen, 2, 3), torch.arange(2))


def test_unfilled_slots_are_never_candidates(gen):
    x, y, s, qx, qy, ids, qids = draw(gen)
    q = FeatureQueue(10, 8, with_ids=True)
    q.image.fill_(float("nan"))  # unwritten slots: any use would poison the loss
    q.text.fill_(float("nan"))
    q.enqueue(qx[:3], qy[:3], qids[:3])
    got = queue_clip_loss(x, y, s, q.entries(), positive_ids=ids)
    ref = naive_loss(
        x.double(), y.double(), s.double().reshape(()), qx[:3].double(), qy[:3].double(), ids, qids[:3]
    )
    assert torch.isfinite(got) and rel_err(got, ref) < TOL


def test_state_dict_round_trip_is_exact(gen):
    a = FeatureQueue(6, 4, with_ids=True)
    for n in (4, 5):
        a.enqueue(unit(gen, n, 4), unit(gen, n, 4), torch.randint(0, 9, (n,), generator=gen))
    b = FeatureQueue(6, 4, with_ids=True)
    b.load_state_dict(a.state_dict())
    assert (b.ptr, b.fill) == (a.ptr, a.fill) == (3, 6)
    for t in ("image", "text", "ids"):
        assert torch.equal(getattr(b, t), getattr(a, t))
    with pytest.raises(ValueError):
        FeatureQueue(7, 4, with_ids=True).load_state_dict(a.state_dict())


class TinyTowers(nn.Module):
    """Two linear 'towers' with a BatchNorm (buffers) and dropout (train/eval differ)."""

    embed_dim = 4

    def __init__(self):
        super().__init__()
        self.visual = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
        self.text = nn.Linear(5, 4)
        self.logit_scale = nn.Parameter(torch.ones(1))

    def forward(self, images, tokens):
        return Embeddings(
            image=F.normalize(self.visual(images), dim=-1),
            text=F.normalize(self.text(tokens), dim=-1),
            logit_scale=self.logit_scale.exp(),
        )


def _perturb(model, gen):
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen))
        bn = model.visual[1]
        bn.running_mean.copy_(torch.randn(4, generator=gen))
        bn.running_var.copy_(torch.rand(4, generator=gen) + 0.5)
        bn.num_batches_tracked.fill_(7)


def test_ema_update_follows_the_formula_and_leaves_the_online_model_alone(gen):
    online = TinyTowers()
    mq = MomentumQueue(copy.deepcopy(online), size=8, momentum=0.9, with_ids=False)
    assert not mq.model.training and not any(p.requires_grad for p in mq.model.parameters())
    assert online.training and all(p.requires_grad for p in online.parameters())
    ema = {k: v.detach().double().clone() for k, v in online.named_parameters()}  # naive float64 EMA
    for _ in range(3):
        _perturb(online, gen)
        before = {k: v.detach().clone() for k, v in online.state_dict().items()}
        mq.update(dict(online.named_parameters()), dict(online.named_buffers()))
        for name, p in online.named_parameters():
            flat_ema, flat_on = ema[name].reshape(-1), p.detach().double().reshape(-1)
            ema[name] = torch.stack(
                [0.9 * flat_ema[i] + 0.1 * flat_on[i] for i in range(flat_ema.numel())]
            ).reshape(p.shape)
            got = dict(mq.model.named_parameters())[name]
            assert rel_err(got, ema[name]) < 1e-6, name
        for name, buf in online.named_buffers():
            assert torch.equal(dict(mq.model.named_buffers())[name], buf), name
        for k, v in online.state_dict().items():
            assert torch.equal(v, before[k]), f"online {k} changed"
    # m = 0: the EMA is the online model
    mq0 = MomentumQueue(TinyTowers(), size=8, momentum=0.0, with_ids=False)
    mq0.update(dict(online.named_parameters()))
    for name, p in online.named_parameters():
        assert torch.equal(dict(mq0.model.named_parameters())[name], p.detach())
    with pytest.raises(KeyError):
        mq.update({"visual.0.weight": online.visual[0].weight})


def test_push_encodes_with_the_ema_in_eval_mode_and_keeps_the_rng(gen):
    online = TinyTowers()
    mq = MomentumQueue(copy.deepcopy(online), size=5, momentum=0.5, with_ids=True)
    images, tokens = torch.randn(3, 6, generator=gen), torch.randn(3, 5, generator=gen)
    rng = torch.get_rng_state()
    mq.push(images, tokens, torch.tensor([4, 5, 6]), chunk=2)
    assert torch.equal(torch.get_rng_state(), rng)  # no dropout draw: the run's RNG stream is untouched
    ref = copy.deepcopy(mq.model).eval()
    with torch.no_grad():
        want = ref(images, tokens)
    got = mq.queue.ordered()
    torch.testing.assert_close(got.image, want.image, rtol=0, atol=1e-6)
    torch.testing.assert_close(got.text, want.text, rtol=0, atol=1e-6)
    assert got.ids.tolist() == [4, 5, 6] and mq.fill == 3
    state = mq.state_dict()
    other = MomentumQueue(TinyTowers(), size=5, momentum=0.5, with_ids=True)
    other.load_state_dict(state)
    for (k, a), (_, b) in zip(mq.model.state_dict().items(), other.model.state_dict().items()):
        assert torch.equal(a, b), k
    assert torch.equal(other.queue.ordered().image, got.image)


# ------------------------------------------------------------------- the loss


@pytest.mark.parametrize("tile", [None, 3])
@pytest.mark.parametrize("with_ids", [False, True])
@pytest.mark.parametrize("how", ["function", "module"])
def test_loss_matches_naive_reference(gen, tile, with_ids, how):
    x, y, s, qx, qy, ids, qids = draw(gen, with_ids=with_ids)
    leaves = [t.clone().requires_grad_() for t in (x, y, s)]
    queue = QueueEntries(qx, qy, qids)
    if how == "function":
        got = queue_clip_loss(*leaves, queue, positive_ids=ids, tile_size=tile)
    else:
        got = objectives.loss(*leaves, tile=tile or 0, ids=ids if with_ids else None, queue=queue).loss
    got.backward()
    refs = [t.double().clone().requires_grad_() for t in (x, y, s)]
    ref = naive_loss(refs[0], refs[1], refs[2].reshape(()), qx.double(), qy.double(), ids, qids)
    ref.backward()
    assert rel_err(got, ref) < TOL, (got.item(), ref.item())
    for g, r, what in zip((l.grad for l in leaves), (r.grad for r in refs), ("dx", "dy", "dscale")):
        assert torch.isfinite(g).all(), what
        assert rel_err(g, r) < TOL, (what, rel_err(g, r))
    # the queue is felt, and (with ids) the exclusion is: both references differ from the loss
    plain = clip_loss(x.double(), y.double(), s.double(), positive_ids=ids)
    assert rel_err(got, plain) > 100 * TOL
    if with_ids:
        unexcluded = naive_loss(
            x.double(), y.double(), s.double().reshape(()), qx.double(), qy.double(), ids, qids, exclude=False
        )
        assert rel_err(got, unexcluded) > 100 * TOL


@pytest.mark.parametrize("tile", [None, 2])
def test_rows_whose_every_queued_entry_is_excluded(gen, tile):
    x, y, s, qx, qy, ids, _ = draw(gen)
    qids = torch.full((qx.shape[0],), int(ids[0]))  # every entry shares pair 0's id
    leaves = [t.clone().requires_grad_() for t in (x, y, s)]
    got = queue_clip_loss(*leaves, QueueEntries(qx, qy, qids), positive_ids=ids, tile_size=tile)
    got.backward()
    refs = [t.double().clone().requires_grad_() for t in (x, y, s)]
    ref = naive_loss(refs[0], refs[1], refs[2].reshape(()), qx.double(), qy.double(), ids, qids)
    ref.backward()
    assert rel_err(got, ref) < TOL
    for g, r in zip((l.grad for l in leaves), (r.grad for r in refs)):
        assert torch.isfinite(g).all() and rel_err(g, r) < TOL


@pytest.mark.parametrize("tile", [0, 3])
@pytest.mark.parametrize("with_ids", [False, True])
def test_monitors_cover_batch_and_queue(gen, tile, with_ids):
    x, y, s, qx, qy, ids, qids = draw(gen, with_ids=with_ids)
    stats = objectives.loss(
        x, y, s, tile=tile, ids=ids if with_ids else None, queue=QueueEntries(qx, qy, qids)
    ).stats
    want = naive_stats(x.double(), y.double(), s.double().reshape(()), qx.double(), qy.double(), ids, qids)
    for key, value in want.items():
        assert stats[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert stats["n_candidates"] == 6 + 7 and stats["loss_floor"] == pytest.approx(math.log(13))


@pytest.mark.parametrize("tile", [0, 3])
def test_no_queue_or_an_empty_one_is_the_plain_loss(gen, tile):
    x, y, s, *_ = draw(gen, with_ids=False)
    outs, grads = [], []
    for queue in (None, QueueEntries(x[:0], y[:0])):
        leaves = [t.clone().requires_grad_() for t in (x, y, s)]
        out = objectives.loss(*leaves, tile=tile, queue=queue)
        out.loss.backward()
        outs.append(out)
        grads.append([l.grad for l in leaves])
    assert torch.equal(outs[0].loss, outs[1].loss) and outs[0].stats == outs[1].stats
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_bad_combinations_are_refused(gen):
    x, y, s, qx, qy, ids, qids = draw(gen)
    queue = QueueEntries(qx, qy, qids)
    # terms put together by hand (a config is refused earlier: mmalign.config.loss_rules)
    with pytest.raises(ValueError, match="infonce"):
        objectives.loss(x, y, s, torch.tensor([-10.0]), name="siglip", queue=queue)
    with pytest.raises(ValueError, match="infonce"):
        objectives.loss(x, y, s, beta=0.5, queue=queue)
    with pytest.raises(ValueError, match="ids"):
        objectives.loss(x, y, s, ids=ids, queue=QueueEntries(qx, qy))
    with pytest.raises(ValueError, match="queue entries"):
        queue_clip_loss(x, y, s, QueueEntries(qx[:, :4], qy[:, :4]))


# ----------------------------------------------------------------- the config


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["loss.queue_size=-1"], "loss.queue_size"),
        (["loss.momentum=1.0"], "loss.momentum"),
        (["loss.momentum=-0.1"], "loss.momentum"),
        (["loss.queue_size=64", "loss.name=siglip", "model.init_logit_bias=-10"], "loss.queue_size"),
        (["loss.queue_size=64", "loss.hard_negative_beta=0.5"], "loss.queue_size"),
        (["loss.queue_size=64", "loss.debias_prior=0.1"], "loss.queue_size"),
        (
            ["loss.queue_size=64", "loss.positive_mask=attribute_subset", "data.id_field=subset_code"],
            "loss.queue_size",
        ),
    ],
)
def test_config_errors_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert key in str(err.value) and "\n" not in str(err.value)


def test_config_defaults_and_cli_exit_2(tmp_path):
    cfg = load_config(
        None,
        [
            "loss.queue_size=4096",
            "loss.momentum=0.99",
            "loss.tile_size=512",
            "loss.false_negative_ids=caption",
            "deepspeed.zero_stage=3",
        ],
    )
    assert (cfg.loss.queue_size, cfg.loss.momentum) == (4096, 0.99)
    assert load_config().loss.queue_size == 0  # off by default
    res = run_cli(
        "train",
        "--set",
        "loss.queue_size=8",
        "--set",
        "loss.name=siglip",
        "--set",
        "model.init_logit_bias=-10",
        "--output",
        str(tmp_path / "x"),
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and "loss.queue_size" in lines[0], res.stderr[-2000:]


# --------------------------------------------------------- a real run, resumed


def _metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.integration
def test_resume_with_a_queue_equals_the_straight_run(micro_overrides, tmp_path):
    from mmalign.run.train import train

    ov = [o for o in micro_overrides if not o.startswith("output=")] + [
        "train.steps=6",
        "train.checkpoint_every=3",
        "monitor.probe_size=0",
        "loss.queue_size=80",
        "loss.momentum=0.9",
        "loss.false_negative_ids=caption",
    ]
    straight = train(load_config(None, ov + [f"output={tmp_path / 'straight'}"]), show_progress=False)
    records = _metrics(straight)
    # global batch 32, queue 80: 32, 64, then 80 entries after steps 1, 2, 3; the loss sees the earlier ones
    assert [r["queue_fill"] for r in records] == [32, 64, 80, 80, 80, 80]
    assert [r["n_candidates"] for r in records] == [32, 64, 96, 112, 112, 112]

    # resume from the step-3 checkpoint in a fresh directory; everything after it must match
    resumed_dir = tmp_path / "resumed"
    ckpt = resumed_dir / "checkpoints" / "step_00000003"
    shutil.copytree(straight / "checkpoints" / "step_00000003", ckpt)
    resumed = train(load_config(None, ov + [f"output={resumed_dir}"]), show_progress=False, resume=str(ckpt))
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    for ra, rb in zip(records[3:], _metrics(resumed)):
        assert ra["step"] == rb["step"] and ra["n_candidates"] == rb["n_candidates"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-6), ra["step"]
    qa = torch.load(straight / "checkpoints" / "step_00000006" / "momentum.pt", weights_only=True)
    qb = torch.load(resumed / "checkpoints" / "step_00000006" / "momentum.pt", weights_only=True)
    assert (qa["queue"]["ptr"], qa["queue"]["fill"]) == (qb["queue"]["ptr"], qb["queue"]["fill"]) == (32, 80)
    for key in ("image", "text", "ids"):
        torch.testing.assert_close(qb["queue"][key], qa["queue"][key], rtol=0, atol=1e-6, msg=key)
    for k in qa["model"]:
        torch.testing.assert_close(qb["model"][k], qa["model"][k], rtol=0, atol=1e-6, msg=k)
    # the EMA trails the trained weights (m = 0.9 over 6 steps), it is not a copy of them
    moved = [k for k in a if k in qa["model"] and not torch.allclose(qa["model"][k], a[k], atol=1e-6)]
    assert len(moved) > len(a) // 2

    # a checkpoint without the queue cannot resume a run with one (one-line ConfigError)
    (ckpt / "momentum.pt").unlink()
    with pytest.raises(ConfigError, match="loss.queue_size"):
        train(load_config(None, ov + [f"output={resumed_dir}"]), show_progress=False, resume=str(ckpt))


def test_gradient_caching_with_a_queue_equals_one_pass(micro_overrides, tmp_path):
    """The queue is a constant inside the cached step: chunked == one pass (SGD, which would
    show any gradient scale error), steps 2-3 with a filled queue."""
    from mmalign.run.train import train

    ov = [o for o in micro_overrides if not o.startswith("output=")] + [
        "train.steps=3",
        "train.optimizer=sgd",
        "train.warmup_steps=0",
        "monitor.probe_size=0",
        "loss.queue_size=40",
        "train.checkpoint_every=3",
    ]
    outs = [
        train(
            load_config(None, ov + [f"output={tmp_path / name}", f"train.grad_cache_chunk_size={chunk}"]),
            show_progress=False,
        )
        for name, chunk in (("one", 0), ("cached", 10))
    ]
    a, b = (load_file(str(o / "final" / "model.safetensors")) for o in outs)
    for k in a:
        assert rel_err(b[k], a[k], floor=1e-12) <= 1e-5, k
    qa, qb = (
        torch.load(o / "checkpoints" / "step_00000003" / "momentum.pt", weights_only=True) for o in outs
    )
    torch.testing.assert_close(qb["queue"]["image"], qa["queue"]["image"], rtol=0, atol=1e-5)
    assert [r["n_candidates"] for r in _metrics(outs[1])] == [32, 64, 72]


@pytest.mark.integration
@pytest.mark.slow  # make test-all: one-rank resume with a queue above, 2-rank queues + ZeRO below
def test_two_process_run_zero3_cached_resumes_exactly(micro_overrides, tmp_path):
    """The whole loop on 2 ranks (ZeRO-3, gradient caching, caption ids): resuming from the
    step-2 checkpoint reaches the straight run's weights and queue."""
    ov = [o for o in micro_overrides if not o.startswith("output=")] + [
        "train.steps=4",
        "train.warmup_steps=1",
        "train.checkpoint_every=2",
        "monitor.probe_size=0",
        "loss.queue_size=48",
        "loss.false_negative_ids=caption",
        "deepspeed.zero_stage=3",
        "train.grad_cache_chunk_size=6",
    ]

    def cli(out, *extra):
        args = ["train", "--nproc", "2", "--output", str(out), *extra]
        for o in ov:
            args += ["--set", o]
        res = run_cli(*args)
        assert res.returncode == 0, res.stderr[-3000:]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    cli(straight)
    assert [r["n_candidates"] for r in _metrics(straight)] == [32, 64, 80, 80]
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    cli(resumed, "--resume", str(resumed / "checkpoints" / "step_00000002"))
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    qa, qb = (
        torch.load(o / "checkpoints" / "step_00000004" / "momentum.pt", weights_only=True)
        for o in (straight, resumed)
    )
    for key in ("image", "text", "ids"):
        torch.testing.assert_close(qb["queue"][key], qa["queue"][key], rtol=0, atol=1e-6, msg=key)


# ------------------------------------------------------------------ two ranks

WORLD, B_LOCAL, Q = 2, 5, 7
SHARDED_CASES = [("paired", 0, False), ("ids", 0, True), ("ids_tiled", 3, True)]  # (name, tile, with_ids)


def _rank_worker(rank, world, in_path):
    from mmalign.models import build_model
    from mmalign.run.engine import Engine

    data = torch.load(in_path)
    sl = slice(rank * B_LOCAL, (rank + 1) * B_LOCAL)
    results = {}

    # 1. the sharded loss with a queue: local rows vs gathered batch + the (shared) queue
    for name, tile, with_ids in SHARDED_CASES:
        x = data["x"][sl].clone().requires_grad_()
        y = data["y"][sl].clone().requires_grad_()
        s = data["scale"].clone().requires_grad_()
        queue = QueueEntries(data["qx"], data["qy"], data["qids"] if with_ids else None)
        out = objectives.loss(x, y, s, tile=tile, ids=data["ids"][sl] if with_ids else None, queue=queue)
        out.loss.backward()
        results[name] = {
            "loss": out.loss.detach(),
            "dx": x.grad,
            "dy": y.grad,
            "ds": s.grad,
            "stats": out.stats,
        }

    # 2. the momentum queue under the engine, ZeRO 0 / 2 / 3: EMA of the full weights,
    #    each rank pushes its local batch, the queues come out identical
    for stage in (0, 2, 3):
        cfg = engine_cfg(stage, "loss.queue_size=12", "loss.momentum=0.8", "loss.false_negative_ids=caption")
        torch.manual_seed(data["seed"])
        model = build_model(cfg.model)
        mq = MomentumQueue(copy.deepcopy(model), 12, 0.8, with_ids=True)
        init = {k: v.detach().clone() for k, v in mq.model.named_parameters()}
        engine = Engine(model, cfg)
        record = []
        for step in range(2):
            images, tokens = engine_batch(data["seed"] + step, rank, world)
            ids = torch.arange(rank * 4, rank * 4 + 4) % 5  # repeats across ranks and steps
            batch = Batch(images, tokens)
            engine.step(batch, objectives.objective(ids=ids, queue=mq.entries()))
            mq.update(engine.full_params(), dict(engine.module.named_buffers()))
            mq.push(images, tokens, ids)
            master = engine.consolidated_state_dict()  # the fp32 master weights (a collective)
            record.append(
                {
                    "master": master,
                    "ema": {k: v.detach().cpu().clone() for k, v in mq.model.named_parameters()},
                }
            )
        results[f"zero{stage}"] = {"init": init, "steps": record, "queue": mq.queue.state_dict()}
    return results


@pytest.mark.integration
def test_two_ranks_sharded_loss_identical_queues_and_zero_stages(tmp_path, seed):
    g = torch.Generator().manual_seed(seed)
    n = WORLD * B_LOCAL
    x, y, qx, qy = unit(g, n, 8), unit(g, n, 8), unit(g, Q, 8), unit(g, Q, 8)
    qx[0], qy[0] = F.normalize(x[-1] + 0.1 * qx[0], dim=0), F.normalize(y[-1] + 0.1 * qy[0], dim=0)
    ids = torch.randint(0, 4, (n,), generator=g)
    ids[-1] = ids[0]  # a positive pair across the rank boundary
    qids = torch.randint(0, 6, (Q,), generator=g)
    qids[0] = ids[-1]  # an excluded entry for rows on both ranks
    scale = torch.tensor([2.0 + 18.0 * torch.rand((), generator=g).item()])
    in_path = tmp_path / "inputs.pt"
    torch.save(
        {"x": x, "y": y, "qx": qx, "qy": qy, "ids": ids, "qids": qids, "scale": scale, "seed": seed % 10**6},
        in_path,
    )
    ranks = run_ranks(_rank_worker, WORLD, str(in_path), pooled=True)

    for name, _tile, with_ids in SHARDED_CASES:
        case_ids, case_qids = (ids, qids) if with_ids else (None, None)
        leaves = [t.double().clone().requires_grad_() for t in (x, y, scale)]
        ref = naive_loss(
            leaves[0], leaves[1], leaves[2].reshape(()), qx.double(), qy.double(), case_ids, case_qids
        )
        ref.backward()
        got = sum(r[name]["loss"] for r in ranks) / WORLD
        assert rel_err(got, ref) < TOL, name
        for k, res in enumerate(ranks):  # the data-parallel average divides by W
            sl = slice(k * B_LOCAL, (k + 1) * B_LOCAL)
            assert rel_err(res[name]["dx"] / WORLD, leaves[0].grad[sl]) < TOL, (name, k, "dx")
            assert rel_err(res[name]["dy"] / WORLD, leaves[1].grad[sl]) < TOL, (name, k, "dy")
        assert rel_err(sum(r[name]["ds"] for r in ranks) / WORLD, leaves[2].grad) < TOL, (name, "dscale")
        want = naive_stats(
            x.double(), y.double(), scale.double().reshape(()), qx.double(), qy.double(), case_ids, case_qids
        )
        for r in ranks:  # rank-averaged monitors are the global ones
            for key, value in want.items():
                assert r[name]["stats"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (name, key)
            assert r[name]["stats"]["n_candidates"] == n + Q

    for stage in (0, 2, 3):
        a, b = ranks[0][f"zero{stage}"], ranks[1][f"zero{stage}"]
        ema = {k: v.double() for k, v in a["init"].items()}
        for step, rec in enumerate(a["steps"]):
            for k in ema:  # ema = 0.8 ema + 0.2 w_t, with w_t the master weights after step t
                ema[k] = 0.8 * ema[k] + 0.2 * rec["master"][k].double()
                assert rel_err(rec["ema"][k], ema[k]) < 1e-6, (stage, step, k)
                assert torch.equal(rec["ema"][k], b["steps"][step]["ema"][k]), (stage, step, k)
        qa, qb = a["queue"], b["queue"]
        assert (qa["ptr"], qa["fill"]) == (qb["ptr"], qb["fill"]) == (4, 12)  # 2 pushes of 2 x 4 into 12
        for key in ("image", "text", "ids"):
            assert torch.equal(qa[key], qb[key]), (stage, key)  # identical on every rank
        # step 2's 8 entries, rank order: rank 0's ids 0..3 in slots 8-11, rank 1's 4, 0, 1, 2 wrapped to 0-3
        assert qa["ids"][[0, 1, 2, 3, 8, 9, 10, 11]].tolist() == [4, 0, 1, 2, 0, 1, 2, 3]
