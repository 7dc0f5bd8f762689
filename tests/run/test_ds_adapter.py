"""mmalign.layout.ds_adapter (DeepSpeed's private layout) against DeepSpeed's public behaviour.

Every view the adapter takes of DeepSpeed's internals is compared with what DeepSpeed's
documented API says about the same thing: the flat-partition fragments with
``deepspeed.utils.safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state`` /
``safe_get_local_fp32_param``, the step counters and the checkpoint writer with the files
``save_checkpoint`` writes, the consolidation with ``get_fp32_state_dict_from_zero_checkpoint``.
A DeepSpeed upgrade that moves one of these privates fails here, by name.
"""

from __future__ import annotations

import logging
import pickle

import pytest
import torch

from tests.harness import engine_batch, engine_cfg, run_ranks

pytestmark = pytest.mark.integration

ADAM_STATE = ("exp_avg", "exp_avg_sq")


def _stepped_engine(stage: int, seed: int, world: int = 1, rank: int = 0):
    """A micro-tower engine at ZeRO ``stage`` after one AdamW step (so that moments exist)."""
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    cfg = engine_cfg(stage)
    torch.manual_seed(seed)
    engine = Engine(build_model(cfg.model), cfg)
    engine.step(Batch(*engine_batch(seed + 1, rank, world)), build_objective(cfg))
    assert engine.stage == stage
    return engine


@pytest.fixture
def at_configured_stage(monkeypatch):
    """One process keeps ZeRO-1/2 (the engine would otherwise run them at ZeRO-0, mmalign.run.zero_stage)."""
    from mmalign.run import engine as engine_module

    monkeypatch.setattr(engine_module, "effective_stage", lambda cfg, world: (cfg.deepspeed.zero_stage, None))


def _public_moment(p: torch.nn.Parameter, key: str) -> torch.Tensor | None:
    """``safe_get_full_optimizer_state(p, key)`` flattened, None where DeepSpeed 0.19.8 cannot say: at
    ZeRO-1/2 it links each parameter's optimizer state once, after the first group's first update
    (stage_1_and_2._optimizer_step), when the later groups hold no state yet."""
    from deepspeed.utils import safe_get_full_optimizer_state

    try:
        return safe_get_full_optimizer_state(p, key).reshape(-1)
    except ValueError as e:
        if "not found in optimizer state fragment" not in str(e):
            raise
        return None


def _fragments_against_public_api(engine, moments: bool = True) -> list[tuple[str, int, int, int]]:
    """Checks each fragment against DeepSpeed's public getters of the full fp32 value (a collective:
    every rank calls it for every trainable parameter) and, with ``moments`` (one rank: the
    getter's failure for a later group, :func:`_public_moment`, happens before its collective),
    of the optimizer state; returns (name, start, length, numel) per fragment of this rank."""
    from deepspeed.utils import safe_get_full_fp32_param

    from mmalign.layout import ds_adapter

    frags = {f.name: f for f in engine.partition_fragments()}
    parts = ds_adapter.partitions(engine.ds, engine.stage, engine.base_optimizer)
    out, compared = [], 0
    for name, p in engine.named_parameters():
        if not p.requires_grad:
            continue
        full = safe_get_full_fp32_param(p).reshape(-1)
        f = frags.get(name)
        if f is None:  # all of it on the other ranks
            continue
        assert f.param is p and any(f.partition is t for t in parts), name
        piece = f.partition.narrow(0, f.offset, f.length)
        assert torch.equal(piece, full[f.start : f.start + f.length]), name
        state = engine.base_optimizer.state[f.partition]
        for k in ADAM_STATE if moments else ():
            moment = _public_moment(p, k)
            if moment is not None:
                compared += 1
                assert torch.equal(
                    state[k].narrow(0, f.offset, f.length), moment[f.start : f.start + f.length]
                ), (name, k)
        out.append((name, f.start, f.length, full.numel()))
    assert sorted(frags) == sorted(n for n, _, _, _ in out)  # no fragment of a frozen or unknown parameter
    assert compared or not moments, (
        "DeepSpeed's getter gave some optimizer state (the premise of the comparison)"
    )
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_fragments_and_partitions_match_deepspeeds_public_getters(stage, seed, at_configured_stage):
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_local_fp32_param

    from mmalign.layout import ds_adapter

    engine = _stepped_engine(stage, seed)
    pieces = _fragments_against_public_api(engine)
    trainable = sorted(name for name, p in engine.named_parameters() if p.requires_grad)
    assert sorted(name for name, _, _, _ in pieces) == trainable
    assert all(start == 0 and length == numel for _, start, length, numel in pieces)  # one rank: whole
    p = engine.module.logit_scale
    assert ds_adapter.is_zero3(p) == (stage == 3)
    if stage == 3:
        for name, q in engine.named_parameters():
            partition, offset, size = ds_adapter.zero3_slot(engine.ds, q)
            local = safe_get_local_fp32_param(q).reshape(-1)
            assert torch.equal(partition.narrow(0, offset, local.numel()), local), name
            assert torch.equal(ds_adapter.local_partition(q).reshape(-1)[: local.numel()], local), name
    else:
        assert ds_adapter.local_partition(p) is p
        # the master fragment is a writable view: what DeepSpeed's getter reads afterwards
        master = ds_adapter.master_fragment(p)
        assert torch.equal(master, safe_get_full_fp32_param(p).reshape(-1))
        with torch.no_grad():
            master.add_(1.0)
        assert torch.equal(safe_get_full_fp32_param(p).reshape(-1), master)


