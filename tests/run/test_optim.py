import pytest
import torch

from mmalign.cli import build_parser, drop_local_rank
from mmalign.config import ConfigError, ModelConfig, load_config
from mmalign.dist.launch import strip_nproc
from mmalign.models import build_model
from mmalign.run.optim import Lamb, build_optimizer, param_groups


def test_no_weight_decay_on_norms_biases_and_temperature():
    model = build_model(ModelConfig(preset="micro"))
    decay, no_decay = param_groups(model, 0.2)
    assert decay["weight_decay"] == 0.2 and no_decay["weight_decay"] == 0.0
    names = {id(p): n for n, p in model.named_parameters()}
    nd = {names[id(p)] for p in no_decay["params"]}
    d = {names[id(p)] for p in decay["params"]}
    assert "logit_scale" in nd
    assert all(p.ndim >= 2 for p in decay["params"])
    assert not any("bias" in n or ".ln" in n for n in d)
    assert "visual.conv1.weight" in d and "text.token_embedding.weight" in d
    assert len(nd) + len(d) == len(list(model.parameters()))


def test_lamb_step_matches_the_formula():
    torch.manual_seed(0)
    w0 = torch.randn(5, 3)
    g = torch.randn(5, 3)
    p = torch.nn.Parameter(w0.clone())
    opt = Lamb([{"params": [p], "weight_decay": 0.1}], lr=0.01, betas=(0.9, 0.99), eps=1e-6)
    p.grad = g.clone()
    opt.step()
    m, v = 0.1 * g, 0.01 * g * g
    m_hat, v_hat = m / (1 - 0.9), v / (1 - 0.99)
    update = m_hat / (v_hat.sqrt() + 1e-6) + 0.1 * w0
    trust = w0.norm() / update.norm()
    torch.testing.assert_close(p.detach(), w0 - 0.01 * trust * update)


@pytest.mark.parametrize(
    "name, cls", [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD), ("lamb", Lamb)]
)
def test_build_optimizer_keeps_groups(name, cls):
    cfg = load_config(None, [f"train.optimizer={name}", "train.lr=0.02", "train.weight_decay=0.3"])
    opt = build_optimizer(param_groups(build_model(ModelConfig(preset="micro")), 0.3), cfg.train)
    assert isinstance(opt, cls)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    assert all(g["lr"] == 0.02 for g in opt.param_groups)


def test_batch_plan_arithmetic():
    from mmalign.run.engine import ds_config, plan_batch

    cfg = load_config(None, ["train.global_batch_size=12", "train.grad_cache_chunk_size=4"])
    plan = plan_batch(cfg, 2)
    assert plan.local_batch == 6 and plan.chunks == (4, 2)
    assert plan.micro_batch == 4 and plan.accumulation == 2
    conf = ds_config(cfg, plan)
    assert conf["train_micro_batch_size_per_gpu"] == 4 and conf["gradient_accumulation_steps"] == 2
    assert conf["train_batch_size"] == 4 * 2 * 2
    plan = plan_batch(load_config(None, ["train.global_batch_size=12"]), 3)
    assert plan.chunks == (4,) and "12 = micro batch 4 x accumulation 1 x world size 3" in plan.describe()
    with pytest.raises(ConfigError, match="global_batch_size"):
        plan_batch(cfg, 5)
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="fp16"):
            ds_config(load_config(None, ["deepspeed.precision=fp16"]), plan)


def test_launch_argument_handling():
    assert strip_nproc(["train", "--nproc", "2", "--set", "a=1"]) == ["train", "--set", "a=1"]
    assert strip_nproc(["train", "--nproc=4"]) == ["train"]
    # the deepspeed launcher inserts --local_rank=N before the sub-command
    argv = drop_local_rank(["--local_rank=1", "train", "--local-rank", "0", "--set", "train.steps=2"])
    assert argv == ["train", "--set", "train.steps=2"]
    assert build_parser().parse_args(argv).set == ["train.steps=2"]


