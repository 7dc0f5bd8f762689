"""The distillation term with a live teacher (a saved model folder): its loss and gradients equal
the naive float64 reference fed the teacher's own encode_image / encode_text, with and without
gradient caching, and the teacher runs once per step whatever the number of chunks; a stored
teacher (the shards' teacher_*.npy members) gives the same training steps as the live one; a
teacher that cannot be loaded or whose tokenizer fails is one ConfigError line."""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pytest
import torch
from PIL import Image

from mmalign.config import ConfigError, load_config
from mmalign.data.batch import Batch
from mmalign.data.device import normalize_images
from mmalign.data.transforms import preprocess_cfg
from mmalign.models import build_model
from mmalign.models.io import save_pretrained
from mmalign.models.load import load
from mmalign.objective import build_objective
from mmalign.objective.distill import Distill, LiveTeacher
from mmalign.run.gradcache import grad_cache_step
from tests.harness import naive_clip_loss
from tests.harness.distill_ref import naive_distill

B = 6
CAPTIONS = [
    "a red circle",
    "a blue square on the left",
    "two green triangles",
    "a small dot",
    "a big cat",
    "x",
]


def _teacher(tmp_path, *extra: str) -> str:
    """A random micro model of another width saved as a model folder: the teacher."""
    cfg = load_config(None, ["model.preset=micro", "model.embed_dim=24", *extra])
    torch.manual_seed(1)
    model = build_model(cfg.model)
    out = tmp_path / "teacher"
    save_pretrained(model, out, preprocess=preprocess_cfg(model.image_size))
    return str(out)


def _student_cfg(teacher: str, *extra: str):
    return load_config(
        None, ["model.preset=micro", f"loss.distill.teacher={teacher}", "loss.distill.weight=0.8", *extra]
    )


def _batch(gen, model, captions=CAPTIONS) -> Batch:
    pixels = torch.randint(0, 256, (len(captions), 3, model.image_size, model.image_size), generator=gen)
    images = normalize_images(pixels.to(torch.uint8))  # (B, 3, S, S) as Batch.to leaves them
    from mmalign.models.tokenizers import build_tokenizer

    return Batch(images=images, tokens=build_tokenizer(model.arch)(captions), captions=list(captions))


def _reference(model, batch, teacher_dir, weight):
    """Full-batch float64 CLIP + weight x KL with the teacher's own encoders; the student's
    parameter gradients by one plain backward."""
    teacher = load(teacher_dir)
    tx = teacher.encode_image(batch.images).double()
    ty = teacher.encode_text(list(batch.captions)).double()
    ts = torch.tensor(teacher.logit_scale, dtype=torch.float64)
    model.zero_grad(set_to_none=True)
    out = model(batch.images, batch.tokens)
    x, y, s = out.image.double(), out.text.double(), out.logit_scale.double().reshape(())
    loss = naive_clip_loss(x, y, s) + weight * naive_distill(x, y, s, tx, ty, ts)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("chunks", [1, 3])
