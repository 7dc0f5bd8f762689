"""``train.tf32``: which torch backend flags :func:`mmalign.run.tf32.set_tf32` sets (stand-in backends,
so it runs on CPU), the config key, and that training's setup calls it with the run's device."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from mmalign.config import ConfigError, load_config
from mmalign.run.tf32 import set_tf32


def _new_api():
    return SimpleNamespace(
        cuda=SimpleNamespace(matmul=SimpleNamespace(fp32_precision="none")),
        cudnn=SimpleNamespace(conv=SimpleNamespace(fp32_precision="none")),
    )


def _legacy_api():  # torch before 2.9: allow_tf32 flags only
    return SimpleNamespace(
        cuda=SimpleNamespace(matmul=SimpleNamespace(allow_tf32=False)), cudnn=SimpleNamespace(allow_tf32=True)
    )


@pytest.mark.parametrize("enabled, mode", [(True, "tf32"), (False, "ieee")])
def test_cuda_sets_matmul_and_conv(enabled, mode):
    b = _new_api()
    assert set_tf32(torch.device("cuda", 0), enabled, backends=b) is True
    assert b.cuda.matmul.fp32_precision == mode and b.cudnn.conv.fp32_precision == mode
    old = _legacy_api()
    assert set_tf32("cuda", enabled, backends=old) is True
    assert old.cuda.matmul.allow_tf32 is enabled and old.cudnn.allow_tf32 is enabled


def test_cpu_is_left_alone():
    b, old = _new_api(), _legacy_api()
    assert set_tf32(torch.device("cpu"), True, backends=b) is False
    assert set_tf32("cpu", False, backends=old) is False
    assert b.cuda.matmul.fp32_precision == "none" and b.cudnn.conv.fp32_precision == "none"
    assert old.cuda.matmul.allow_tf32 is False and old.cudnn.allow_tf32 is True


def test_the_installed_torch_has_the_new_api():
    # set_tf32 picks torch's per-backend fp32_precision where it exists (mixing it with the legacy
    # flags makes torch raise on reading them): the pinned torch must take that branch
    assert hasattr(torch.backends.cuda.matmul, "fp32_precision")
    assert hasattr(torch.backends.cudnn.conv, "fp32_precision")


def test_config_key():
    assert load_config(None, []).train.tf32 is True
    assert load_config(None, ["train.tf32=false"]).train.tf32 is False
    with pytest.raises(ConfigError, match="config key 'train.tf32'"):
        load_config(None, ["train.tf32=1"])


def test_training_setup_sets_it(monkeypatch, tmp_path):
    """train's _setup calls set_tf32 with the picked device and train.tf32 (stopped right after)."""
    from mmalign.run import train

    class Stop(Exception):
        pass

    seen = []

    def fake(device, enabled):
        seen.append((device, enabled))
        raise Stop

    monkeypatch.setattr(train, "set_tf32", fake)
    monkeypatch.setattr(
        train.mdist, "init_from_env", lambda **k: train.mdist.DistInfo()
    )  # one process, no group
    monkeypatch.setattr(train.mdist, "barrier", lambda: None)
    monkeypatch.setattr(train, "check_buildable", lambda m: None)
    monkeypatch.setattr(train, "check_train_shards", lambda *a: None)
    monkeypatch.setattr(train, "resolve_suite", lambda cfg: None)
    cfg = load_config(None, ["train.tf32=false", "train.device=cpu", f"output={tmp_path / 'run'}"])
    try:
        with pytest.raises(Stop):
            train._setup(cfg, None, False, model_checked=False)
    finally:  # _setup's train.log handler on the "mmalign" logger is this test's
        logger = logging.getLogger("mmalign")
        for h in [h for h in logger.handlers if isinstance(h, logging.FileHandler)]:
            logger.removeHandler(h)
            h.close()
    assert seen == [(torch.device("cpu"), False)]
