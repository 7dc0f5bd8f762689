"""``mmalign ARGS`` from a test: in a fresh process (run_cli) or in this one (cli_main)."""

import os
import sys
from typing import NamedTuple

from tests.harness.paths import ROOT


def run_cli(*args, cwd=None):
    import subprocess

    return subprocess.run(
        [sys.executable, "-m", "mmalign.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=600,
    )


class CliRun(NamedTuple):
    """What :func:`cli_main` saw: the fields of :func:`run_cli`'s CompletedProcess that tests read."""

    returncode: int
    stdout: str
    stderr: str


def cli_main(*args, cwd=None) -> CliRun:
    """``mmalign ARGS`` called in this process (``mmalign.cli.main``), with what it printed to
    sys.stdout and sys.stderr. No interpreter start and no torch import (seconds per call in
    :func:`run_cli`): for what a user sees of an error path, a message, a help text or a short
    run. An exception that escapes main fails the test with its traceback (a process would print
    one and exit 1); SystemExit (--help, --version) gives its code as a process would. What the
    process itself does (signals, exit codes of a killed run, what the interpreter prints, what
    importing costs) stays with run_cli."""
    import contextlib
    import io

    from mmalign import cli

    out, err = io.StringIO(), io.StringIO()
    previous = os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = cli.main([str(a) for a in args])
            except SystemExit as e:  # argparse's --help and --version
                code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
    finally:
        os.chdir(previous)
    return CliRun(code, out.getvalue(), err.getvalue())
