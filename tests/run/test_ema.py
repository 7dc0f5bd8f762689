"""train.ema_decay (issue 42, point 5): the EMA of the weights equals a naive EMA over the same
steps, on 1 and on 2 ranks and at every ZeRO stage, its per-rank pieces carry over to another
world size, and an out-of-range decay is one line.

The naive reference folds full snapshots of the fp32 master weights, taken after each step
(``Engine.full_params(master=True)``), with the formula of the docs written out here:
``d_t = min(d, (1 + t) / (10 + t))``, ``ema = ema * d_t + theta * (1 - d_t)`` in float32.
Elementwise float32 products do not depend on how the elements are split over ranks, so the
comparison is exact.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import cli_main, engine_batch, engine_cfg, run_ranks

# (ZeRO stage, deepspeed.precision): bf16 weights at ZeRO-0 have no fp32 master (the EMA folds the bf16
# weights in fp32); at ZeRO-1 DeepSpeed's BF16 optimizer keeps the fp32 master in pieces
STAGES = ((0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (0, "bf16"), (1, "bf16"))
STEPS = 3
DECAY = 0.9


def _naive_decay(t: int) -> float:
    return min(DECAY, (1 + t) / (10 + t))


def _worker(rank: int, world: int, ema_dir: str, restore_from: int, train: bool = True) -> dict:
    """Per ZeRO stage, with ``train``: STEPS steps with an Ema beside a naive one; the consolidated
    EMA, the naive one, and this rank's state (written to ``ema_dir``). With ``restore_from``: a
    fresh engine restores the EMA that ``restore_from`` ranks wrote, and consolidates it."""
    out: dict = {}
    for stage in STAGES:
        cfg = engine_cfg(
            stage[0], "train.optimizer=adamw", "train.weight_decay=0.1", f"deepspeed.precision={stage[1]}"
        )
        if train:
            _train(cfg, stage, rank, world, ema_dir, out)
        if restore_from:
            _restore(cfg, stage, restore_from, ema_dir, out)
    return out


def _train(cfg, stage, rank: int, world: int, ema_dir: str, out: dict) -> None:
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.ema import Ema
    from mmalign.run.engine import Engine

    objective = build_objective(cfg)
    torch.manual_seed(5)
    engine = Engine(build_model(cfg.model), cfg)
    ema = Ema(engine, DECAY, warmup=True)
    trainable = [n for n, p in engine.named_parameters() if p.requires_grad]
    first = engine.full_params(master=True)  # a collective at ZeRO >= 1
    naive = {n: first[n].cpu().clone() for n in trainable}
    for k in range(STEPS):
        result = engine.step(Batch(*engine_batch(20 + k, rank, world)), objective)
        assert not result.skipped
        ema.update()
        snap = engine.full_params(master=True)
        d = _naive_decay(k)
        for n in trainable:
            naive[n] = naive[n] * d + snap[n].cpu().float() * (1.0 - d)
    out[stage, "raw"] = engine.consolidated_state_dict()
    out[stage, "ema"] = ema.consolidated_state_dict()
    out[stage, "naive"] = naive
    out[stage, "stage"] = engine.stage
    out[stage, "replicated"] = engine.master_replicated
    torch.save(ema.state_dict(), f"{ema_dir}/w{world}_z{stage[0]}{stage[1]}_rank{rank}.pt")


def _restore(cfg, stage, restore_from: int, ema_dir: str, out: dict) -> None:
    import shutil
    import tempfile
    from pathlib import Path

    from mmalign.layout.run_dir import ema_file
    from mmalign.models import build_model
    from mmalign.run.ema import Ema
    from mmalign.run.engine import Engine

    with tempfile.TemporaryDirectory() as step_dir:
        for r in range(restore_from):
            name = f"{ema_dir}/w{restore_from}_z{stage[0]}{stage[1]}_rank{r}.pt"
            shutil.copy(name, Path(step_dir) / ema_file(r))
        torch.manual_seed(77)  # other weights: the EMA must come from the files
        engine = Engine(build_model(cfg.model), cfg)
        fresh = Ema(engine, DECAY)
        fresh.restore(Path(step_dir))
        state = fresh.consolidated_state_dict()  # a collective
        trainable = [n for n, p in engine.named_parameters() if p.requires_grad]
        out[stage, "restored"] = {n: state[n] for n in trainable}
        out[stage, "restored_updates"] = fresh.updates


def _check_against_naive(results: dict, world: int) -> None:
    for stage in STAGES:
        ema, naive, raw = results[stage, "ema"], results[stage, "naive"], results[stage, "raw"]
        assert set(naive) <= set(ema)
        for name, want in naive.items():
            assert torch.equal(ema[name], want), (world, stage, name, (ema[name] - want).abs().max())
        # the premise: after 3 steps the average is not the raw weights (a test that could not fail)
        assert any(not torch.equal(ema[n], raw[n]) for n in naive), (world, stage)
        # frozen weights and buffers: the raw ones
        for name in set(raw) - set(naive):
            assert torch.equal(ema[name], raw[name]), (world, stage, name)


@pytest.mark.integration
def test_ema_equals_a_naive_ema_on_1_and_2_ranks_and_carries_over_world_sizes(tmp_path):
    one = run_ranks(_worker, 1, str(tmp_path), 0, pooled=True)[0]
    _check_against_naive(one, 1)
    two = run_ranks(_worker, 2, str(tmp_path), 1, pooled=True)
    assert [two[0][s, "stage"] for s in STAGES] == [0, 1, 2, 3, 0, 1]  # ZeRO-1/2/3 do partition on 2 ranks
    assert [two[0][s, "replicated"] for s in STAGES] == [True, False, False, False, True, False]
    _check_against_naive(two[0], 2)
    for stage in STAGES:  # every rank holds the same consolidated EMA
        assert all(
            torch.equal(two[0][stage, "ema"][n], two[1][stage, "ema"][n]) for n in two[0][stage, "ema"]
        )
        # 1 -> 2 ranks: the pieces one rank wrote, re-cut for two, give the same EMA
        for name in one[stage, "naive"]:
            assert torch.equal(two[0][stage, "restored"][name], one[stage, "ema"][name]), (stage, name)
        assert two[0][stage, "restored_updates"] == STEPS
    back = run_ranks(_worker, 1, str(tmp_path), 2, False, pooled=True)[0]  # 2 -> 1
    for stage in STAGES:
        for name in two[0][stage, "naive"]:
            assert torch.equal(back[stage, "restored"][name], two[0][stage, "ema"][name]), (stage, name)


def test_a_decay_outside_0_1_is_one_line(tmp_path):
    for bad in ("1.0", "-0.5", "1.5"):
        res = cli_main("train", "--output", tmp_path / "run", "--set", f"train.ema_decay={bad}")
        assert res.returncode == 2, res.stderr[-2000:]
        lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
        assert len(lines) == 1 and "train.ema_decay" in lines[0], res.stderr


def test_naive_decay_warms_up():
    from mmalign.run.ema import decay_at

    assert [decay_at(0.9, True, t) for t in range(3)] == [0.1, 2 / 11, 3 / 12]
    assert decay_at(0.9, True, 1000) == 0.9
    assert decay_at(0.9, False, 0) == 0.9


# ------------------------------------------------------------------ a whole run


def _sets(shapes_dir) -> list[str]:
    return [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=4",
        "train.warmup_steps=1",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=0",
        "train.log_every=2",
        "train.eval_every=2",
        f"train.ema_decay={DECAY}",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
    ]


def _args(sets) -> list[str]:
    return [a for s in sets for a in ("--set", s)]


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, shapes_dir):
    """A 4-step run with an EMA, checkpoints at steps 2 and 4, evaluated on the shapes suite."""
    out = tmp_path_factory.mktemp("ema") / "run"
    res = cli_main("train", "--output", out, *_args(_sets(shapes_dir)))
    assert res.returncode == 0, res.stderr[-2000:]
    return out, res.stdout, _sets(shapes_dir)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.integration
def test_a_run_writes_final_ema_and_evaluates_it_beside_the_raw_weights(ema_run):
    import json

    out, stdout, _ = ema_run
    config = json.loads((out / "final_ema" / "model_config.json").read_text())
    assert config["weights"] == "ema" and config["ema_updates"] == 4
    raw, ema = _weights(out / "final"), _weights(out / "final_ema")
    assert raw.keys() == ema.keys() and any(not torch.equal(raw[k], ema[k]) for k in raw)
    records = json.loads((out / "eval.json").read_text())
    plain = [r for r in records if "weights" not in r]
    averaged = [r for r in records if r.get("weights") == "ema"]
    assert len(plain) == len(averaged) == 3
    assert [r["dataset"] + "+ema" for r in plain] == [r["dataset"] for r in averaged]
    assert all(r["model"].endswith("+ema") for r in averaged)
    assert "shapes/shape+ema" in stdout and "shapes/shape:" in stdout  # the headline states both
    # the periodic evaluation runs on both too
    periodic = json.loads((out / "eval_step00000002.json").read_text())
    assert [r.get("weights") for r in periodic] == [None] * 3 + ["ema"] * 3
    # each rank's EMA piece is in the step checkpoints
    assert (out / "checkpoints" / "step_00000004" / "ema_rank0.pt").is_file()


@pytest.mark.integration
def test_load_reads_the_ema_of_a_run_and_of_a_step_checkpoint(ema_run):
    import mmalign
    from mmalign.errors import UsageError

    out, _, _ = ema_run
    ema = _weights(out / "final_ema")
    for path in (out, out / "final", out / "final_ema", out / "checkpoints" / "step_00000004"):
        state = mmalign.load(path, weights="ema").model.state_dict()
        for name, want in ema.items():
            assert torch.equal(state[name], want), (path, name)
    raw = mmalign.load(out / "checkpoints" / "step_00000004").model.state_dict()
    assert any(not torch.equal(raw[k], ema[k]) for k in ema)
    with pytest.raises(UsageError, match="--weights"):
        mmalign.load(out, weights="average")


@pytest.mark.integration
def test_a_resumed_run_ends_with_the_same_ema_as_a_straight_one(ema_run, tmp_path):
    import shutil

    out, _, sets = ema_run
    resumed = tmp_path / "run"
    shutil.copytree(out, resumed)
    for name in ("final", "final_ema", "checkpoints/step_00000004"):
        shutil.rmtree(resumed / name)
    (resumed / "eval.json").unlink()
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    res = cli_main("train", "--output", resumed, "--resume", "latest", *_args(sets))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed from" in res.stdout
    for folder in ("final", "final_ema"):
        want, got = _weights(out / folder), _weights(resumed / folder)
        for name in want:
            assert torch.equal(got[name], want[name]), (folder, name)


@pytest.mark.integration
def test_eval_weights_ema_and_a_run_without_an_ema(ema_run, micro_overrides):
    import json

    out, _, _ = ema_run
    res = cli_main("eval", "--model", out, "--weights", "ema")
    assert res.returncode == 0, res.stderr[-2000:]
    cli = json.loads((out / "eval_cli_shapes_ema.json").read_text())
    in_run = {r["dataset"]: r["metrics"] for r in json.loads((out / "eval.json").read_text())}
    for r in cli:
        assert r["model"].endswith("+ema")
        for key, value in r["metrics"].items():
            if isinstance(value, float):
                assert value == pytest.approx(in_run[r["dataset"] + "+ema"][key], abs=1e-6), (
                    r["dataset"],
                    key,
                )
    # a model without EMA weights: one line, exit 2
    raw_only = out.parent / "raw_only"
    raw_only.mkdir()
    import shutil

    shutil.copytree(out / "final", raw_only / "final")
    res = cli_main("eval", "--model", raw_only, "--weights", "ema")
    assert res.returncode == 2
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "holds no EMA weights" in lines[0], res.stderr


@pytest.mark.integration
def test_a_skipped_step_leaves_the_ema_alone(micro_overrides, monkeypatch):
    """The third of 4 steps has a NaN loss: it is skipped, and the EMA counts 3 updates."""
    import json

    import mmalign.run.train as train_mod
    from mmalign.config import load_config

    real, calls = train_mod.build_objective, {"n": 0}

    def build(*args, **kwargs):
        objective = real(*args, **kwargs)
        loss_for = objective.loss_for

        def poisoned(batch, **kw):
            loss = loss_for(batch, **kw)

            def run(emb):
                out = loss(emb)
                calls["n"] += 1
                if calls["n"] == 3:
                    out.loss = out.loss * float("nan")
                return out

            return run

        objective.loss_for = poisoned
        return objective

    monkeypatch.setattr(train_mod, "build_objective", build)
    sets = ["train.steps=4", "monitor.probe_size=0", "eval.suite=none", "train.ema_decay=0.5"]
    out = train_mod.train(load_config(None, micro_overrides + sets), show_progress=False)
    assert "step 3 skipped" in (out / "train.log").read_text()
    config = json.loads((out / "final_ema" / "model_config.json").read_text())
    assert config["ema_updates"] == 3
    assert all(torch.isfinite(v).all() for v in _weights(out / "final_ema").values())


@pytest.mark.integration
def test_a_2_rank_run_resumed_on_1_rank_carries_its_ema(shapes_dir, tmp_path):
    """ZeRO-2 on 2 ranks, checkpoint at step 2; the same run resumed on 1 rank (ZeRO-0 there)
    ends with the straight 2-rank run's EMA, to reduction order (the global batch is the same)."""
    import shutil

    from tests.harness import max_rel_error, run_cli

    sets = [s for s in _sets(shapes_dir) if not s.startswith("train.eval_every")]
    # a large Adam eps: a near-zero gradient's update is not its sign, so reduction order stays small
    sets += ["eval.suite=none", "deepspeed.zero_stage=2", "train.eps=1e-2"]
    straight = tmp_path / "straight"
    res = run_cli("train", "--nproc", "2", "--output", straight, *_args(sets))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    resumed = tmp_path / "resumed"
    shutil.copytree(straight / "checkpoints" / "step_00000002", resumed / "checkpoints" / "step_00000002")
    shutil.copy(straight / "config.yaml", resumed / "config.yaml")
    (resumed / "checkpoints" / "latest").write_text("step_00000002")
    res = cli_main("train", "--output", resumed, "--resume", "latest", *_args(sets))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resumed a 2-rank checkpoint on 1 rank(s)" in res.stdout, res.stdout[-2000:]
    raw_rel = max_rel_error(_weights(resumed / "final"), _weights(straight / "final"))
    rel, name = max_rel_error(_weights(resumed / "final_ema"), _weights(straight / "final_ema"))
    assert rel <= 1e-5, (name, rel, raw_rel)
    # the premise: the EMA is not the raw model
    raw = _weights(straight / "final")
    assert any(not torch.allclose(raw[k], v) for k, v in _weights(straight / "final_ema").items())