def test_live_teacher_equals_the_reference_and_runs_once_per_step(tmp_path, gen, chunks):
    teacher = _teacher(tmp_path)
    cfg = _student_cfg(teacher)
    torch.manual_seed(2)
    model = build_model(cfg.model)
    objective = build_objective(cfg, 1, model=model)
    term = next(t for t in objective.terms if isinstance(t, Distill))
    assert isinstance(term.teacher, LiveTeacher) and term.weight == 0.8
    assert not any(p.requires_grad for p in term.teacher.model.parameters())  # frozen
    assert not term.teacher.model.training  # eval mode
    batch = _batch(gen, model)
    want, want_grads = _reference(model, batch, teacher, 0.8)
    modes = []  # whether each teacher forward ran under inference mode
    for name in ("encode_image", "encode_text"):
        real = getattr(term.teacher.model, name)
        setattr(
            term.teacher.model,
            name,
            lambda x, real=real: modes.append(torch.is_inference_mode_enabled()) or real(x),
        )

    model.zero_grad(set_to_none=True)
    sizes = [B // chunks] * chunks
    bounds = [0, *np.cumsum(sizes).tolist()]
    step = grad_cache_step(
        lambda chunk: model(chunk.images, chunk.tokens),
        [batch.slice(i, j) for i, j in zip(bounds, bounds[1:])],
        objective.loss_for(objective.select(batch)),
        lambda surrogate: surrogate.backward(),
    )
    assert term.teacher.forwards == 1  # once per step, not once per chunk
    assert modes == [True, True]
    assert step.loss.item() == pytest.approx(want.item(), rel=1e-5)
    assert step.result.stats["distill_loss"] > 0
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == want_grads.keys()
    for name, g in grads.items():
        assert _rel(g, want_grads[name]) < 1e-4, name


def test_teacher_of_another_image_size_sees_the_images_resized(tmp_path, gen):
    teacher = _teacher(tmp_path, "model.vision.image_size=32")
    cfg = _student_cfg(teacher)
    model = build_model(cfg.model)
    term = next(t for t in build_objective(cfg, 1, model=model).terms if isinstance(t, Distill))
    assert term.teacher.size == (32, 32) != (model.image_size, model.image_size)
    batch = _batch(gen, model)
    image, text, scale = term.teacher(batch)
    assert image.shape == (B, 24) and text.shape == (B, 24)
    # the same pixels, resized: a student batch at the teacher's size gives (nearly) the same features
    loaded = load(teacher)
    big = torch.nn.functional.interpolate(
        batch.images, size=(32, 32), mode="bicubic", antialias=True, align_corners=False
    )
    assert torch.nn.functional.cosine_similarity(image, loaded.encode_image(big)).min() > 0.98
    assert scale.item() == pytest.approx(loaded.logit_scale, rel=1e-6)


def test_live_teacher_under_bf16_autocast_on_cpu_times_its_attention_outside_inference_mode(tmp_path, gen):
    from mmalign.models import attention_kernel

    teacher = _teacher(tmp_path)
    cfg = _student_cfg(teacher, "train.precision=bf16")
    model = build_model(cfg.model)
    term = next(t for t in build_objective(cfg, 1, model=model).terms if isinstance(t, Distill))
    batch = _batch(gen, model)
    before = attention_kernel.get_mode()
    attention_kernel.set_mode("auto")  # CPU bf16: each new shape class is timed, forward + backward
    try:
        image, text, _ = term.teacher(batch)  # timing a backward inside inference mode used to fail
    finally:
        attention_kernel.set_mode(before)
    loaded = load(teacher)
    cos = torch.nn.functional.cosine_similarity
    assert cos(image, loaded.encode_image(batch.images)).min() > 0.99  # bf16 against fp32
    assert cos(text, loaded.encode_text(list(batch.captions))).min() > 0.99


def test_with_gradient_caching_the_teacher_encodes_the_step_in_chunk_sized_pieces(tmp_path, gen):
    teacher = _teacher(tmp_path)
    cfg = _student_cfg(teacher, "train.grad_cache_chunk_size=4")
    model = build_model(cfg.model)
    term = next(t for t in build_objective(cfg, 1, model=model).terms if isinstance(t, Distill))
    assert term.teacher.rows == 4
    calls = []
    real = term.teacher.model.encode_image
    term.teacher.model.encode_image = lambda x: calls.append(len(x)) or real(x)
    batch = _batch(gen, model)
    image, text, _ = term.teacher(batch)
    assert calls == [4, 2] and term.teacher.forwards == 1  # every sample once, in one step's call
    loaded = load(teacher)
    assert _rel(image, loaded.encode_image(batch.images)) < 1e-6
    assert _rel(text, loaded.encode_text(list(batch.captions))) < 1e-6


def test_a_teacher_that_cannot_be_read_is_one_line(tmp_path):
    cfg = _student_cfg(str(tmp_path / "missing"))
    with pytest.raises(ConfigError) as err:
        build_objective(cfg)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config key 'loss.distill.teacher'") and "missing" in msg


def test_a_tokenizer_that_cannot_encode_the_captions_is_one_line(tmp_path, gen, monkeypatch):
    teacher = _teacher(tmp_path)
    cfg = _student_cfg(teacher)
    model = build_model(cfg.model)
    term = next(t for t in build_objective(cfg, 1, model=model).terms if isinstance(t, Distill))

    def refuse(captions):
        raise ValueError("character '\u2603' is not in the vocabulary\nsecond line")

    monkeypatch.setattr(term.teacher.loaded, "tokenizer", refuse)
    with pytest.raises(ConfigError) as err:
        term.teacher(_batch(gen, model))
    msg = str(err.value)
    assert "\n" not in msg and "tokenizer cannot encode" in msg and "loss.distill.teacher" in msg
    # and at start-up, before any step
    from mmalign.models import load as load_module

    real = load_module.load

    def broken(path, device="cpu"):
        loaded = real(path, device)
        loaded.tokenizer = refuse
        return loaded

    monkeypatch.setattr(load_module, "load", broken)
    with pytest.raises(ConfigError, match="tokenizer cannot encode"):
        build_objective(cfg, 1, model=model)


def test_weight_zero_or_no_teacher_adds_no_term(tmp_path):
    for extra in (["loss.distill.weight=0", "loss.distill.teacher=stored"], []):
        cfg = load_config(None, ["model.preset=micro", *extra])
        assert not any(isinstance(t, Distill) for t in build_objective(cfg).terms)


# ------------------------------------------------------------------ stored == live, through train()


def _write_shard(path, samples: dict[str, dict[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for key, members in samples.items():
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def _npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array.astype(np.float32), allow_pickle=False)
    return buf.getvalue()


@pytest.mark.integration
def test_stored_and_live_teacher_give_the_same_steps(tmp_path, monkeypatch):
    from mmalign.data.loader import build_train_loader
    from mmalign.data.transforms import train_transform
    from mmalign.models.tokenizers import build_tokenizer
    from mmalign.run.train import train

    rng = np.random.default_rng(0)
    samples = {}
    for i in range(16):
        image = Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8))
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        samples[f"s{i:03d}"] = {"png": buf.getvalue(), "txt": f"shape number {i} in colour {i % 3}".encode()}
    (tmp_path / "live").mkdir()
    (tmp_path / "stored").mkdir()
    _write_shard(tmp_path / "live" / "00000.tar", samples)
    teacher = _teacher(tmp_path)
    common = [
        "model.preset=micro",
        "data.workers=0",
        "data.shuffle_buffer=4",
        "train.global_batch_size=8",
        "train.grad_cache_chunk_size=4",  # cached: 2 chunks per step
        "train.steps=2",
        "train.warmup_steps=1",
        "train.optimizer=sgd",  # updates linear in the gradients (Adam turns rounding noise into steps)
        "train.lr=0.5",
        "train.log_every=1",
        "eval.suite=none",
        "loss.distill.weight=2.0",
        "seed=5",
    ]
    live_cfg = load_config(
        None,
        [
            *common,
            f"data.train={tmp_path}/live/00000.tar",
            f"loss.distill.teacher={teacher}",
            f"output={tmp_path}/run_live",
        ],
    )

    # the stored members: the teacher's own encoders on exactly the images and captions the run reads
    loaded = load(teacher)
    student = build_model(live_cfg.model)
    loader = build_train_loader(
        live_cfg.data,
        train_transform(student.image_size, live_cfg.data.augment),
        build_tokenizer(student.arch),
        16,
        seed=live_cfg.seed,
    )
    batch = next(iter(loader)).to("cpu")  # one epoch: every sample once
    image = loaded.encode_image(batch.images).numpy()
    text = loaded.encode_text(list(batch.captions)).numpy()
    for row, key in enumerate(batch.keys):
        samples[key] |= {
            "teacher_image.npy": _npy(image[row]),
            "teacher_text.npy": _npy(text[row]),
            "teacher_scale.npy": _npy(np.array([loaded.logit_scale])),
        }
    _write_shard(tmp_path / "stored" / "00000.tar", samples)

    calls = []
    real_call = LiveTeacher.__call__
    monkeypatch.setattr(LiveTeacher, "__call__", lambda self, b: calls.append(len(b)) or real_call(self, b))
    train(live_cfg, show_progress=False)
    assert calls == [8, 8]  # once per step on the whole local batch, not once per chunk of 4
    stored_cfg = load_config(
        None,
        [
            *common,
            f"data.train={tmp_path}/stored/00000.tar",
            "loss.distill.teacher=stored",
            f"output={tmp_path}/run_stored",
        ],
    )
    train(stored_cfg, show_progress=False)
    assert len(calls) == 2  # no teacher ran

    logs = [
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("run_live", "run_stored")
    ]
    steps = [[r for r in log if "distill_loss" in r] for log in logs]
    assert len(steps[0]) == len(steps[1]) == 2
    for a, b in zip(*steps):
        assert a["distill_loss"] == pytest.approx(b["distill_loss"], rel=1e-5)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    live, stored = load(tmp_path / "run_live"), load(tmp_path / "run_stored")
    for (name, a), (_, b) in zip(live.model.state_dict().items(), stored.model.state_dict().items()):
        # float32 rounding of the two paths (the stored vectors went through .npy): 1e-6 of the tensor's scale
        assert (a - b).abs().max() <= 1e-6 * a.abs().max().clamp_min(1.0), name
    # the steps moved the weights (equal updates, not two untouched models)
    assert steps[0][0]["lr"] > 0 and steps[0][0]["grad_norm"] > 0.1


# ------------------------------------------------------------------ the engine: ranks x caching x ZeRO

GLOBAL, LR, WEIGHT = 8, 0.5, 1.3


def _engine_inputs(seed: int):
    from tests.harness import clip_batch

    images, tokens = clip_batch(GLOBAL, seed)
    captions = [f"caption {i} of seed {seed % 7}" for i in range(GLOBAL)]
    return images, tokens, captions


def _engine_cfg(teacher: str, stage: int, chunk: int):
    return load_config(
        None,
        [
            "model.preset=micro",
            f"train.global_batch_size={GLOBAL}",
            "train.steps=1",
            "train.warmup_steps=0",
            "train.optimizer=sgd",
            f"train.lr={LR}",
            "train.weight_decay=0.0",
            f"train.grad_cache_chunk_size={chunk}",
            f"deepspeed.zero_stage={stage}",
            f"loss.distill.teacher={teacher}",
            f"loss.distill.weight={WEIGHT}",
        ],
    )


def _engine_worker(rank: int, world: int, teacher: str, model_seed: int, data_seed: int) -> dict:
    from mmalign.run.engine import Engine

    local = GLOBAL // world
    images, tokens, captions = _engine_inputs(data_seed)
    rows = slice(rank * local, (rank + 1) * local)
    results = {}
    for stage in (0, 3):
        for name, chunk in (("off", 0), ("uneven", 3)):
            cfg = _engine_cfg(teacher, stage, chunk)
            torch.manual_seed(model_seed)
            engine = Engine(build_model(cfg.model), cfg)
            objective = build_objective(cfg, world)
            term = next(t for t in objective.terms if isinstance(t, Distill))
            captured: dict = {}
            batch = Batch(images[rows], tokens[rows], captions=captions[rows])
            result = engine.step(
                objective.select(batch), objective, before_update=lambda: captured.update(engine.full_grads())
            )
            params = engine.consolidated_state_dict()
            if rank == 0:
                results[(stage, name)] = (
                    engine.plan.chunks,
                    term.teacher.forwards,
                    captured,
                    params,
                    result.stats,
                )
    return results


def _engine_reference(teacher: str, model_seed: int, data_seed: int):
    """One process, the full batch, one forward: float64 CLIP + weight x KL against the teacher's
    own encoders on the same images and captions, plain SGD."""
    images, tokens, captions = _engine_inputs(data_seed)
    loaded = load(teacher)
    tx = loaded.encode_image(images).double()
    ty = loaded.encode_text(captions).double()
    ts = torch.tensor(loaded.logit_scale, dtype=torch.float64)
    torch.manual_seed(model_seed)
    model = build_model(_engine_cfg(teacher, 0, 0).model)
    out = model(images, tokens)
    x, y, s = out.image.double(), out.text.double(), out.logit_scale.double().reshape(())
    (naive_clip_loss(x, y, s) + WEIGHT * naive_distill(x, y, s, tx, ty, ts)).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=LR).step()
    model.clamp_logit_scale()
    return grads, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.integration
