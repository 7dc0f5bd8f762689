"""``train.compile``: the towers under torch.compile give the eager step's loss and gradients.

Reference: plain autograd on the same eager model (same init), the symmetric CLIP loss written
out, the chunks forwarded one after the other as the gradient cache's first pass does.  The
batch of 8 in chunks of 3 leaves an uneven last chunk (3, 3, 2): the compiled towers see a
second batch size (one recompile, with a dynamic batch dimension) inside the step.

The fast tests compile with ``aot_eager`` (torch's AOTAutograd tracing, the graphs run by aten:
the same capture as inductor without its C++ code generation, which costs minutes on two
cores); the ``slow`` one compiles with inductor.
"""

from __future__ import annotations

import pytest
import torch

from tests.harness import chunkwise_clip_loss, clip_batch, max_rel_error, run_ranks

BATCH, CHUNK = 8, 3
BROKEN = "mmalign_test_broken"  # a backend registered by the worker that always fails


def _model(seed: int, dropout: float = 0.0):
    """micro towers; with ``dropout``, a Dropout at the end of every block's MLP."""
    from mmalign.config import ModelConfig
    from mmalign.models import build_model

    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="micro"))
    if dropout:
        for tower in (model.visual, model.text):
            for block in tower.transformer.resblocks:
                block.mlp.add_module("drop", torch.nn.Dropout(dropout))
    return model


