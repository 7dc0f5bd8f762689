"""``--weights ema`` on the commands that read a model folder (issue 42, point 5): ``mmalign embed``
reads the run's ``final_ema/``, exactly as when that folder is given itself; a step checkpoint's
EMA, which only ``eval`` and ``export`` read, is one line for it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import cli_main

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory, shapes_dir):
    out = tmp_path_factory.mktemp("weights_ema") / "run"
    sets = [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=2",
        "train.warmup_steps=1",
        "train.checkpoint_every=2",
        "train.ema_decay=0.5",
        "train.ema_warmup=false",
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        "eval.suite=none",
    ]
    res = cli_main("train", "--output", out, *[a for s in sets for a in ("--set", s)])
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def _embed(model, data, out, *flags) -> np.ndarray:
    res = cli_main("embed", "--model", model, "--data", data, "--out", out, *flags)
    assert res.returncode == 0, res.stderr[-2000:]
    return np.load(out / "img_emb" / "img_emb_0.npy")


def test_embed_weights_ema_reads_final_ema(ema_run, shapes_dir, tmp_path):
    data = shapes_dir / "val" / "00000.tar"
    ema = _embed(ema_run, data, tmp_path / "ema", "--weights", "ema")
    folder = _embed(ema_run / "final_ema", data, tmp_path / "folder")
    raw = _embed(ema_run, data, tmp_path / "raw")
    assert np.array_equal(ema, folder)
    assert not np.allclose(ema, raw, atol=1e-6)  # the premise: the EMA is not the raw model


def test_embed_weights_ema_of_a_step_checkpoint_is_one_line(ema_run, shapes_dir, tmp_path):
    step = ema_run / "checkpoints" / "step_00000002"
    res = cli_main(
        "embed", "--model", step, "--data", shapes_dir / "val", "--out", tmp_path / "x", "--weights", "ema"
    )
    assert res.returncode == 2
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "step checkpoint" in lines[0] and "mmalign export" in lines[0], res.stderr
    assert not (tmp_path / "x" / "embed.json").exists()
