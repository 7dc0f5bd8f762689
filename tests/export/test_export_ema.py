"""``mmalign export --weights ema`` (issue 42, point 5): the EMA weights a run kept, from its
``final_ema/`` or from a step checkpoint, exported; the export reloads with the EMA model's own
embeddings, not the raw model's."""

from __future__ import annotations

import pytest
import torch

from tests.harness import cli_main

pytestmark = pytest.mark.integration


def _embeddings(loaded) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    images = torch.randn(4, 3, loaded.model.image_size, loaded.model.image_size, generator=g)
    return loaded.encode_image(images), loaded.encode_text(["a red circle", "a blue square"])


@pytest.mark.parametrize("source", ["run", "checkpoint"])
def test_export_weights_ema_carries_the_ema_model(ema_run, tmp_path, source):
    import mmalign

    model = ema_run if source == "run" else ema_run / "checkpoints" / "step_00000002"
    out = tmp_path / "oc"
    res = cli_main("export", "--model", model, "--weights", "ema", "--format", "open_clip", "--out", out)
    assert res.returncode == 0, res.stderr[-2000:]
    got = _embeddings(mmalign.load(out))
    want = _embeddings(mmalign.load(ema_run, weights="ema"))
    raw = _embeddings(mmalign.load(ema_run))
    for g, w, r in zip(got, want, raw):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(g, r, atol=1e-6)  # the premise: the EMA is not the raw model


def test_export_weights_ema_of_a_model_without_one_is_one_line(ema_run, tmp_path):
    res = cli_main(
        "export", "--model", ema_run / "final", "--weights", "ema", "--format", "hf", "--out", tmp_path / "x"
    )
    assert res.returncode == 0, res.stderr  # final/'s sibling final_ema/ is the run's EMA
    lonely = tmp_path / "lonely"
    import shutil

    shutil.copytree(ema_run / "final", lonely)
    res = cli_main("export", "--model", lonely, "--weights", "ema", "--format", "hf", "--out", tmp_path / "y")
    assert res.returncode == 2
    lines = [line for line in res.stderr.strip().splitlines() if line.strip()]
    assert len(lines) == 1 and "holds no EMA weights" in lines[0], res.stderr
    assert not (tmp_path / "y").exists()