def _reference(
    model_seed: int, data_seed: int, step_seed: int, chunk: int, dropout: float = 0.0, backend: str = ""
) -> tuple[float, dict]:
    """Plain autograd loss and gradients, the chunks forwarded in order (the first pass's order
    of random draws); ``backend``: the towers compiled with it (dropout masks are then the
    compiled graph's, drawn from the same global generator)."""
    model = _model(model_seed, dropout)
    if backend:
        for tower in (model.visual, model.text):
            tower.compile(backend=backend)
    images, tokens = clip_batch(BATCH, data_seed)
    torch.manual_seed(step_seed)
    size = chunk or BATCH
    outs = [model(images[i : i + size], tokens[i : i + size]) for i in range(0, BATCH, size)]
    loss = chunkwise_clip_loss(outs)
    loss.backward()
    return loss.item(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _cfg(chunk: int, compile_: bool, backend: str):
    from mmalign.config import load_config

    return load_config(
        None,
        [
            "model.preset=micro",
            f"train.global_batch_size={BATCH}",
            f"train.grad_cache_chunk_size={chunk}",
            "train.steps=1",
            "train.warmup_steps=0",
            "train.optimizer=sgd",
            "train.weight_decay=0.0",
            f"train.compile={str(compile_).lower()}",
            f"train.compile_backend={backend}",
        ],
    )


def _worker(
    rank: int,
    world: int,
    model_seed: int,
    data_seed: int,
    step_seed: int,
    backend: str,
    dropout: float,
    runs: tuple,
) -> dict:
    """{(compiled, chunk): (loss, full gradients, state_dict keys, consolidated keys, graphs captured)}
    after one step."""
    from torch._dynamo.utils import counters

    from mmalign.data.batch import Batch
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    images, tokens = clip_batch(BATCH, data_seed)
    results = {}
    for compiled, chunk in runs:
        cfg = _cfg(chunk, compiled, backend)
        model = _model(model_seed, dropout)
        engine = Engine(model, cfg)
        counters.clear()
        captured = {}
        torch.manual_seed(step_seed)
        out = engine.step(
            Batch(images, tokens),
            build_objective(cfg),
            before_update=lambda: captured.update(engine.full_grads()),
        )
        assert not out.skipped
        results[compiled, chunk] = (
            float(out.loss),
            captured,
            list(engine.module.state_dict()),
            list(engine.consolidated_state_dict()),
            counters["stats"]["unique_graphs"],
        )
    return results


@pytest.mark.integration
def test_compiled_steps_equal_eager_and_plain_autograd(seed):
    model_seed, data_seed, step_seed = seed, seed + 1, seed + 2
    runs = ((True, 0), (False, CHUNK), (True, CHUNK))
    results = run_ranks(_worker, 1, model_seed, data_seed, step_seed, "aot_eager", 0.0, runs, pooled=True)[0]
    keys = list(_model(model_seed).state_dict())
    # the eager engine's cached step (the uncached one is tested against plain autograd elsewhere)
    eager_loss, eager_grads, *_ = results[False, CHUNK]
    assert results[False, CHUNK][4] == 0 and results[True, CHUNK][4] > 0  # graphs were captured
    for chunk in (0, CHUNK):
        loss, grads, names, consolidated, _ = results[True, chunk]
        # the compiled towers keep their names: no `_orig_mod.` anywhere
        assert names == keys and sorted(consolidated) == sorted(keys), chunk
        assert abs(loss - eager_loss) <= 1e-5 * abs(eager_loss), (chunk, loss, eager_loss)
        err, name = max_rel_error(grads, eager_grads)
        assert err <= 1e-5, (chunk, name, err)
        ref_loss, ref = _reference(model_seed, data_seed, step_seed, chunk)
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (chunk, loss, ref_loss)
        err, name = max_rel_error(grads, ref)
        assert err <= 1e-5, (chunk, name, err)


@pytest.mark.integration
def test_compiled_cached_step_replays_dropout(seed):
    """Dropout inside the compiled graphs: the cached step's re-forwards, under the RNG state the
    first pass recorded, draw the first pass's masks (equal to plain autograd with the same
    compiled towers forwarding the chunks in order), and other masks give other gradients."""
    model_seed, data_seed, step_seed = seed, seed + 1, seed + 2
    results = run_ranks(
        _worker, 1, model_seed, data_seed, step_seed, "aot_eager", 0.2, ((True, CHUNK),), pooled=True
    )[0]
    loss, grads, *_ = results[True, CHUNK]
    ref_loss, ref = _reference(model_seed, data_seed, step_seed, CHUNK, 0.2, "aot_eager")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    err, name = max_rel_error(grads, ref)
    assert err <= 1e-5, (name, err)
    _, other = _reference(model_seed, data_seed, step_seed + 1, CHUNK, 0.2, "aot_eager")
    err, name = max_rel_error(other, ref)
    assert err > 1e-3, (name, err)


def _failing_worker(rank: int, world: int) -> tuple[str, str]:
    """(the first step's error with a failing backend, the error for an unknown backend name)."""
    import torch._dynamo

    from mmalign.config import ConfigError
    from mmalign.data.batch import Batch
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    def broken(gm, example_inputs):
        raise RuntimeError("no C++ compiler found\nsecond line of the compiler's output")

    torch._dynamo.register_backend(broken, name=BROKEN)
    images, tokens = clip_batch(BATCH, 0)
    messages = []
    for backend in (BROKEN, "no_such_backend"):
        cfg = _cfg(0, True, backend)
        try:
            engine = Engine(_model(0), cfg)  # compiling is lazy: a known backend fails at the first step
            engine.step(Batch(images, tokens), build_objective(cfg))
        except ConfigError as e:
            messages.append((str(e), e.__cause__, e.__suppress_context__))
    return messages


@pytest.mark.integration
def test_compiler_failure_is_one_config_error_line():
    (step_error, cause, suppressed), (name_error, _, _) = run_ranks(_failing_worker, 1, pooled=True)[0]
    assert "\n" not in step_error and cause is None and suppressed, step_error
    assert step_error.startswith("config key 'train.compile'"), step_error
    assert "no C++ compiler found" in step_error and "set train.compile: false" in step_error, step_error
    assert "\n" not in name_error and name_error.startswith("config key 'train.compile_backend'"), name_error
    assert "no_such_backend" in name_error, name_error


@pytest.mark.slow
@pytest.mark.integration
def test_inductor_compiled_steps_equal_eager(seed):
    """The same with inductor (C++ code generation on CPU; minutes on two cores)."""
    model_seed, data_seed, step_seed = seed, seed + 1, seed + 2
    runs = ((False, CHUNK), (True, CHUNK), (True, 0))
    # fresh ranks: inductor's compile workers are processes of this rank's that would outlive the task
    results = run_ranks(_worker, 1, model_seed, data_seed, step_seed, "inductor", 0.0, runs, timeout_s=1500)[
        0
    ]
    ref_loss, ref = _reference(model_seed, data_seed, step_seed, 0)
    for chunk in (0, CHUNK):
        loss, grads, names, *_ = results[True, chunk]
        assert names == list(ref), chunk
        assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (chunk, loss, ref_loss)
        err, name = max_rel_error(grads, ref)
        assert err <= 1e-5, (chunk, name, err)
    err, name = max_rel_error(results[True, CHUNK][1], results[False, CHUNK][1])
    assert err <= 1e-5, (name, err)


def test_compile_refused_under_zero3():
    from mmalign.config import ConfigError, load_config

    with pytest.raises(
        ConfigError, match=r"^config key 'train\.compile': not supported with deepspeed\.zero_stage=3"
    ):
        load_config(None, ["train.compile=true", "deepspeed.zero_stage=3"])
    assert load_config(None, ["train.compile=true", "deepspeed.zero_stage=2"]).train.compile


def _patch_dropout_worker(rank: int, world: int, model_seed: int, data_seed: int, step_seed: int) -> dict:
    """{(compiled, patch_dropout): (loss, full gradients)} of one cached step (chunks 3, 3, 2)."""
    from mmalign.data.batch import Batch
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine

    images, tokens = clip_batch(BATCH, data_seed)
    out = {}
    for compiled, p in ((False, 0.5), (True, 0.5), (False, 0.0)):
        cfg = _cfg(CHUNK, compiled, "aot_eager")
        cfg.model.patch_dropout = p
        torch.manual_seed(model_seed)
        engine = Engine(build_model(cfg.model), cfg)
        captured = {}
        torch.manual_seed(step_seed)
        result = engine.step(
            Batch(images, tokens),
            build_objective(cfg),
            before_update=lambda: captured.update(engine.full_grads()),
        )
        out[compiled, p] = (result.loss.item(), captured)
    return out


@pytest.mark.integration
def test_compiled_cached_step_with_patch_dropout_equals_eager(seed):
    """FLIP patch dropout inside the compiled image tower: the cached step (whose re-forwards
    replay the masks) equals the eager cached step (aot_eager runs the same aten random ops on
    the same generator), and the masks matter (no patch dropout gives other gradients)."""
    r = run_ranks(_patch_dropout_worker, 1, seed, seed + 1, seed + 2, pooled=True)[0]
    (loss, grads), (eager_loss, eager) = r[True, 0.5], r[False, 0.5]
    assert abs(loss - eager_loss) <= 1e-5 * abs(eager_loss), (loss, eager_loss)
    err, name = max_rel_error(grads, eager)
    assert err <= 1e-5, (name, err)
    err, name = max_rel_error(r[False, 0.0][1], eager)
    assert err > 1e-3, (name, err)
