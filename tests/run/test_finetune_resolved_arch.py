"""Fine-tuning with the config a model was trained with (issue 28, point 11): ``model.preset``
next to ``model.pretrained`` is compared with the export's architecture *after* the config's
own overrides (``model.text.context_length: 16`` in the quickstart recipe), not as the bare
preset; a genuinely different architecture is still refused, naming the setting."""

from __future__ import annotations

import pytest
import torch

from mmalign.config import ConfigError, load_config
from mmalign.data.transforms import preprocess_cfg
from mmalign.models import build_model, check_buildable
from mmalign.models.io import save_pretrained
from tests.harness import ROOT

QUICKSTART = ROOT / "configs" / "quickstart.yaml"
MICRO_8 = ["model.preset=micro", "model.text.context_length=8"]  # the preset's own is 16


def _export(tmp_path, config, overrides, seed):
    """What a run of ``config`` + ``overrides`` leaves in final/ (random weights: no training)."""
    torch.manual_seed(seed)
    model = build_model(load_config(config, overrides).model)
    save_pretrained(model, tmp_path / "run" / "final", preprocess=preprocess_cfg(model.image_size))
    return tmp_path / "run", model


def test_the_same_resolved_config_fine_tunes_its_own_export(tmp_path, seed):
    run, source = _export(tmp_path, None, MICRO_8, seed)
    cfg = load_config(None, MICRO_8 + [f"model.pretrained={run}"])
    check_buildable(cfg.model)  # the start-up check of `mmalign train`
    model = build_model(cfg.model)
    assert model.arch["text_cfg"]["context_length"] == 8
    got, want = model.state_dict(), source.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)  # the export's weights, loaded


def test_the_quickstart_recipe_with_preset_tiny_fine_tunes_its_own_export(tmp_path, seed):
    """The issue's command: --config configs/quickstart.yaml --set model.preset=tiny, then the same
    with --set model.pretrained=EXPORT (tiny's context is 32, the recipe's 16)."""
    run, _ = _export(tmp_path, QUICKSTART, ["model.preset=tiny"], seed)
    cfg = load_config(QUICKSTART, ["model.preset=tiny", f"model.pretrained={run}"])
    assert check_buildable(cfg.model).arch["text_cfg"]["context_length"] == 16


@pytest.mark.parametrize(
    "overrides, setting",
    [
        (
            ["model.preset=micro"],
            "text_cfg.context_length: 16 vs 8",
        ),  # the preset's context, not the export's
        (MICRO_8 + ["model.vision.width=64"], "vision_cfg.width: 64 vs 32"),
        (MICRO_8 + ["model.embed_dim=48"], "embed_dim: 48 vs 32"),
    ],
)
def test_a_different_architecture_is_still_refused_naming_the_setting(tmp_path, seed, overrides, setting):
    run, _ = _export(tmp_path, None, MICRO_8, seed)
    cfg = load_config(None, overrides + [f"model.pretrained={run}"])
    with pytest.raises(ConfigError) as err:
        check_buildable(cfg.model)
    msg = str(err.value)
    assert (
        msg.startswith("config key 'model.preset': 'micro' differs from the architecture") and setting in msg
    )
    assert "\n" not in msg
