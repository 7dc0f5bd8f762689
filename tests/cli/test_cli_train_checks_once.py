"""``mmalign train`` checks the model config once per process (issue 40): the meta-device build
(``check_buildable``: the towers and the tokenizer) runs before the run directory's lock, and
the training run reuses that verdict instead of building the meta model a second time. A
library ``train(cfg)`` still checks it itself."""

from __future__ import annotations

import pytest

from tests.harness import cli_main

pytestmark = pytest.mark.integration


def _counted(monkeypatch) -> list[str]:
    import mmalign.models
    import mmalign.run.train

    calls: list[str] = []
    real = mmalign.models.check_buildable

    def counted(cfg):
        calls.append(cfg.preset)
        return real(cfg)

    monkeypatch.setattr(mmalign.models, "check_buildable", counted)  # what mmalign train imports
    monkeypatch.setattr(mmalign.run.train, "check_buildable", counted)  # what train() calls
    return calls


def test_the_cli_builds_the_meta_model_once(micro_overrides, tmp_path, monkeypatch):
    calls = _counted(monkeypatch)
    args = ["train", "--output", tmp_path / "run"]
    for o in micro_overrides + [
        "train.steps=1",
        "train.warmup_steps=0",
        "eval.suite=none",
        "monitor.probe_size=0",
    ]:
        if not o.startswith("output="):
            args += ["--set", o]
    res = cli_main(*args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert calls == ["micro"]


def test_a_bad_tower_is_still_one_line_from_the_cli(tmp_path, micro_overrides):
    args = ["train", "--output", tmp_path / "run"]
    for o in micro_overrides + ["model.vision.patch_size=x"]:
        if not o.startswith("output="):
            args += ["--set", o]
    res = cli_main(*args)
    assert res.returncode == 2
    line = res.stderr.strip().splitlines()[-1]
    assert "config key 'model': the towers of preset 'micro' cannot be built" in line, res.stderr
