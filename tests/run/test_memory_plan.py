"""``train.grad_cache_chunk_size: auto`` (mmalign/run/memory_plan.py).

* The measured bytes are exactly those of the tensors the model's autograd graph holds for its
  backward (reference: a walk over the graph's nodes reading their saved tensors), and the
  measurement leaves the model, its BatchNorm statistics and the random generators as it found them.
* The choice around the budget: the need of the whole local batch fits -> off; one byte
  less -> chunked, with as few chunks as the budget allows, the largest no bigger than what
  fits; not even one sample fits -> a one-line ConfigError naming the budget key.
* Integers and 0 are returned as they are, without a measurement; bad values are one-line ConfigErrors.
* A step after ``auto`` equals the step of the integer it chose (bit for bit, patch dropout
  drawing random numbers), and on 2 ranks with different budgets both ranks plan the same chunks
  (the smallest); ``mmalign train --nproc 2`` logs the choice and runs that plan.
"""

from __future__ import annotations

import math

import pytest
import torch

from mmalign.config import ConfigError, load_config
from tests.harness import ROOT, engine_batch, run_cli, run_ranks

GIB = 2**30


def _cfg(*extra: str):
    return load_config(
        None, ["model.preset=micro", "train.global_batch_size=16", "train.grad_cache_chunk_size=auto", *extra]
    )


def _parts(cfg):
    from mmalign.models import build_model
    from mmalign.models.tokenizers import build_tokenizer
    from mmalign.objective import build_objective

    model = build_model(cfg.model)
    return model, build_objective(cfg, 1, model=model), build_tokenizer(model.arch)


