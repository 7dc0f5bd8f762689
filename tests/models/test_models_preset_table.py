"""`mmalign models` reads a shipped table (mmalign.models.preset_table) instead of building 148
presets (83-93 s on 2 cores, issue 39): the table's rows against models built on the meta
device, its preset list against open_clip's own registry, and a stale row rebuilt."""

from __future__ import annotations

import pytest

from mmalign.models import preset_table
from tests.harness import cli_main

SPREAD = [
    "micro",
    "tiny-rn",
    "RN50",
    "ViT-B-32",
    "ViT-B-16-SigLIP",
    "convnext_base",
]  # ViT, ResNet, HF text, timm


def test_the_preset_list_is_open_clips_registry_read_without_importing_it():
    from mmalign.models import presets

    archs = preset_table.architectures()
    assert list(archs) == presets.available()  # names and order, open_clip imported here
    for name in archs:
        assert archs[name] == presets.preset_arch(name), name


def test_the_shipped_table_has_a_current_row_for_every_preset():
    # fails after an open_clip upgrade or a preset edit: run python -m mmalign.models.preset_table --write
    assert preset_table.stale() == []


@pytest.mark.parametrize("name", SPREAD)
def test_a_row_is_what_building_the_preset_counts(name):
    from mmalign.config import ModelConfig
    from mmalign.errors import ConfigError
    from mmalign.models import check_buildable

    row = preset_table.read_table()[name]
    try:
        model = check_buildable(
            ModelConfig(preset=name)
        )  # the meta-device model: its parameters, counted here
    except ConfigError:
        assert not row["offline"] and row["params"] is None
        return
    assert row["offline"] and row["params"] == sum(p.numel() for p in model.parameters())
    assert row["image_size"] == model.image_size


@pytest.mark.slow
def test_every_row_is_what_building_the_preset_counts():
    table = preset_table.read_table()
    for name in preset_table.architectures():
        row = {k: v for k, v in table[name].items() if k != "fingerprint"}
        assert row == preset_table.build_row(name), name


def test_a_changed_preset_is_built_and_announced(monkeypatch):
    every = preset_table.architectures()
    changed = dict(every["micro"], embed_dim=every["micro"]["embed_dim"] * 2)  # no longer the counted arch
    monkeypatch.setattr(preset_table, "architectures", lambda: {"micro": changed, "tiny": every["tiny"]})
    built = []
    real = preset_table.build_row
    monkeypatch.setattr(preset_table, "build_row", lambda name: built.append(name) or real(name))
    res = cli_main("models")
    assert res.returncode == 0 and built == ["micro"]
    lines = res.stdout.splitlines()
    assert lines[0].startswith(
        "mmalign: counting the parameters of 1 preset(s) not in the shipped table (micro)"
    )
    assert [ln.split()[0] for ln in lines[2:4]] == ["micro", "tiny"]