@pytest.mark.parametrize("world", [1, 2])
def test_engine_step_equals_the_reference_on_ranks_with_caching(tmp_path, world, seed):
    from tests.harness import run_ranks

    teacher = _teacher(tmp_path)
    ref_grads, ref_params = _engine_reference(teacher, seed, seed + 1)
    results = run_ranks(_engine_worker, world, teacher, seed, seed + 1, pooled=True)[0]
    assert len(results) == 4
    for (stage, name), (chunks, forwards, grads, params, stats) in results.items():
        assert (len(chunks) > 1) == (name == "uneven"), chunks
        assert forwards == 1, (stage, name, forwards)  # once per step, whatever the chunks
        assert {"distill_loss", "contrastive_loss", "teacher_scale"} <= set(stats)
        for n, ref in ref_grads.items():
            assert _rel(grads[n], ref) <= 1e-5, (world, stage, name, "grad", n, _rel(grads[n], ref))
        for n, ref in ref_params.items():
            assert _rel(params[n], ref) <= 1e-5, (world, stage, name, "param", n, _rel(params[n], ref))


def test_a_teacher_by_name_from_the_hub_cache_and_an_uncached_one(tmp_path, monkeypatch, gen):
    from mmalign.export import export
    from tests.harness.hubcache import fabricate, offline_env

    folder = _teacher(tmp_path)
    export(folder, "open_clip", tmp_path / "oc")
    hf_home = tmp_path / "hf"
    fabricate(hf_home, "acme/teacher", tmp_path / "oc")
    offline_env(monkeypatch, hf_home)
    cfg = _student_cfg("hf-hub:acme/teacher")
    model = build_model(cfg.model)
    term = next(t for t in build_objective(cfg, 1, model=model).terms if isinstance(t, Distill))
    batch = _batch(gen, model)
    image, text, scale = term.teacher(batch)
    direct = load(folder)
    assert _rel(image, direct.encode_image(batch.images)) < 1e-5
    assert _rel(text, direct.encode_text(list(batch.captions))) < 1e-5
    assert scale.item() == pytest.approx(direct.logit_scale, rel=1e-6)
    with pytest.raises(ConfigError) as err:
        build_objective(_student_cfg("hf-hub:acme/missing"), 1, model=model)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config key 'loss.distill.teacher'") and "acme/missing" in msg


