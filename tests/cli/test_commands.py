"""The sub-commands other packages add (mmalign.commands): data_pipelines' shards / mine /
tokenizer reach the CLI through the entry points declared in pyproject.toml, not by import."""

from __future__ import annotations

import argparse
import tomllib
from importlib import metadata

import pytest

from mmalign import cli, commands
from mmalign.commands import GROUP, Command, discover
from mmalign.errors import UsageError
from tests.harness import ROOT


def _declared() -> list[metadata.EntryPoint]:
    """The group as pyproject.toml declares it (what `pip install` writes into the metadata)."""
    table = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][GROUP]
    return [metadata.EntryPoint(name, value, GROUP) for name, value in table.items()]


@pytest.fixture
def declared(monkeypatch):
    """The CLI sees exactly the declared entry points (the installed metadata may predate them)."""
    eps = _declared()
    monkeypatch.setattr(commands.metadata, "entry_points", lambda group: eps if group == GROUP else [])
    return eps


def test_pyproject_declares_the_builders_and_each_loads_as_its_command():
    found = discover(_declared())
    assert list(found) == ["shards", "mine", "curate", "tokenizer"]
    assert all(isinstance(c, Command) and c.name == n for n, c in found.items())
    assert found["shards"].run.__module__ == "data_pipelines.commands"


def test_declared_commands_have_working_help_and_run(declared, capsys, tmp_path):
    for name in ("shards", "mine", "curate", "tokenizer"):
        with pytest.raises(SystemExit) as e:
            cli.main([name, "--help"])
        assert e.value.code == 0 and f"usage: mmalign {name}" in capsys.readouterr().out
    out = tmp_path / "shapes"
    assert (
        cli.main(
            ["shards", "shapes", "--out", str(out), "--n-train", "4", "--n-val", "2", "--per-shard", "4"]
        )
        == 0
    )
    assert (out / "train" / "sizes.json").is_file() and (out / "dataset.json").is_file()
    assert cli.main(["shards", "shapes", "--out", str(out), "--input", "x"]) == 2  # a UsageError: one line
    err = capsys.readouterr().err
    assert (
        err.startswith("mmalign: error: mmalign shards shapes: --input does not apply")
        and err.count("\n") == 1
    )


def test_without_the_entry_points_the_builders_are_absent_and_quickstart_says_why(monkeypatch):
    monkeypatch.setattr(commands.metadata, "entry_points", lambda group: [])
    subs = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert "train" in subs and "shards" not in subs
    with pytest.raises(UsageError, match=r"`mmalign shards` is not installed.*pip install -e"):
        cli._run_command("shards", ["shapes", "--out", "nowhere"])


def test_a_package_cannot_replace_a_command_and_must_name_a_command():
    with pytest.raises(RuntimeError, match="'train' is already defined"):
        discover([metadata.EntryPoint("train", "data_pipelines.commands:SHARDS", GROUP)], reserved={"train"})
    with pytest.raises(RuntimeError, match="'shards' is already defined"):
        discover([metadata.EntryPoint("shards", "data_pipelines.commands:SHARDS", GROUP)] * 2)
    with pytest.raises(TypeError, match="not a Command named 'mine'"):
        discover([metadata.EntryPoint("mine", "data_pipelines.commands:SHARDS", GROUP)])
    with pytest.raises(TypeError, match="not a Command"):
        discover([metadata.EntryPoint("shards", "data_pipelines.commands:run_shards", GROUP)])


def test_an_unimportable_command_fails_alone_in_one_line(monkeypatch, capsys):
    broken = [metadata.EntryPoint("gone", "no_such_package_xyz.commands:GONE", GROUP)]
    monkeypatch.setattr(commands.metadata, "entry_points", lambda group: broken)
    assert cli.main(["gone", "--anything", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmalign: error: mmalign gone: its package cannot be imported (ModuleNotFoundError")
    assert err.count("\n") == 1
    with pytest.raises(SystemExit) as e:  # the other commands are untouched
        cli.main(["models", "--help"])
    assert e.value.code == 0


def test_quickstart_builds_its_data_through_the_registered_shards_command(declared, tmp_path):
    """cmd_quickstart's data step: `mmalign shards shapes` run by name (here with a small size)."""
    from mmalign.data.shapes_scene import is_complete

    out = tmp_path / "shapes"
    cli._run_command("shards", ["shapes", "--out", str(out), "--n-train", "3", "--n-val", "2"])
    assert is_complete(out)


def test_the_installed_metadata_declares_the_builders():
    """Fails on an install older than the entry points (then `mmalign shards` and the tests that
    run it fail too): install again, `pip install -e .` (`make` does when pyproject.toml changes)."""
    installed = {ep.name: ep.value for ep in metadata.entry_points(group=GROUP)}
    declared = {ep.name: ep.value for ep in _declared()}
    assert installed == declared, (
        "the mmalign install predates pyproject.toml's entry points: pip install -e ."
    )
