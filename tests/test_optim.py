
import pytest
import torch

from mmalign.cli import build_parser, drop_local_rank
from mmalign.config import ConfigError, ModelConfig, load_config
from mmalign.launch import strip_nproc
from mmalign.models import build_model
from mmalign.optim import Lamb, build_optimizer, param_groups


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


@pytest.mark.parametrize("name, cls", [("adamw", torch.optim.AdamW), ("sgd", torch.optim.SGD), ("lamb", Lamb)])
def test_build_optimizer_keeps_groups(name, cls):
    cfg = load_config(None, [f"train.optimizer={name}", "train.lr=0.02", "train.weight_decay=0.3"])
    opt = build_optimizer(param_groups(build_model(ModelConfig(preset="micro")), 0.3), cfg.train)
    assert isinstance(opt, cls)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.3, 0.0]
    assert all(g["lr"] == 0.02 for g in opt.param_groups)


def test_batch_plan_arithmetic():
    from mmalign.engine import ds_config, plan_batch

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
    shapes, decay = [(5, 3), (7,), (4, 4), (3,)], [0.1, 0.1, 0.0, 0.0]
    weights = [torch.randn(s) for s in shapes]
    weights[3].zero_()  # a zero-init tensor: trust ratio 1
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    plain = [torch.nn.Parameter(w.clone()) for w in weights]
    opt = Lamb([{"params": plain[:2], "weight_decay": 0.1}, {"params": plain[2:], "weight_decay": 0.0}],
               lr=0.05, betas=(0.9, 0.99), eps=1e-6)
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
        parts = [torch.nn.Parameter(w.narrow(0, 12 * rank, 12).clone()) if i == 0 else
                 torch.nn.Parameter(w.narrow(0, 10 * rank, 10).clone()) for i, w in enumerate(w_flat)]
        seg = Lamb([{"params": [parts[0]], "weight_decay": 0.1}, {"params": [parts[1]], "weight_decay": 0.0}],
                   lr=0.05, betas=(0.9, 0.99), eps=1e-6)
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
