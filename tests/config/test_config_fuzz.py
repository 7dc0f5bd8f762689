"""Seeded fuzz of every typed config key: invalid values, given the way the CLI takes them
(``--set key=value``, parsed by ``parse_override``, then ``load_config`` and the towers'
meta-device build that ``mmalign train`` runs before anything else), are each one
ConfigError line naming the key, never another exception and never accepted.

The invalid values come from each key's annotation (a wrong type, NaN / inf, a number no
int64 / float32 holds, an empty or NUL-holding string, a nonsense enum) plus this file's own
short spec of which numbers a key refuses (every count refuses a negative, the probabilities
refuse > 1, ...); it does not read mmalign/config/checks.py, so a missing check there fails here.
"""

from __future__ import annotations

import dataclasses
import random
import string
import types
import typing
from typing import Literal, Union

import pytest

from mmalign.config import Config, ConfigError, load_config
from tests.harness import ROOT, cli_main

# Keys where a negative number is meaningful (a SigLIP bias starts at -10).
NEGATIVE_OK = {"model.init_logit_bias"}
# Numbers of which 0 is no valid value either.
ZERO_INVALID = {
    "train.steps",
    "train.global_batch_size",
    "train.log_every",
    "train.max_consecutive_skips",
    "train.lr",
    "train.eps",
    "train.layer_decay",
    "train.lr_image",
    "train.lr_text",
    "data.shuffle_buffer",
    "data.views",
    "data.max_image_pixels",
    "data.max_consecutive_skips",
    "data.max_member_bytes",
    "data.remote_timeout",
    "model.embed_dim",
    "model.image_size",
    "model.max_logit_scale",
    "loss.tile_budget_mb",
    "loss.image_image_temperature",
    "eval.batch_size",
}
# Numbers bounded above by 1: probabilities, momenta, fractions, betas' parts, Adam's eps.
AT_MOST_ONE = {
    "model.patch_dropout",
    "data.augment.color_jitter_prob",
    "data.augment.grayscale_prob",
    "data.augment.blur_prob",
    "train.momentum",
    "train.layer_decay",
    "train.eps",
    "loss.debias_prior",
    "loss.momentum",
    "monitor.min_dim_std",
    "monitor.min_effective_rank_frac",
}
# Strings for which "" is a documented value (no validation data; no evaluation).
EMPTY_OK = {"data.val", "eval.suite"}
# Strings with a fixed vocabulary (or a path that must exist): a random word is no value.
CLOSED_STRINGS = {
    "train.device",
    "loss.positive_mask",
    "model.preset",
    "model.tokenizer",
    "model.pretrained",
    "model.pretrained_image",
    "model.pretrained_text",
    "model.timm_weights",
}
# The list keys' own shape: a pair / quadruple in a range, ordered for [lo, hi] ranges.
LISTS = {
    "data.augment.crop_scale": ["[0.9, 0.1]", "[0, 0.5]", "[0.5, 1.5]", "[0.5]"],
    "data.augment.crop_ratio": ["[2, 1]", "[0, 1]", "[1, 5000]"],
    "data.augment.blur_sigma": ["[2, 1]", "[0, 1]", "[1, 5000]"],
    "data.augment.color_jitter": ["[0.1, 0.1, 0.1, 0.9]", "[0.4, 0.4]", "[-1, 0, 0, 0]", "[.inf, 0, 0, 0]"],
    "train.betas": ["[1.5, 0.9]", "[0.9, 1.0]", "[-0.1, 0.9]", "[0.9]", "[0.9, 0.98, 0.5]"],
    "data.train_weights": ["[-1]", "[0]", "[.inf]", "[a]"],
    "data.train": ["[]", "['']", "[1, 2]"],
    "eval.during": [
        "[1]",
        "[{suite: shapes}]",
        "[{suite: shapes, every: 0}]",
        "[{suite: shapes, every: 2, evry: 3}]",
        "[{suite: '', every: 2}]",
        "[{suite: shapes, every: 2, limit: 0}]",
        "[{suite: shapes, every: 1.5}]",
    ],
}


def typed_keys(cls=Config, prefix=""):
    """``(dotted key, annotation)`` of every leaf of the config dataclasses."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            yield from typed_keys(tp, prefix + f.name + ".")
        else:
            yield prefix + f.name, tp


def kinds(tp) -> set:
    """The plain kinds an annotation admits: int, float, str, bool, list, dict, 'literal', 'auto'."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return set().union(*(kinds(a) for a in typing.get_args(tp) if a is not type(None)))
    if origin is Literal:
        return {"auto"} if typing.get_args(tp) == ("auto",) else {"literal"}
    if origin in (list, dict):  # list[float], a list of entries (eval.during; in LISTS), dict[str, Any]
        return {origin}
    return {tp}


def word(rng: random.Random) -> str:
    return "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 12)))