def test_segmented_lamb_equals_per_tensor_lamb():
    """Flat partitions as ZeRO lays them out (tensors back to back, padding, one tensor
    split across two "ranks"), stepped by two Lamb instances whose norm sums are
    reduced across threads, equal the per-tensor Lamb on the separate tensors."""
    import threading

    torch.manual_seed(0)
    shapes = [(5, 3), (7,), (4, 4), (3,)]
    weights = [torch.randn(s) for s in shapes]
    weights[3].zero_()  # a zero-init tensor: trust ratio 1
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb(
        [{"params": plain[:2], "weight_decay": 0.1}, {"params": plain[2:], "weight_decay": 0.0}],
        lr=0.05,
        betas=(0.9, 0.99),
        eps=1e-6,
    )
    for step in grads:
        for p, g in zip(plain, step):
            p.grad = g.clone()
        opt.step()

    # group 0 = [w0 | w1 | 2 pad] split 12 + 12 over two ranks (w0 straddles); group 1 = [w2 | w3 | 1 pad]
    # split 10 + 10 (w2 straddles); the layout of rank r: (tensor, offset, length) per partition
    def flat(ts, total):
        return torch.cat([t.flatten() for t in ts] + [torch.zeros(total - sum(t.numel() for t in ts))])

    layouts = [[[(0, 0, 12)], [(2, 0, 10)]], [[(0, 0, 3), (1, 3, 7)], [(2, 0, 6), (3, 6, 3)]]]
    barrier, box = threading.Barrier(2), {}

    def reduce_sum(rank):
        def f(t):
            box[rank] = t.clone()
            barrier.wait()
            total = box[0] + box[1]
            barrier.wait()
            return t.copy_(total)

        return f

    results = {}

    def rank_run(rank):
        w_flat = [flat(weights[:2], 24), flat(weights[2:], 20)]
        parts = [
            torch.nn.Parameter(w.narrow(0, 12 * rank, 12).clone())
            if i == 0
            else torch.nn.Parameter(w.narrow(0, 10 * rank, 10).clone())
            for i, w in enumerate(w_flat)
        ]
        seg = Lamb(
            [{"params": [parts[0]], "weight_decay": 0.1}, {"params": [parts[1]], "weight_decay": 0.0}],
            lr=0.05,
            betas=(0.9, 0.99),
            eps=1e-6,
        )
        seg.set_partition_layout(list(zip(parts, layouts[rank])), len(shapes), reduce_sum(rank))
        for step in grads:
            g_flat = [flat(step[:2], 24), flat(step[2:], 20)]
            parts[0].grad = g_flat[0].narrow(0, 12 * rank, 12).clone()
            parts[1].grad = g_flat[1].narrow(0, 10 * rank, 10).clone()
            seg.step()
        results[rank] = [p.detach() for p in parts]

    threads = [threading.Thread(target=rank_run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    got = [torch.cat([results[0][i], results[1][i]]) for i in range(2)]
    torch.testing.assert_close(got[0], flat([p.detach() for p in plain[:2]], 24))
    torch.testing.assert_close(got[1], flat([p.detach() for p in plain[2:]], 20))
    # a partition stepped without a layout entry is an error, not a silent per-partition ratio
    other = torch.nn.Parameter(torch.randn(4))
    bad = Lamb([other])
    bad.set_partition_layout([(torch.zeros(4), [(0, 0, 4)])], 1, lambda t: t)
    other.grad = torch.randn(4)
    with pytest.raises(RuntimeError, match="layout"):
        bad.step()


# ------------------------------------------------ per-tower learning rates and layer-wise decay

LR, LR_IMAGE, LR_TEXT, DECAY = 1e-3, 4e-3, 2e-3, 0.5


def _lr_of(groups: list[dict], model: torch.nn.Module) -> dict[str, tuple[float, float]]:
    """name -> (lr, weight decay), checking that every trainable parameter is in exactly one group."""
    names = {id(p): n for n, p in model.named_parameters()}
    seen: dict[str, tuple[float, float]] = {}
    for g in groups:
        for p in g["params"]:
            n = names[id(p)]
            assert n not in seen, f"{n} in two groups"
            seen[n] = (g["lr"], g["weight_decay"])
    assert set(seen) == {n for n, p in model.named_parameters() if p.requires_grad}
    return seen


def test_layer_decay_groups_on_the_tiny_vit():
    from mmalign.run.optim import train_param_groups

    cfg = load_config(
        None,
        [
            f"train.lr={LR}",
            f"train.lr_image={LR_IMAGE}",
            f"train.lr_text={LR_TEXT}",
            f"train.layer_decay={DECAY}",
            "train.weight_decay=0.2",
        ],
    )
    model = build_model(ModelConfig(preset="tiny"))  # 4 blocks per tower: layers 0 (stem) .. 5 (head)
    got = _lr_of(train_param_groups(model, cfg.train), model)
    # (lr, weight decay) written out from the rule: tower lr x decay^(5 - layer)
    want = {
        "visual.conv1.weight": (LR_IMAGE * DECAY**5, 0.2),  # patch embedding: layer 0
        "visual.positional_embedding": (LR_IMAGE * DECAY**5, 0.2),
        "visual.class_embedding": (LR_IMAGE * DECAY**5, 0.0),
        "visual.ln_pre.weight": (LR_IMAGE * DECAY**5, 0.0),
        "visual.transformer.resblocks.0.attn.in_proj_weight": (LR_IMAGE * DECAY**4, 0.2),  # first block
        "visual.transformer.resblocks.0.attn.in_proj_bias": (LR_IMAGE * DECAY**4, 0.0),
        "visual.transformer.resblocks.3.mlp.c_fc.weight": (LR_IMAGE * DECAY, 0.2),  # last block
        "visual.transformer.resblocks.3.ln_2.weight": (LR_IMAGE * DECAY, 0.0),
        "visual.ln_post.bias": (LR_IMAGE, 0.0),  # head: layer 5
        "visual.proj": (LR_IMAGE, 0.2),
        "text.token_embedding.weight": (LR_TEXT * DECAY**5, 0.2),
        "text.positional_embedding": (LR_TEXT * DECAY**5, 0.2),
        "text.transformer.resblocks.0.mlp.c_proj.weight": (LR_TEXT * DECAY**4, 0.2),
        "text.transformer.resblocks.3.attn.out_proj.weight": (LR_TEXT * DECAY, 0.2),
        "text.ln_final.weight": (LR_TEXT, 0.0),
        "text.text_projection": (LR_TEXT, 0.2),
        "logit_scale": (LR, 0.0),  # the temperature: train.lr, no decay of either kind
    }
    for name, (lr, wd) in want.items():
        assert got[name][0] == pytest.approx(lr, rel=1e-12), (name, got[name], lr)
        assert got[name][1] == wd, (name, got[name], wd)
    # every tower parameter has one of the L + 1 = 6 lrs of its tower
    for name, (lr, _) in got.items():
        if name.startswith(("visual.", "text.")):
            base = LR_IMAGE if name.startswith("visual.") else LR_TEXT
            assert any(lr == pytest.approx(base * DECAY**k, rel=1e-12) for k in range(6)), (name, lr)
    # the temperature and SigLIP bias stay at train.lr under per-tower lrs
    siglip = build_model(ModelConfig(preset="micro", init_logit_bias=-10.0))
    assert _lr_of(train_param_groups(siglip, cfg.train), siglip)["logit_bias"] == (LR, 0.0)


def test_defaults_keep_two_groups_at_train_lr():
    from mmalign.run.optim import train_param_groups

    cfg = load_config(None, ["train.lr=0.02", "train.weight_decay=0.3"])
    model = build_model(ModelConfig(preset="micro"))
    groups = train_param_groups(model, cfg.train)
    assert [(g["lr"], g["weight_decay"]) for g in groups] == [(0.02, 0.3), (0.02, 0.0)]
    # per-tower lrs without decay: one lr per tower, no layer split
    cfg = load_config(None, ["train.lr=0.02", "train.lr_text=0.005"])
    got = _lr_of(train_param_groups(model, cfg.train), model)
    assert {lr for n, (lr, _) in got.items() if n.startswith("text.")} == {0.005}
    assert {lr for n, (lr, _) in got.items() if not n.startswith("text.")} == {0.02}
    # frozen parameters get no group (no optimiser state)
    for p in model.visual.parameters():
        p.requires_grad_(False)
    assert not any(n.startswith("visual.") for n in _lr_of(train_param_groups(model, cfg.train), model))


def test_schedule_keeps_the_group_ratios():
    from mmalign.run.optim import train_param_groups, warmup_cosine

    cfg = load_config(
        None,
        [
            f"train.lr={LR}",
            f"train.lr_image={LR_IMAGE}",
            f"train.layer_decay={DECAY}",
            "train.steps=10",
            "train.warmup_steps=3",
        ],
    )
    model = build_model(ModelConfig(preset="micro"))
    opt = build_optimizer(train_param_groups(model, cfg.train), cfg.train)
    base = [g["lr"] for g in opt.param_groups]
    assert len(set(base)) >= 4  # stems, blocks and heads of two towers, the temperature
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: warmup_cosine(s, 3, 10))
    for step in range(10):
        factor = warmup_cosine(step, 3, 10)
        for g, b in zip(opt.param_groups, base):
            assert g["lr"] == pytest.approx(b * factor, rel=1e-12, abs=1e-18), (step, b)
        opt.step()
        sched.step()


@pytest.mark.parametrize(
    "override, match",
    [
        ("train.lr_image=0", "train.lr_image"),
        ("train.lr_text=-1e-3", "train.lr_text"),
        ("train.layer_decay=0", "train.layer_decay"),
        ("train.layer_decay=1.5", "train.layer_decay"),
    ],
)
def test_lr_keys_are_validated(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


def test_layer_decay_needs_transformer_towers():
    from mmalign.run.optim import train_param_groups

    cfg = load_config(None, ["train.layer_decay=0.8"])
    with pytest.raises(ConfigError, match="train.layer_decay.*ModifiedResNet"):
        train_param_groups(build_model(ModelConfig(preset="micro-rn")), cfg.train)
    # without decay the ResNet tower gets its own lr as any tower
    cfg = load_config(None, ["train.lr_image=0.01"])
    model = build_model(ModelConfig(preset="micro-rn"))
    assert {
        lr
        for n, (lr, _) in _lr_of(train_param_groups(model, cfg.train), model).items()
        if n.startswith("visual.")
    } == {0.01}


def _group_lr_worker(rank: int, world: int, seed: int) -> dict:
    """Two SGD steps at ZeRO 0 and 2 with per-tower lrs and layer decay: the group lrs DeepSpeed's
    optimiser holds, and each parameter's first update divided by its gradient (= its lr)."""
    from mmalign.data.batch import Batch
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine
    from tests.harness import clip_batch

    out = {}
    for stage in (0, 2):
        cfg = load_config(
            None,
            [
                "model.preset=micro",
                "train.global_batch_size=4",
                "train.steps=4",
                "train.warmup_steps=0",
                "train.optimizer=sgd",
                f"train.lr={LR}",
                f"train.lr_image={LR_IMAGE}",
                f"train.lr_text={LR_TEXT}",
                f"train.layer_decay={DECAY}",
                "train.weight_decay=0.0",
                f"deepspeed.zero_stage={stage}",
            ],
        )
        torch.manual_seed(seed)
        engine = Engine(build_model(cfg.model), cfg)
        before = {n: p.detach().clone() for n, p in engine.consolidated_state_dict().items()}
        grads, lrs = {}, []
        for step in range(2):
            images, tokens = clip_batch(4, seed + step)
            captured = {}
            engine.step(
                Batch(images, tokens),
                build_objective(cfg),
                before_update=lambda: captured.update(engine.full_grads()),
            )
            if step == 0:
                grads = captured
                after = engine.consolidated_state_dict()
            lrs.append(
                (
                    [g["lr"] for g in engine.base_optimizer.param_groups],
                    [g["lr"] for g in engine.ds.optimizer.param_groups],
                    engine.lr,
                )
            )
        out[stage] = (before, after, grads, lrs)
    return out


@pytest.mark.integration
def test_engine_keeps_group_lrs_at_zero_0_and_2(seed):
    from mmalign.run.optim import param_groups, warmup_cosine
    from tests.harness import run_ranks

    results = run_ranks(_group_lr_worker, 1, seed, pooled=True)[0]
    model = build_model(ModelConfig(preset="micro"))
    groups = param_groups(model, 0.0, lr=LR, lr_image=LR_IMAGE, lr_text=LR_TEXT, layer_decay=DECAY)
    want = _lr_of(groups, model)
    group_lrs = sorted(g["lr"] for g in groups)
    assert len(set(group_lrs)) == 4  # micro (L = 2): image 1, 2, 4e-3; text 0.5, 1, 2e-3; temperature 1e-3
    for stage, (before, after, grads, lrs) in results.items():
        for step, (ours, deepspeeds, engine_lr) in enumerate(lrs):
            factor = warmup_cosine(step + 1, 0, 4)  # after step s the schedule has moved to s + 1
            assert sorted(ours) == pytest.approx([lr * factor for lr in group_lrs], rel=1e-9), (stage, step)
            assert deepspeeds == ours, (stage, step)
            assert engine_lr == pytest.approx(LR * factor, rel=1e-9)
        # plain SGD, no clipping: the update of every parameter is its own group's lr x gradient
        for name, (lr, _) in want.items():
            delta = (before[name] - after[name]).flatten()
            g = grads[name].flatten()
            if name == "logit_scale" or not g.abs().max() > 0:
                continue  # clamped after the update / no gradient
            # fp32 rounding of w - lr g is ~1e-7 |w|: ~1e-4 of an update; the next lr is 2x away
            rel = float((delta - lr * g).norm() / (lr * g).norm())
            assert rel <= 2e-3, (stage, name, lr, rel)


def test_weight_decay_zero_keeps_two_groups():
    """A checkpoint's optimiser state has one entry per group: weight_decay 0 must not merge them."""
    from mmalign.run.optim import train_param_groups

    model = build_model(ModelConfig(preset="micro"))
    groups = train_param_groups(model, load_config(None, ["train.weight_decay=0.0"]).train)
    assert [g["weight_decay"] for g in groups] == [0.0, 0.0]
    assert all(p.ndim >= 2 for p in groups[0]["params"]) and any(p.ndim < 2 for p in groups[1]["params"])


def test_adamw_is_fused_and_steps_as_the_per_tensor_loop(seed):
    """The fused kernel is what we ship (3x cheaper on CPU); it must follow the same update as
    torch's per-tensor AdamW over a few steps with decay on and off."""
    from mmalign.config import load_config
    from mmalign.run.optim import train_param_groups

    t = load_config(
        None, ["model.preset=micro", "train.optimizer=adamw", "train.lr=0.01", "train.weight_decay=0.1"]
    ).train
    torch.manual_seed(seed)
    a = build_model(ModelConfig(preset="micro"))
    b = build_model(ModelConfig(preset="micro"))
    b.load_state_dict(a.state_dict())
    fused = build_optimizer(train_param_groups(a, t), t)
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW(
        train_param_groups(b, t), lr=t.lr, betas=tuple(t.betas), eps=t.eps, foreach=False
    )
    g = torch.Generator().manual_seed(seed)
    for _ in range(3):  # the same gradients for both (from a forward, Adam would amplify rounding
        for pa, pb in zip(a.parameters(), b.parameters()):  # noise in near-zero gradients)
            pa.grad = torch.randn(pa.shape, generator=g)
            pb.grad = pa.grad.clone()
        fused.step()
        loop.step()
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert (p - q).abs().max() <= 1e-6, (n, float((p - q).abs().max()))