def test_zero0_has_no_partitions_and_the_module_holds_the_weights(seed):
    from mmalign.layout import ds_adapter

    engine = _stepped_engine(0, seed)
    assert engine.partition_fragments() == []
    for _, p in engine.named_parameters():
        assert ds_adapter.master_fragment(p) is None and not ds_adapter.is_zero3(p)
        assert ds_adapter.local_partition(p) is p


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_counters_writer_resume_and_consolidation_agree_with_deepspeed(stage, seed, tmp_path, monkeypatch):
    """Per stage: the step counters are what save_checkpoint writes, the checkpoint writer is what
    every file goes through, the weights-only resume reads them (and refuses a pickle), and the
    consolidation equals DeepSpeed's own (the weights) and its public getters (the moments)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from mmalign.layout import ds_adapter
    from mmalign.run import engine as engine_module
    from mmalign.run import reshard

    if stage in (1, 2):
        monkeypatch.setattr(
            engine_module, "effective_stage", lambda cfg, world: (cfg.deepspeed.zero_stage, None)
        )
    engine = _stepped_engine(stage, seed)
    ds_adapter.set_step_counters(engine.ds, 7, 56, 2)
    writer, zipfile = ds_adapter.checkpoint_writer(engine)
    assert zipfile in (True, False)  # DeepSpeed's torch writer
    written, original = [], writer.save
    with ds_adapter.shadowed(
        writer, "save", lambda state_dict, path: (written.append(path), original(state_dict, path))
    ):
        engine.save_checkpoint(tmp_path, "t")
    assert "save" not in vars(writer)  # the class's method again
    files = sorted(str(f) for f in (tmp_path / "t").iterdir())
    assert sorted(written) == files and files

    states = ds_adapter.safe_load(reshard.model_states_file(tmp_path / "t"))
    assert (states["global_steps"], states["global_samples"], states["skipped_steps"]) == (7, 56, 2)

    planted = tmp_path / "planted.pt"
    planted.write_bytes(pickle.dumps(ValueError("a pickle that is not plain data")))
    with ds_adapter.weights_only_resume(engine.ds):
        loaded = engine.ds.checkpoint_engine.load(str(reshard.model_states_file(tmp_path / "t")))
        assert set(loaded["module"]) == set(engine.module.state_dict())
        with pytest.raises(pickle.UnpicklingError):
            engine.ds.checkpoint_engine.load(str(planted))
    assert "load" not in vars(engine.ds.checkpoint_engine)

    ours = ds_adapter.consolidate_checkpoint(tmp_path, "t")
    want = engine.consolidated_state_dict()
    assert sorted(ours) == sorted(want)
    if stage == 0:
        assert all(torch.equal(ours[k], want[k]) for k in want)
        with pytest.raises(ValueError, match="ZeRO-0"):
            ds_adapter.consolidate_checkpoint(tmp_path, "t", state_key="exp_avg")
        return
    theirs = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path), tag="t")
    assert set(theirs) <= set(ours)
    for k, v in theirs.items():
        assert torch.equal(ours[k], v.float()), k
    for key in ADAM_STATE:
        moments = ds_adapter.consolidate_checkpoint(tmp_path, "t", state_key=key)
        public = {name: _public_moment(p, key) for name, p in engine.named_parameters() if p.requires_grad}
        assert any(v is not None for v in public.values())
        for name, moment in public.items():
            if moment is not None:
                assert torch.equal(moments[name].reshape(-1), moment.float().cpu()), (name, key)


def _two_rank_fragments(rank: int, world: int, seed: int) -> dict:
    return {
        stage: _fragments_against_public_api(_stepped_engine(stage, seed, world, rank), moments=False)
        for stage in (2, 3)
    }


def test_fragments_on_two_ranks_cover_each_parameter_once(seed):
    """Two ranks: each rank's fragments equal DeepSpeed's full fp32 values and moments at their
    place, and the ranks' pieces of every parameter tile it exactly."""
    per_rank = run_ranks(_two_rank_fragments, 2, seed, timeout_s=300)
    for stage in (2, 3):
        pieces: dict[str, list] = {}
        for rank in (0, 1):
            for name, start, length, numel in per_rank[rank][stage]:
                pieces.setdefault(name, []).append((start, length, numel))
        assert pieces
        split = 0
        for name, got in pieces.items():
            numel = got[0][2]
            covered = sorted((s, s + n) for s, n, _ in got if n)
            assert covered[0][0] == 0 and covered[-1][1] == numel, (stage, name, covered)
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), (stage, name, covered)
            split += len(covered) > 1
        assert split, f"ZeRO-{stage}: some parameter is split over the two ranks (the premise of this test)"


