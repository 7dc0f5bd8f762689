"""No code runs from a model folder: a planted pickle (whose payload would write a marker
file) is never unpickled with code execution, whichever command reads the folder.

Every command that takes ``--model`` (export, embed, search, serve, mine) reads it
through ``mmalign.models.load.load``; the CLI's export is driven end to end.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mmalign.cli import main
from mmalign.config import ConfigError, load_config, save_config
from mmalign.data.transforms import preprocess_cfg
from mmalign.errors import UsageError
from mmalign.models import TwoTower
from mmalign.models.io import save_pretrained
from mmalign.models.load import load
from mmalign.models.presets import PRESETS
from mmalign.run import checkpoint


class _Payload:
    """Unpickling this (without weights_only) writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"module": _Payload(marker)}, path)


def _saved_model(path: Path) -> TwoTower:
    torch.manual_seed(3)
    model = TwoTower(copy.deepcopy(PRESETS["micro"]), init_logit_scale=math.log(17.0))
    save_pretrained(model, path, preprocess=preprocess_cfg(model.image_size))
    return model


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmalign: error:") and "\n" not in err, err
    return err


def test_model_folder_with_planted_engine_uses_the_safetensors(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    folder = tmp_path / "model"
    model = _saved_model(folder)
    plant(folder / "engine" / "mp_rank_00_model_states.pt", marker)
    plant(folder / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt", marker)

    loaded = load(folder)
    assert loaded.kind == "model" and not marker.exists()
    assert (
        main(["export", "--model", str(folder), "--format", "open_clip", "--out", str(tmp_path / "oc")]) == 0
    )
    assert not marker.exists()
    exported = load_file(str(tmp_path / "oc" / "open_clip_model.safetensors"))
    assert torch.equal(exported["visual.proj"], model.state_dict()["visual.proj"])


def _fake_run(root: Path) -> Path:
    """A run directory layout (config.yaml + checkpoints/step_N/engine/) without DeepSpeed."""
    root.mkdir()
    save_config(load_config(None, ["model.preset=micro"]), root / "config.yaml")
    step = root / "checkpoints" / "step_00000002"
    (step / "engine").mkdir(parents=True)
    return step


@pytest.mark.parametrize(
    "planted",
    [
        "mp_rank_00_model_states.pt",  # ZeRO-0: our own torch.load
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    ],
)  # ZeRO 1-3: zero_to_fp32's
def test_planted_pickle_in_a_step_checkpoint_is_a_one_line_error(tmp_path, capsys, planted):
    marker = tmp_path / "MARKER"
    step = _fake_run(tmp_path / "run")
    if planted.endswith("optim_states.pt"):
        # a weights-only-loadable model-states file, so zero_to_fp32 goes on to the optimizer file
        torch.save(
            {"module": {}, "buffer_names": [], "param_shapes": [{}], "shared_params": {}, "ds_version": "0"},
            step / "engine" / "mp_rank_00_model_states.pt",
        )
    plant(step / "engine" / planted, marker)
    assert main(["export", "--model", str(step), "--format", "open_clip", "--out", str(tmp_path / "oc")]) == 2
    err = _one_line_error(capsys)
    assert "not a plain weights file" in err and str(step) in err
    assert not marker.exists() and not (tmp_path / "oc").exists()


def test_engine_folder_outside_checkpoints_is_not_a_checkpoint(tmp_path, capsys):
    marker = tmp_path / "MARKER"
    folder = tmp_path / "somewhere"
    folder.mkdir()
    save_config(load_config(None, ["model.preset=micro"]), folder.parent / "config.yaml")
    plant(folder / "engine" / "mp_rank_00_model_states.pt", marker)
    with pytest.raises(UsageError, match="no mmalign model"):
        load(folder)
    assert main(["export", "--model", str(folder), "--format", "hf", "--out", str(tmp_path / "o")]) == 2
    _one_line_error(capsys)
    assert not marker.exists()


def test_latest_names_only_a_sibling_step(tmp_path):
    run = tmp_path / "run"
    elsewhere = tmp_path / "x"
    (elsewhere / "engine").mkdir(parents=True)
    (run / "checkpoints").mkdir(parents=True)
    for bad in ("../../x", str(elsewhere), "step_1/../../../x", "step_00000002.tmp"):
        (run / "checkpoints" / "latest").write_text(bad)
        with pytest.raises(ConfigError, match="not a step_N checkpoint"):
            checkpoint.resolve(run, "latest")
    step = run / "checkpoints" / "step_00000002"
    (step / "engine").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    assert checkpoint.resolve(run, "latest") == step
    assert checkpoint.resolve(run, str(step)) == step
    with pytest.raises(
        ConfigError, match="RUN/checkpoints/step_N"
    ):  # an explicit path must look like one too
        checkpoint.resolve(run, str(elsewhere))
