"""Each config key's own domain (its field metadata, mmalign/config/schema.py): the holes of
issue 28, every key declaring one, the shipped recipes still inside it, and values that used to crash the parser."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

import pytest

from mmalign.config import Config, ConfigError, load_config
from mmalign.config.checks import domains, leaves
from mmalign.resources import recipe_path
from tests.harness import ROOT


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.betas=[1.5,0.9]", "train.betas"),  # was torch's "Invalid beta parameter" traceback
        ("model.preset=", "model.preset"),  # was a traceback
        ("monitor.min_dim_std=-1", "monitor.min_dim_std"),  # was accepted: the collapse alarm never fired
        ("train.grad_clip=-1", "train.grad_clip"),  # was accepted
        ("loss.false_negative_ids=", "loss.false_negative_ids"),  # trained 69 s, then blamed the data
        ("loss.false_negative_ids='  '", "loss.false_negative_ids"),
        ("data.id_field=", "data.id_field"),  # the same .json field, named by the loader's key
    ],
)
def test_the_holes_of_issue_28_are_one_line_at_load(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "configs" / "quickstart.yaml", [override])
    msg = str(err.value)
    assert msg.startswith(f"config key '{key}'") and "\n" not in msg


def _plain(tp) -> bool:
    """Annotations that are their own whole domain: bools, enums (Literal) and free mappings."""
    if typing.get_origin(tp) is Literal:
        return True
    if typing.get_origin(tp) is typing.Union:
        return all(_plain(a) for a in typing.get_args(tp) if a is not type(None))
    return (typing.get_origin(tp) or tp) in (bool, dict)  # dict[str, Any]: a free mapping


def test_every_key_that_is_not_a_bool_an_enum_or_a_mapping_has_a_domain():
    hints = {}

    def walk(cls, prefix=""):
        for f in dataclasses.fields(cls):
            tp = typing.get_type_hints(cls)[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, prefix + f.name + ".")
            else:
                hints[prefix + f.name] = tp

    walk(Config)
    assert [k for k, _ in leaves(Config())] == list(hints)
    need = {k for k, tp in hints.items() if not _plain(tp)}
    assert sorted(need - set(domains(Config))) == []  # a new key needs a rule= in its knob's metadata


@pytest.mark.parametrize(
    "name", ["quickstart", "cifar10_cpu", "finetune_cifar10_cpu", "vitb16_laion_gpu", "vitb32_laion_gpu"]
)
def test_the_shipped_recipes_are_inside_every_domain(name):
    for path in (recipe_path(name), ROOT / "configs" / f"{name}.yaml"):  # the packaged copy, the checkout's
        # finetune's model.pretrained (models/X) is made by the recipe it fine-tunes; while there is no
        # models/ folder it reads as a hub id ORG/NAME, resolved (or refused in one line) at start-up
        load_config(path)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=" + "1" * 400, "train.lr"),  # an int too large for a float: was OverflowError
        ("train.steps=" + "1" * 5000, "train.steps"),  # more digits than Python parses: was ValueError
        ("train.betas=" + "[" * 3000, "train.betas"),  # nesting deeper than the stack: was RecursionError
        ("train.betas=&a [0.9, *a]", "train.betas"),  # a list that holds itself
        ("deepspeed.extra=&a {x: *a}", "deepspeed.extra"),  # a mapping that holds itself: walked forever
        ("model.vision=&a {x: [*a]}", "model.vision"),
        ("output=" + "d" * 300 + "/run", "output"),  # a name over the file system's limit: was OSError
        ('output="ru\\0n"', "output"),  # a NUL byte: was ValueError from the OS
        ("seed=" + str(2**64), "seed"),  # torch.manual_seed refuses it
        ("dist.timeout_s=1e300", "dist.timeout_s"),  # timedelta overflows
        ("model.init_logit_bias=1e39", "model.init_logit_bias"),  # inf once it is a float32 weight
        ("data.augment.color_jitter=[.inf, 0, 0, 0]", "data.augment.color_jitter"),
        ("data.train_weights=[.inf]", "data.train_weights"),
        ("train.threads=100000", "train.threads"),
    ],
)
def test_values_that_crashed_or_slipped_through_are_one_line(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert key in msg and "\n" not in msg and len(msg) < 400


def test_a_yaml_file_that_crashed_the_loader_is_one_line(tmp_path):
    for name, text in (
        ("deep.yaml", "train:\n  betas: " + "[" * 3000 + "\n"),
        ("digits.yaml", "train:\n  steps: " + "7" * 5000 + "\n"),
    ):
        path = tmp_path / name
        path.write_text(text)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
