"""``--weights ema`` on the commands that read a model folder (issue 42, point 5): ``mmalign embed``
reads the run's ``final_ema/``, exactly as when that folder is given itself; a step checkpoint's
EMA, which only ``eval`` and ``export`` read, is one line for it."""

from __future__ import annotations

import numpy as np
import pytest

from tests.harness import cli_main

pytestmark = pytest.mark.integration


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
