"""The pre-commit configuration runs what `make lint` runs, and its commit-msg hook holds commit
subjects to 72 characters (the detail goes in the body)."""

import shlex
import subprocess

import yaml

from tests.harness import ROOT


def _hooks() -> dict[str, dict]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    return {h["id"]: h for repo in config["repos"] for h in repo["hooks"]}


def test_the_hooks_are_make_lints_checks():
    makefile = (ROOT / "Makefile").read_text()
    lint = makefile.split("\nlint:", 1)[1].split("\n\n", 1)[0]
    hooks = _hooks()
    assert "ruff check ." in lint and "check --force-exclude" in hooks["ruff-check"]["entry"]
    assert "ruff format --check ." in lint and "format --check" in hooks["ruff-format"]["entry"]
    assert "mypy" in lint and "mypy" in hooks["mypy"]["entry"] and hooks["mypy"]["pass_filenames"] is False


def test_a_subject_over_72_characters_is_refused(tmp_path):
    hook = _hooks()["commit-subject"]
    assert hook["stages"] == ["commit-msg"]

    def run(message: str) -> subprocess.CompletedProcess:
        path = tmp_path / "COMMIT_EDITMSG"
        path.write_text(message)
        cmd = shlex.split(hook["entry"]) + [str(path)]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=60)

    assert run("x" * 72 + "\n\nA body may be as long as it needs to be. " * 5).returncode == 0
    over = run("x" * 73 + "\n")
    assert over.returncode == 1 and "73 characters" in over.stderr