def invalid_values(key: str, tp, rng: random.Random) -> list[str]:
    """``--set`` value texts that ``key`` must refuse: fixed cases plus seeded random draws."""
    k = kinds(tp)
    out: list[str] = []
    if k & {int, float}:
        out += ["abc", "[1, 2]", "{a: 1}", "true"]
        if int in k and float not in k:
            out += ["1.5", str(rng.randint(2**63, 2**90)), "1" * 5000]
        if float in k:
            out += [".nan", ".inf", "-.inf", f"{rng.uniform(1e39, 1e300):.6e}", "1" * 400]
        if key not in NEGATIVE_OK:
            out += [str(-rng.randint(1, 10**9)), "-1"]
            if float in k:
                out.append(f"{-rng.uniform(1e-6, 1e6):.6g}")
        if key in ZERO_INVALID:
            out.append("0")
        if key in AT_MOST_ONE:
            out += [f"{rng.uniform(1.001, 1e6):.6g}", "1.5"]
    if "literal" in k:
        out += [word(rng) + "-" + word(rng), "3", "[a]"]
    if bool in k:
        out += ["maybe", "2", "[true]"]
    if str in k:
        out += ["[a, b]" if list not in k else "{a: 1}", '"a\\0b"']  # YAML's \0: a NUL character
        if key not in EMPTY_OK:
            out += ["''", "'  '"]
        if key in CLOSED_STRINGS:
            out.append(f"{word(rng)}/{word(rng)}-nowhere")
    if list in k:
        out += ["abc" if str not in k else "{a: 1}", "&a [*a]"]  # a YAML anchor: a list that holds itself
        out += LISTS.get(key, ["[]"])
    if dict in k:
        out += ["3", "abc", "[1, 2]", "&a {x: *a}"]
    return out


def _refusal(key: str, text: str) -> str:
    """The one-line refusal of ``key=text`` where the CLI gives it, or why there is none."""
    from mmalign.models import check_buildable

    try:
        cfg = load_config(None, [f"{key}={text}"])
        if key.startswith("model."):
            check_buildable(cfg.model)  # what `mmalign train` runs next, before any process starts
    except ConfigError as e:
        msg = str(e)
        if "\n" in msg or key not in msg:
            return f"{key}={text[:60]!r}: not one line naming the key: {msg[:200]!r}"
        return ""
    except Exception as e:  # noqa: BLE001 - exactly what this test exists to catch
        return f"{key}={text[:60]!r}: {type(e).__name__}: {str(e)[:160]}"
    return f"{key}={text[:60]!r}: accepted"


def test_every_typed_key_refuses_invalid_values_in_one_line(seed):
    rng = random.Random(seed)
    keys = list(typed_keys())
    assert len(keys) > 90  # the walk found the whole config, not one section
    problems, tried = [], 0
    for key, tp in keys:
        values = invalid_values(key, tp, rng)
        assert values, f"no invalid values for {key} ({tp}): teach invalid_values its kind"
        for text in values:
            tried += 1
            problem = _refusal(key, text)
            if problem:
                problems.append(problem)
    print(f"{tried} invalid values over {len(keys)} keys")
    assert not problems, (
        f"{len(problems)} of {tried} invalid values were not one ConfigError line:\n"
        + "\n".join(problems[:40])
    )


def test_the_fuzz_values_are_valid_yaml_overrides_of_the_right_key(seed):
    """The test's own footing: a valid value of each kind passes, so a refusal above is the
    value's, not the override syntax's."""
    good = {
        "train.steps": "700",
        "train.lr": "1e-4",
        "train.betas": "[0.8, 0.9]",
        "data.val": "''",
        "eval.suite": "none",
        "model.init_logit_bias": "-10",
        "data.augment.crop_ratio": "[0.5, 2]",
        "train.device": "cpu",
        "loss.false_negative_ids": "label",
        "train.grad_cache_chunk_size": "auto",
        "model.vision": "{layers: 2}",
        "model.preset": "micro",
        "monitor.min_dim_std": "0",
    }
    for key, text in good.items():
        load_config(None, [f"{key}={text}"])


CLI_CASES = [
    ("train.betas=[1.5,0.9]", "train.betas"),
    ("model.preset=", "model.preset"),
    ("monitor.min_dim_std=-1", "monitor.min_dim_std"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("loss.false_negative_ids=", "loss.false_negative_ids"),
    ("seed=" + "9" * 30, "seed"),
    ("dist.timeout_s=1e300", "dist.timeout_s"),
]


@pytest.mark.parametrize("override, key", CLI_CASES, ids=[k for _, k in CLI_CASES])
def test_the_cli_gives_one_line_and_exit_2(tmp_path, override, key):
    out = tmp_path / "run"
    res = cli_main(
        "train",
        "--config",
        str(ROOT / "configs" / "quickstart.yaml"),
        "--set",
        override,
        "--output",
        str(out),
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-2000:]
    assert lines[0].startswith(f"mmalign: error: config key '{key}'"), lines[0]
    assert not out.exists()  # refused before any work
