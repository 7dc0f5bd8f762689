"""The config is declared and flows load -> resolve -> validate once (issue 29, point 3):
domains live in field metadata and one validator reads them, string modes are Literal types,
validate() is pure, resolve() holds the derived values, and the CLI validates once at the
world size the run trains on."""

from __future__ import annotations

import copy
import dataclasses
import typing
from typing import Literal

import pytest

import mmalign.config as config_mod
from mmalign.config import Config, ConfigError, build_config, load_config, resolve, save_config, validate
from mmalign.config.checks import Span, check_domains, fields_of, knob
from mmalign.config.schema import LossConfig


def test_domains_are_field_metadata_and_the_generic_validator_reads_them():
    @dataclasses.dataclass
    class Toy:  # a key declared only here: no table elsewhere knows it
        budget: float = knob(1.0, rule=Span(0, 10, note="0 = off"), unit="seconds", doc="a toy budget")

    check_domains(Toy())
    with pytest.raises(ConfigError) as err:
        check_domains(Toy(budget=11.0))
    assert str(err.value) == "config key 'budget' must be in [0, 10] seconds (0 = off), got 11.0"
    ((key, value, f),) = fields_of(Toy)
    assert (key, value, f.metadata["unit"], f.metadata["doc"]) == ("budget", 1.0, "seconds", "a toy budget")


def test_a_bound_that_is_another_key_is_declared_too():
    from mmalign.config import doc as config_doc

    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.steps=50", "train.warmup_steps=60"])
    assert str(err.value) == "config key 'train.warmup_steps' must be in [0, train.steps=50], got 60"
    assert "| `train.warmup_steps` | int | `20` | in [0, train.steps] |" in config_doc.table()


def test_every_leaf_declares_a_meaning_in_its_metadata():
    missing = [key for key, _, f in fields_of(Config) if not f.metadata.get("doc")]
    assert missing == []


def test_string_modes_are_literal_types():
    hints = typing.get_type_hints(LossConfig)
    assert typing.get_args(hints["positive_mask"]) == ("none", "attribute_subset")  # was `str`
    assert typing.get_origin(hints["name"]) is Literal
    with pytest.raises(
        ConfigError,
        match=r"config key 'loss.positive_mask': expected one of 'none' \| "
        r"'attribute_subset', got 'maybe'",
    ):
        build_config(None, ["loss.positive_mask=maybe"])


def test_a_unit_is_named_in_the_one_line_error():
    with pytest.raises(ConfigError) as err:
        load_config(None, ["dist.timeout_s=-1"])
    assert str(err.value).startswith("config key 'dist.timeout_s' must be in [0, 86400] seconds (0 = 600 s")


DERIVING = [  # overrides whose config resolve() changes, and the key it fills
    (["loss.false_negative_ids=label"], "data.id_field", "label"),
    (["model.lock_image=true", "model.lock_image_freeze_bn_stats=true"], "model.batchnorm", "frozen"),
    ([], "model.preset", "tiny"),
    (["model.vision={patch_dropout: 0.5}"], "model.patch_dropout", 0.5),
]


def _get(cfg, dotted):
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


@pytest.mark.parametrize("overrides, key, want", DERIVING, ids=[k for _, k, _ in DERIVING])
def test_validate_is_pure_and_resolve_fills_the_derived_values(overrides, key, want):
    cfg = build_config(None, overrides)
    before = copy.deepcopy(cfg)
    validate(cfg)  # the old validate() filled `key` here
    assert cfg == before
    resolve(cfg)
    assert _get(cfg, key) == want
    again = copy.deepcopy(cfg)
    assert resolve(cfg) == again  # idempotent: a saved (resolved) config loads back equal
    assert load_config(None, overrides) == cfg


def test_validate_is_pure_with_a_tokenizer(tmp_path):
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a red square {i} and a blue circle {i % 7}" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "t"),
        vocab_size=40,
        model_type="unigram",
        minloglevel=2,
    )
    cfg = build_config(None, [f"model.tokenizer={tmp_path / 't.model'}"])
    validate(cfg)
    assert cfg.model.text == {}  # the old validate() wrote vocab_size and tokenizer_kwargs here
    resolve(cfg)
    assert cfg.model.text["vocab_size"] == 43 and "tokenizer_kwargs" in cfg.model.text
    with pytest.raises(
        ConfigError, match="'model.text.vocab_size'=10 is smaller than the tokenizer's 43 ids"
    ):
        load_config(None, [f"model.tokenizer={tmp_path / 't.model'}", "model.text.vocab_size=10"])


