"""A damaged or foreign model folder is a one-line error (exit 2) for `eval`, `export` and
`mmalign.load`, never a traceback: truncated or non-safetensors weights, invalid or
non-object JSON, no arch, weights of another shape."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from mmalign.config import ModelConfig
from mmalign.errors import UsageError


@pytest.fixture(scope="module")
def good_folder(tmp_path_factory):
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained

    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="micro"))
    return save_pretrained(model, tmp_path_factory.mktemp("good") / "final", preprocess=preprocess_cfg(16))


def _damage(kind: str, good, tmp_path):
    d = tmp_path / kind
    shutil.copytree(good, d)
    weights, config = d / "model.safetensors", d / "model_config.json"
    if kind == "truncated_weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "not_safetensors":
        torch.save({"x": torch.zeros(2)}, weights)  # a pickle under the safetensors name
    elif kind == "invalid_json":
        config.write_text("{not json")
    elif kind == "list_json":
        config.write_text("[1, 2]")
    elif kind == "missing_arch":
        c = json.loads(config.read_text())
        del c["arch"]
        config.write_text(json.dumps(c))
    elif kind == "shape_mismatch":
        c = json.loads(config.read_text())
        c["arch"]["embed_dim"] = 48  # the weights were saved at 32
        config.write_text(json.dumps(c))
    return d


KINDS = {
    "truncated_weights": "not a readable safetensors file",
    "not_safetensors": "not a readable safetensors file",
    "invalid_json": "is not valid JSON",
    "list_json": "must hold a JSON object, got list",
    "missing_arch": "no usable 'arch'",
    "shape_mismatch": "does not fit its model_config.json: shape of",
}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_mmalign_load_raises_one_line(kind, good_folder, tmp_path):
    from mmalign.pretrained import load

    d = _damage(kind, good_folder, tmp_path)
    with pytest.raises(UsageError) as err:
        load(d)
    assert KINDS[kind] in str(err.value) and "\n" not in str(err.value) and str(d) in str(err.value)


def test_the_good_folder_loads(good_folder):
    from mmalign.pretrained import load

    assert load(good_folder).encode_text(["a red circle"]).shape == (1, 32)


@pytest.mark.integration
@pytest.mark.parametrize(
    "kind, command",
    [
        ("truncated_weights", "eval"),
        ("list_json", "export"),
        ("shape_mismatch", "eval"),
        ("missing_arch", "export"),
    ],
)
def test_cli_eval_and_export_exit_2_in_one_line(kind, command, good_folder, tmp_path, capsys):
    from mmalign.cli import main

    d = _damage(kind, good_folder, tmp_path)
    args = (
        ["eval", "--model", str(d), "--out", str(tmp_path / "e.json")]
        if command == "eval"
        else ["export", "--model", str(d), "--format", "open_clip", "--out", str(tmp_path / "x")]
    )
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("mmalign: error:") and KINDS[kind] in err, err