def test_the_shm_op_builder_is_swapped_only_for_the_block():
    import importlib

    import mmalign.run.engine  # noqa: F401 (sets the CPU accelerator before DeepSpeed is imported)
    from mmalign.layout import ds_adapter

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")
    real = ds_comm_torch.build_shm_op
    with ds_adapter.without_shm_comm_op():
        assert ds_comm_torch.build_shm_op() is None
    assert ds_comm_torch.build_shm_op is real


def test_a_mismatching_deepspeed_version_is_one_warning_line(caplog, monkeypatch, seed):
    from mmalign.layout import ds_adapter

    with caplog.at_level(logging.WARNING, logger="mmalign.layout.ds_adapter"):
        assert ds_adapter.check_version(ds_adapter.WRITTEN_AGAINST) is None
        assert caplog.records == []
        line = ds_adapter.check_version("0.0.1-test")
        ds_adapter.check_version("0.0.1-test")  # once per process and version
    assert [r.getMessage() for r in caplog.records] == [line]
    assert "\n" not in line and "0.0.1-test" in line and ds_adapter.WRITTEN_AGAINST in line
    assert "mmalign/layout/ds_adapter.py" in line
    # and the engine checks the installed version when it is built
    caplog.clear()
    monkeypatch.setattr(ds_adapter, "WRITTEN_AGAINST", "0.0.2-test")
    monkeypatch.setattr(ds_adapter, "_warned_versions", set())
    with caplog.at_level(logging.WARNING, logger="mmalign.layout.ds_adapter"):
        _stepped_engine(0, seed)
    lines = [r.getMessage() for r in caplog.records if r.name == "mmalign.layout.ds_adapter"]
    assert len(lines) == 1 and "0.0.2-test" in lines[0], lines


def test_shadowed_restores_an_instance_attribute_or_the_class_method():
    from mmalign.layout import ds_adapter

    class Writer:
        def save(self):
            return "class"

    w = Writer()
    with ds_adapter.shadowed(w, "save", lambda: "block"):
        assert w.save() == "block"
    assert w.save() == "class" and "save" not in vars(w)
    w.save = lambda: "own"
    with pytest.raises(RuntimeError):
        with ds_adapter.shadowed(w, "save", lambda: "block"):
            raise RuntimeError("the block fails")
    assert w.save() == "own"