def test_resolve_does_not_derive_from_a_value_outside_its_domain():
    # '' is no field name: copying it into data.id_field would blame the wrong key
    cfg = resolve(build_config(None, ["loss.false_negative_ids="]))
    assert cfg.data.id_field is None
    with pytest.raises(ConfigError, match="^config key 'loss.false_negative_ids'"):
        validate(cfg)


def test_load_config_validates_once(monkeypatch):
    calls = []
    real = config_mod.validate
    monkeypatch.setattr(
        config_mod, "validate", lambda cfg, world_size=1: calls.append(world_size) or real(cfg, world_size)
    )
    load_config(None, [], world_size=2)
    assert calls == [2]


def test_the_world_size_is_the_one_validation_knows():
    # global 128, chunk 64: one accumulation step per rank at 2 ranks, two in one process
    keys = ["deepspeed.precision=bf16", "train.grad_cache_chunk_size=64"]
    load_config(None, keys, world_size=2)  # was refused: load_config validated at world 1 first
    with pytest.raises(ConfigError, match="deepspeed.precision"):
        load_config(None, keys)
    with pytest.raises(ConfigError, match="not divisible by the world size 3") as e:
        load_config(None, [], world_size=3)
    # the valid layouts, named: the world sizes 128 rows allow
    assert str(e.value).endswith("the world sizes it allows are 1, 2, 4, 8, 16, 32, 64, 128")


def test_validate_chunk_checks_the_chunk_auto_became():
    cfg = load_config(None, ["deepspeed.precision=bf16", "train.grad_cache_chunk_size=auto"])
    cfg.train.grad_cache_chunk_size = 32  # what the memory plan chose: 4 chunks summed at ZeRO-0
    with pytest.raises(ConfigError, match="deepspeed.precision"):
        config_mod.validate_chunk(cfg, 1)
    cfg.train.grad_cache_chunk_size = 0
    config_mod.validate_chunk(cfg, 1)


def test_memory_plan_rechecks_only_the_chunk(monkeypatch):
    pytest.importorskip("torch")
    from mmalign.run import memory_plan

    monkeypatch.setattr(config_mod, "validate", lambda *a, **k: pytest.fail("validate ran twice"))
    cfg = build_config(None, ["train.grad_cache_chunk_size=auto"])
    resolved = memory_plan.resolved_config(cfg, 16)
    assert resolved.train.grad_cache_chunk_size == 16 and cfg.train.grad_cache_chunk_size == "auto"


@pytest.mark.parametrize(
    "env, nproc, want",
    [
        ({}, 1, 1),
        ({}, 4, 4),
        ({"RANK": "1", "WORLD_SIZE": "3"}, 1, 3),
        ({"RANK": "0", "WORLD_SIZE": "2"}, 2, 2),  # a rank --nproc spawned
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "5"}, 1, 5),
        ({"WORLD_SIZE": "8"}, 1, 1),
    ],
)
def test_the_cli_world_size_is_what_the_ranks_will_see(env, nproc, want):
    pytest.importorskip("torch")
    from mmalign import cli
    from mmalign.dist.distributed import env_dist_info

    assert cli._world_size(nproc, env) == want
    if nproc == 1 or "RANK" in env:  # no --nproc spawning: the ranks read the same variables
        assert env_dist_info(env).world_size == want


def test_cmd_train_loads_at_the_run_world_size(monkeypatch, tmp_path):
    from mmalign import cli

    seen = []

    def fake_load(path, overrides, world_size=1):
        seen.append(world_size)
        raise ConfigError("stop here")

    monkeypatch.setattr(config_mod, "load_config", fake_load)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ConfigError, match="stop here"):
        cli.cmd_train(
            cli.build_parser().parse_args(["train", "--nproc", "2", "--output", str(tmp_path / "r")])
        )
    assert seen == [2]


def test_save_config_round_trips_a_resolved_config(tmp_path):
    cfg = load_config(None, ["loss.false_negative_ids=label", "model.vision={patch_dropout: 0.25}"])
    save_config(cfg, tmp_path / "c.yaml")
    assert load_config(tmp_path / "c.yaml") == cfg
