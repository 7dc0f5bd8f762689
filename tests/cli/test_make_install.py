"""`make install` (the first step of `make quickstart` and `make test`) tells a user what it is
doing: a fresh install is minutes of downloads and unpacking, and a silent terminal for that
long reads as a hang. The recipe runs here against a stand-in venv whose ``python`` records its
arguments, so nothing is downloaded: what is checked is what the Makefile prints and asks pip.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess

import pytest

from tests.harness import ROOT

FAKE_PYTHON = """#!/bin/sh
echo "$@" >> "$(dirname "$0")/calls"
echo "Collecting something (stand-in for pip's progress)"
"""


@pytest.fixture()
def checkout(tmp_path):
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "requirements", tmp_path / "requirements")
    for venv in (".venv", ".venv-tools"):  # the project's venv and the field's tools' side venv
        bin_dir = tmp_path / venv / "bin"
        bin_dir.mkdir(parents=True)
        python = bin_dir / "python"
        python.write_text(FAKE_PYTHON)
        python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def test_install_announces_itself_and_shows_pips_progress(checkout):
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    # as a user types it, also when this suite itself runs under `make test` (no inherited make level)
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEFILES")}
    run = subprocess.run(
        ["make", "install"], cwd=checkout, capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    # before pip starts: what is installed, where, and roughly how big and how long
    first = lines.index("Collecting something (stand-in for pip's progress)")
    intro = "\n".join(lines[:first])
    assert "installing mmalign and its dependencies" in intro and "torch" in intro
    assert "GB" in intro and "min" in intro
    # pip's own output reaches the terminal, and pip is not asked to be quiet
    calls = (checkout / ".venv" / "bin" / "calls").read_text().splitlines()
    assert (
        len(calls) == 3
        and calls[1].startswith("-m pip install")
        and "-e .[search,export,report,test]" in calls[1]
    )
    # clip-retrieval without its dependencies (tests load files from it), pinned in requirements/
    assert calls[2].startswith("-m pip install") and "--no-deps -r requirements/test-nodeps.txt" in calls[2]
    # img2dataset and autofaiss into their own venv, with their own pins
    tools = (checkout / ".venv-tools" / "bin" / "calls").read_text().splitlines()
    assert tools == [t for t in tools if t.startswith("-m pip install")] and len(tools) == 1
    assert "-r requirements/tools.txt" in tools[0]
    assert "the field's tools (img2dataset, autofaiss) into their own venv" in run.stdout
    assert not any(arg in ("-q", "--quiet") for call in calls for arg in call.split())
    # at the end: the time it took and the venv's size
    assert lines[-1].startswith("mmalign: installed in ") and "s; .venv takes " in lines[-1]
    assert (checkout / ".venv" / ".installed").exists()
    # a second run is a no-op (the stamp is newer than pyproject.toml)
    again = subprocess.run(
        ["make", "install"], cwd=checkout, capture_output=True, text=True, timeout=60, env=env
    )
    assert again.returncode == 0 and "installing" not in again.stdout