def _graph_saved_bytes(outputs, model) -> int:
    """Reference: the unique storages (parameters and buffers excluded) of every tensor the
    autograd nodes reachable from ``outputs`` hold for the backward (their ``_saved_*`` fields)."""
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    found, stack, seen = {}, [t.grad_fn for t in outputs if t is not None and t.grad_fn is not None], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for attr in dir(node):
            if not attr.startswith("_saved_"):
                continue
            value = getattr(node, attr)
            for t in value if isinstance(value, (tuple, list)) else [value]:
                if torch.is_tensor(t) and t.untyped_storage().data_ptr() not in own:
                    found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        stack.extend(f for f, _ in node.next_functions)
    return sum(found.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_measured_bytes_are_the_graphs_saved_tensors_and_nothing_moves(precision):
    from mmalign.run.memory_plan import probe_autocast, probe_inputs, saved_bytes

    cfg = _cfg(
        f"train.precision={precision}", "model.preset=tiny-rn", "model.batchnorm=local"
    )  # BatchNorm statistics
    model, objective, tokenizer = _parts(cfg)
    model.eval()
    autocast = probe_autocast(cfg, torch.device("cpu"))
    for n in (1, 2, 3):
        inputs = probe_inputs(model, tokenizer, n, torch.device("cpu"), objective.embeddings)
        assert (
            inputs["texts"].shape == (n, model.context_length) and (inputs["texts"][:, -1] != 0).all()
        )  # full
        buffers = {k: v.clone() for k, v in model.state_dict().items()}
        rng = torch.get_rng_state()
        got = saved_bytes(model, inputs, autocast)
        assert torch.equal(torch.get_rng_state(), rng) and not model.training
        assert all(torch.equal(v, buffers[k]) for k, v in model.state_dict().items())
        model.train()
        with autocast():
            out = model(**inputs)
        model.eval()
        assert got == _graph_saved_bytes(list(out.tensors().values()), model) > 0, n


def test_per_sample_and_fixed_bytes_from_one_and_two_samples():
    from mmalign.models import attention_kernel
    from mmalign.run.memory_plan import measure, probe_autocast, probe_inputs, saved_bytes

    cfg = _cfg("train.precision=bf16")
    model, objective, tokenizer = _parts(cfg)
    cpu, autocast = torch.device("cpu"), probe_autocast(cfg, torch.device("cpu"))
    # CPU bf16 under attention_kernel auto: a kernel timed per shape class; the probe measures the
    # one that saves the most (math), whatever the timing would pick for its 1- and 2-row batches
    assert attention_kernel.get_mode() == "auto"
    per_sample, fixed = measure(model, tokenizer, cfg, cpu, objective.embeddings, autocast)
    with attention_kernel.using("math"):
        one, two, four = (
            saved_bytes(model, probe_inputs(model, tokenizer, n, cpu, objective.embeddings), autocast)
            for n in (1, 2, 4)
        )
    assert (per_sample, fixed) == (two - one, 2 * one - two)
    assert fixed > 0  # autocast's bf16 weight copies: saved once whatever the batch
    assert four == fixed + 4 * per_sample  # linear in the batch


def _plan(cfg, local, world=1):
    from mmalign.run.memory_plan import MemoryModel, features_bytes, loss_bytes, measure, probe_autocast

    model, objective, tokenizer = _parts(cfg)
    cpu = torch.device("cpu")
    per_sample, fixed = measure(model, tokenizer, cfg, cpu, objective.embeddings, probe_autocast(cfg, cpu))
    return MemoryModel(
        per_sample,
        fixed,
        loss_bytes(cfg, local, world),
        features_bytes(cfg, model.embed_dim, local, world, objective.embeddings),
        0,
    )


def _resolve(cfg):
    from mmalign.run.memory_plan import resolve_grad_cache_chunk

    return resolve_grad_cache_chunk(cfg, *_parts(cfg), torch.device("cpu"))


def test_the_choice_around_the_budget():
    from mmalign.run.gradcache import chunk_sizes

    local = 16
    plan = _plan(_cfg(), local)
    need = plan.need(local)
    assert need == plan.fixed + local * plan.per_sample + plan.loss + plan.features and plan.per_sample > 0
    # the whole local batch fits: off
    chunk, line = _resolve(_cfg(f"train.memory_budget_gb={(need + 0.5) / GIB!r}"))
    assert chunk == 0 and "auto -> off" in line and "\n" not in line
    # one byte less: chunked, as few chunks as fit, none larger than what fits
    for budget in (need - 1, plan.need(5), plan.need(5) + plan.per_sample - 1, plan.need(1)):
        chunk, line = _resolve(_cfg(f"train.memory_budget_gb={(budget + 0.5) / GIB!r}"))
        largest = max(c for c in range(1, local + 1) if plan.need(c) <= budget)
        sizes = chunk_sizes(local, chunk)
        assert 0 < chunk <= largest < local and plan.need(chunk) <= budget, (budget, chunk, largest)
        assert len(sizes) == math.ceil(local / largest) and max(sizes) - min(sizes) <= 1, (budget, sizes)
        assert f"auto -> {chunk} " in line
    # not even one sample fits: one line naming the key
    with pytest.raises(ConfigError) as err:
        _resolve(_cfg(f"train.memory_budget_gb={(plan.need(1) - 1 + 0.5) / GIB!r}"))
    assert "train.memory_budget_gb" in str(err.value) and "\n" not in str(err.value)


def test_the_measured_budget_is_available_ram_less_the_training_state(monkeypatch):
    import psutil

    from mmalign.run import memory_plan

    cfg = _cfg("train.optimizer=adamw")
    model = _parts(cfg)[0]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    state = memory_plan.state_bytes(model, cfg, 0, 1)
    assert state == 4 * trainable * (1 + 2)  # fp32 gradients + AdamW's two moments, ZeRO-0
    assert memory_plan.state_bytes(model, _cfg("train.optimizer=sgd"), 0, 1) == 4 * trainable
    # ZeRO-1 on 2 ranks: + flat gradient buffers, moments and the fp32 master copy halved
    assert memory_plan.state_bytes(model, _cfg("deepspeed.zero_stage=1"), 1, 2) == int(
        4 * trainable * (2 + 3 / 2)
    )
    # train.ema_decay: one more fp32 copy of the trainable weights, partitioned like the master
    assert memory_plan.state_bytes(model, _cfg("train.ema_decay=0.99"), 0, 1) == 4 * trainable * (1 + 2 + 1)
    assert memory_plan.state_bytes(
        model, _cfg("deepspeed.zero_stage=1", "train.ema_decay=0.99"), 1, 2
    ) == int(4 * trainable * (2 + 4 / 2))

    class Memory:
        available = 40 * GIB

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory)
    cpu = torch.device("cpu")
    assert memory_plan.budget_bytes(cfg, cpu, state, 1) == int(memory_plan.RAM_FRACTION * 40 * GIB - state)
    assert memory_plan.budget_bytes(cfg, cpu, state, 4) == int(memory_plan.RAM_FRACTION * 10 * GIB - state)
    assert (
        memory_plan.budget_bytes(_cfg("train.memory_budget_gb=3"), cpu, state, 4) == 3 * GIB
    )  # given: as is