def test_mmalign_train_with_a_missing_teacher_is_one_line_before_the_run(tmp_path, shapes_dir):
    from tests.harness import cli_main

    sets = [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/00000.tar",
        "eval.suite=none",
        f"loss.distill.teacher={tmp_path / 'no_such_teacher'}",
        f"output={tmp_path / 'run'}",
    ]
    run = cli_main("train", *[a for s in sets for a in ("--set", s)])
    assert run.returncode == 2, run
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert (
        len(lines) == 1 and "config key 'loss.distill.teacher'" in lines[0] and "no_such_teacher" in lines[0]
    )
    assert not (tmp_path / "run").exists()  # refused before the run directory is made


@pytest.mark.integration
def test_mmalign_embed_teacher_shards_train_like_the_live_teacher(tmp_path):
    """End to end with the real writer: `mmalign embed --teacher-shards` (the teacher's eval crop)
    and a live teacher on training crops that are the same pixels (square images at the model's
    size, no crop augmentation) give the same steps; two captions per sample use the text row of
    the caption each step draws."""
    from mmalign.run.train import train
    from tests.harness import cli_main

    teacher = _teacher(tmp_path)
    size = load(teacher).model.image_size
    rng = np.random.default_rng(3)
    samples = {}
    for i in range(16):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, format="PNG")
        txt = f"item {i} in red\nitem {i} seen from above"
        samples[f"e{i:03d}"] = {"png": buf.getvalue(), "txt": txt.encode()}
    (tmp_path / "data").mkdir()
    _write_shard(tmp_path / "data" / "00000.tar", samples)
    run = cli_main(
        "embed", "--model", teacher, "--data", str(tmp_path / "data" / "00000.tar"),
        "--teacher-shards", str(tmp_path / "stored"),
    )  # fmt: skip
    assert run.returncode == 0, run
    common = [
        "model.preset=micro",
        "data.workers=0",
        "data.shuffle_buffer=4",
        "data.augment.crop_scale=[1.0, 1.0]",
        "data.augment.crop_ratio=[1.0, 1.0]",
        "train.global_batch_size=8",
        "train.grad_cache_chunk_size=4",
        "train.steps=3",  # into the second epoch: other captions drawn
        "train.warmup_steps=1",
        "train.optimizer=sgd",
        "train.lr=0.5",
        "train.log_every=1",
        "eval.suite=none",
        "seed=11",
    ]
    for name, data, source in (
        ("run_live", tmp_path / "data" / "00000.tar", teacher),
        ("run_stored", tmp_path / "stored" / "00000.tar", "stored"),
    ):
        cfg = load_config(
            None,
            [*common, f"data.train={data}", f"loss.distill.teacher={source}", f"output={tmp_path / name}"],
        )
        train(cfg, show_progress=False)
    logs = [
        [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        for run in ("run_live", "run_stored")
    ]
    steps = [[r for r in log if "distill_loss" in r] for log in logs]
    assert len(steps[0]) == len(steps[1]) == 3
    for a, b in zip(*steps):
        assert a["distill_loss"] == pytest.approx(b["distill_loss"], rel=1e-4)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    live, stored = load(tmp_path / "run_live"), load(tmp_path / "run_stored")
    for (name, a), (_, b) in zip(live.model.state_dict().items(), stored.model.state_dict().items()):
        assert (a - b).abs().max() <= 1e-5 * a.abs().max().clamp_min(1.0), name
