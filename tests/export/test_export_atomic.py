"""Exports are atomic and never mix: a non-empty --out is refused unless --force, files
land in OUT.tmp and are renamed, a bad --out is one line (exit 2), and written files
follow the umask (0644 under 022)."""

from __future__ import annotations

import copy
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from mmalign.cli import main
from mmalign.data.transforms import preprocess_cfg
from mmalign.models import TwoTower
from mmalign.models.io import WEIGHTS, save_pretrained
from mmalign.models.presets import PRESETS


@pytest.fixture
def umask022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _model(path, seed=0, **vision):
    arch = copy.deepcopy(PRESETS["micro"])
    arch["vision_cfg"].update(vision)
    torch.manual_seed(seed)
    model = TwoTower(arch)
    save_pretrained(model, path, preprocess=preprocess_cfg(model.image_size))
    return model


def _modes(root):
    return {
        p.relative_to(root).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in root.rglob("*") if p.is_file()
    }


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmalign: error:") and "\n" not in err, err
    return err


def test_saved_and_exported_files_follow_the_umask(tmp_path, umask022):
    _model(tmp_path / "m")
    assert stat.S_IMODE((tmp_path / "m" / WEIGHTS).stat().st_mode) == 0o644
    for fmt in ("open_clip", "hf"):
        assert (
            main(["export", "--model", str(tmp_path / "m"), "--format", fmt, "--out", str(tmp_path / fmt)])
            == 0
        )
        modes = _modes(tmp_path / fmt)
        assert modes and set(modes.values()) == {0o644}, modes


def test_non_empty_out_is_refused_unless_force(tmp_path, capsys):
    model = _model(tmp_path / "m", seed=1)
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("someone's file")
    args = ["export", "--model", str(tmp_path / "m"), "--format", "open_clip", "--out", str(out)]
    assert main(args) == 2
    assert "not empty" in _one_line(capsys) and (out / "old.txt").read_text() == "someone's file"
    assert main(args + ["--force"]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["open_clip_config.json", "open_clip_model.safetensors"]
    assert torch.equal(
        load_file(str(out / "open_clip_model.safetensors"))["visual.proj"], model.state_dict()["visual.proj"]
    )
    assert not (tmp_path / "out.tmp").exists()
    (tmp_path / "empty").mkdir()  # an empty directory is fine without --force
    assert (
        main(
            [
                "export",
                "--model",
                str(tmp_path / "m"),
                "--format",
                "open_clip",
                "--out",
                str(tmp_path / "empty"),
            ]
        )
        == 0
    )


def test_invalid_out_is_one_line(tmp_path, capsys):
    _model(tmp_path / "m")
    (tmp_path / "file").write_text("x")
    for out in (tmp_path / "file", tmp_path / "file" / "sub", tmp_path / "m"):
        assert main(["export", "--model", str(tmp_path / "m"), "--format", "onnx", "--out", str(out)]) == 2
        _one_line(capsys)
    assert (tmp_path / "m" / WEIGHTS).is_file()


def test_failed_export_leaves_nothing(tmp_path, capsys):
    _model(tmp_path / "m", ls_init_value=0.1)  # no CLIPModel equivalent: export_hf raises midway
    assert (
        main(["export", "--model", str(tmp_path / "m"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    )
    assert "ls_init_value" in _one_line(capsys)
    assert not (tmp_path / "hf").exists() and not (tmp_path / "hf.tmp").exists()