def test_integers_stay_as_they_are_without_a_measurement(monkeypatch):
    from mmalign.run import memory_plan

    monkeypatch.setattr(memory_plan, "measure", lambda *a, **k: pytest.fail("measured for an integer chunk"))
    for chunk in (0, 4, 16):
        cfg = load_config(
            None, ["model.preset=micro", "train.global_batch_size=16", f"train.grad_cache_chunk_size={chunk}"]
        )
        assert memory_plan.resolve_grad_cache_chunk(cfg, *_parts(cfg), torch.device("cpu")) == (chunk, None)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.memory_budget_gb=-1", "train.memory_budget_gb"),
        ("train.memory_budget_gb=auto", "train.memory_budget_gb"),
        ("train.grad_cache_chunk_size=Auto", "train.grad_cache_chunk_size"),
        ("train.grad_cache_chunk_size=half", "train.grad_cache_chunk_size"),
        ("train.grad_cache_chunk_size=-2", "train.grad_cache_chunk_size"),
        ("train.grad_cache_chunk_size=17", "train.grad_cache_chunk_size"),
    ],
)
def test_bad_values_are_one_line_errors(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.global_batch_size=16", override])
    assert key in str(err.value) and "\n" not in str(err.value)


def test_a_resolved_chunk_is_validated_at_the_real_world_size():
    from mmalign.run.memory_plan import resolved_config

    cfg = _cfg("deepspeed.precision=bf16")  # ZeRO-0 cannot sum bf16 weights' chunks in fp32
    assert cfg.train.grad_cache_chunk_size == "auto"
    assert (
        resolved_config(cfg, 0).train.grad_cache_chunk_size == 0 and cfg.train.grad_cache_chunk_size == "auto"
    )
    with pytest.raises(ConfigError, match="deepspeed.precision"):
        resolved_config(cfg, 4)


def _engine_worker(rank, world, seed, budgets):
    """Per rank: its own budget; the chunk auto chose, the engine's plan, and the weights after one
    step from a model that auto measured, next to one that it did not (with the integer it chose)."""
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.models.tokenizers import build_tokenizer
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine
    from mmalign.run.memory_plan import resolve_grad_cache_chunk, resolved_config
    from tests.harness import engine_cfg

    out = {}
    for name, budget in (("auto", budgets[rank]), ("int", None)):
        cfg = engine_cfg(
            1,
            "model.patch_dropout=0.5",
            "train.optimizer=sgd",  # patch dropout draws random numbers
            "train.grad_cache_chunk_size=" + ("auto" if budget is not None else str(out.get("chunk", 0))),
            f"train.memory_budget_gb={(budget or 0) / GIB!r}",
        )
        torch.manual_seed(seed)
        model = build_model(cfg.model)
        objective = build_objective(cfg, world, model=model)
        chunk, line = resolve_grad_cache_chunk(
            cfg, model, objective, build_tokenizer(model.arch), torch.device("cpu")
        )
        if name == "auto":
            out["chunk"], out["line"] = chunk, line
            cfg = resolved_config(cfg, chunk)
        engine = Engine(model, cfg)
        engine.step(Batch(*engine_batch(seed + 1, rank, world)), objective)
        out[name] = (engine.plan, engine.consolidated_state_dict())
    return out


@pytest.mark.integration
def test_auto_plans_the_same_chunks_on_every_rank_and_steps_as_its_integer(seed):
    from tests.harness import ENGINE_BATCH, engine_cfg

    cfg = engine_cfg(1, "model.patch_dropout=0.5", "train.grad_cache_chunk_size=auto")
    world = 2
    plan = _plan(cfg, ENGINE_BATCH // world, world)
    budgets = [plan.need(3), plan.need(1)]  # rank 0 could take chunks of 3 (-> 2, 2), rank 1 only of 1
    ranks = run_ranks(_engine_worker, world, seed, budgets, pooled=True)
    assert [r["chunk"] for r in ranks] == [1, 1], [r["line"] for r in ranks]
    assert ranks[0]["auto"][0] == ranks[1]["auto"][0] == ranks[0]["int"][0]
    assert ranks[0]["auto"][0].chunks == (1, 1, 1, 1)
    for r in ranks:
        auto, integer = r["auto"][1], r["int"][1]
        assert all(torch.equal(auto[k], integer[k]) for k in integer)  # the measurement moved nothing
    assert "smallest chunk over 2 ranks" in ranks[1]["line"]


@pytest.mark.integration
def test_train_with_auto_on_two_processes_logs_and_runs_the_plan(micro_overrides, tmp_path):
    out = tmp_path / "run"
    overrides = [
        *micro_overrides,
        "train.steps=2",
        "eval.suite=none",
        "monitor.probe_size=0",
        "train.grad_cache_chunk_size=auto",
    ]
    cfg = load_config(str(ROOT / "configs/quickstart.yaml"), overrides)
    local = cfg.train.global_batch_size // 2
    budget = _plan(cfg, local, 2).need(5)  # chunks of at most 5 of the 16 local rows: 4 chunks of 4
    args = ["train", "--config", str(ROOT / "configs/quickstart.yaml"), "--output", str(out), "--nproc", "2"]
    for o in [*overrides, f"train.memory_budget_gb={(budget + 0.5) / GIB!r}"]:
        args += ["--set", o]
    res = run_cli(*args)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert local == 16 and "train.grad_cache_chunk_size: auto -> 4 (local batch 16" in res.stdout, res.stdout[
        -2000:
    ]
    assert "micro batch 4 x accumulation 4 x world size 2" in res.stdout, res.stdout[-2000:]
    stored = (out / "config.yaml").read_text()
    assert "grad_cache_chunk_size: auto" in stored  # the run's config keeps auto (a resume re-measures)
