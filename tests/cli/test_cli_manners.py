"""CLI manners: --version, defaults and choices in every --help, usage mistakes in one line,
`mmalign models` (offline presets with parameter counts), `mmalign eval` keeps eval.json."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import mmalign
from mmalign.cli import EXPORT_FORMATS, build_parser, main
from mmalign.errors import UsageError


def _subparsers(parser):
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mmalign {mmalign.__version__}"


def test_every_help_shows_defaults_and_choices():
    parser = build_parser()
    subs = _subparsers(parser)
    assert {"train", "eval", "export", "models", "shards", "search", "serve"} <= set(subs)
    for name, sub in subs.items():
        text = sub.format_help()
        formatter = sub._get_formatter()
        for action in sub._actions:
            if action.help is argparse.SUPPRESS or action.required or not action.option_strings:
                continue
            shown = formatter._expand_help(action) if action.help else ""
            if (
                not any(action.default is v for v in (None, False, argparse.SUPPRESS))
                and action.default != []
            ):
                # a value-taking flag states its default (in our words or argparse's)
                assert "default" in shown, (name, action.option_strings, shown)
            if action.choices:
                assert "{" + ",".join(map(str, action.choices)) + "}" in text, (name, action.dest)
    export_help = subs["export"].format_help()
    assert "{open_clip,hf,onnx}" in export_help and "{image,text}" in subs["search"].format_help()
    assert "(default: 256)" in subs["eval"].format_help() and "(default: 8765)" in subs["serve"].format_help()


def test_export_formats_match_the_exporter():
    from mmalign.export import FORMATS

    assert EXPORT_FORMATS == FORMATS


def test_a_usage_error_is_one_line_exit_2(capsys, tmp_path):
    """Not a config key: two flags that exclude each other, a path that is not a model."""
    args = build_parser().parse_args(["search", "--index", "i", "--model", "m"])
    with pytest.raises(UsageError, match="give exactly one of --text or --image"):
        args.func(args)
    assert main(["search", "--index", "i", "--model", "m"]) == 2
    assert capsys.readouterr().err == "mmalign: error: search: give exactly one of --text or --image\n"
    assert main(["eval", "--model", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmalign: error: ") and str(tmp_path / "nothing") in err and err.count("\n") == 1


def test_usage_mistakes_are_one_line_exit_2(capsys):
    assert main(["eval"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmalign: error:") and "--model" in err and "\n" not in err
    assert main(["search", "--index", "i", "--model", "m", "--text", "x", "--against", "both"]) == 2
    assert "invalid choice: 'both'" in capsys.readouterr().err


def test_models_lists_offline_presets_with_parameter_counts(monkeypatch, capsys):
    import mmalign.models.presets as presets
    from mmalign.models import TwoTower, preset_table

    names = ["micro", "ViT-B-16-SigLIP", "RN50"]
    every = (
        preset_table.architectures()
    )  # the shipped table's rows of these three (mmalign.models.preset_table)
    monkeypatch.setattr(preset_table, "architectures", lambda: {n: every[n] for n in names})
    assert main(["models"]) == 0
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()[1:-1]}
    assert set(rows) == {"micro", "RN50"}  # the SigLIP preset needs a Hugging Face text tower
    reference = TwoTower(presets.PRESETS["micro"])  # real weights on the CPU, counted here
    assert rows["micro"][1] == f"{sum(p.numel() for p in reference.parameters()) / 1e6:.1f}M"
    assert rows["micro"][2] == "16" and rows["RN50"][2] == "224"
    assert main(["models", "--all"]) == 0
    out = capsys.readouterr().out
    siglip = next(line for line in out.splitlines() if line.startswith("ViT-B-16-SigLIP"))
    assert "not offline" in siglip and "Hugging Face" in siglip


def test_eval_without_output_keeps_the_runs_eval_json(shapes_dir, tmp_path, capsys):
    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.arch import resolve_arch
    from mmalign.models.io import save_pretrained
    from mmalign.models.two_tower import TwoTower

    run = tmp_path / "run"
    torch.manual_seed(0)
    model = TwoTower(resolve_arch(ModelConfig(preset="micro")))
    save_pretrained(
        model,
        run / "final",
        preprocess=preprocess_cfg(model.image_size),
        extra={"train_config": {"data": {"val": f"{shapes_dir}/val/00000.tar"}, "eval": {"suite": "shapes"}}},
    )
    (run / "final" / "eval.json").write_text("[]")  # stands for the run's own end-of-training results
    assert main(["eval", "--model", str(run / "final"), "--limit", "40"]) == 0
    assert (run / "final" / "eval.json").read_text() == "[]"
    out = run / "final" / "eval_cli_shapes.json"
    assert {r["dataset"] for r in json.loads(out.read_text())} >= {"shapes/shape"}
    assert f"results written to {out}" in capsys.readouterr().out


# ------------------------------------------------ the in-process CLI of the tests (tests.conftest.cli_main)


def test_cli_main_sees_what_the_process_prints(tmp_path):
    """The error-path tests call main in this process: its exit code and stderr are the real
    command's (compared once here against a real process), and --version's SystemExit is an exit code."""
    from tests.harness import cli_main, run_cli

    args = (
        "train",
        "--set",
        "train.stepz=3",
        "--output",
        str(tmp_path / "run"),
    )  # refused before torch is imported
    real, here = run_cli(*args), cli_main(*args)
    assert (
        (here.returncode, here.stdout, here.stderr)
        == (real.returncode, real.stdout, real.stderr)
        == (2, "", here.stderr.splitlines()[0] + "\n")
    ), real.stderr
    version = cli_main("--version")
    assert (version.returncode, version.stdout, version.stderr) == (0, f"mmalign {mmalign.__version__}\n", "")


def test_cli_main_leaves_this_process_as_it_found_it(tmp_path, monkeypatch):
    """In-process CLI runs put the working directory back and let a bug's traceback through.
    (The process group a run makes is destroyed at its end, DeepSpeed's groups with it, as in a
    process of its own: tests/cli/test_cli_startup.py runs two trainings and an engine after them.)"""
    import os

    from mmalign import cli
    from tests.harness import cli_main

    seen = {}

    def command(args):
        seen["cwd"] = os.getcwd()
        raise RuntimeError("a bug, not a user mistake")

    monkeypatch.setattr(cli, "cmd_models", command)  # `mmalign models` runs it
    here = os.getcwd()
    with pytest.raises(
        RuntimeError, match="a bug"
    ):  # a traceback fails the test, as a process would print one
        cli_main("models", cwd=tmp_path)
    assert seen == {"cwd": str(tmp_path)} and os.getcwd() == here
