"""The benchmarks: one script per measurement (``python bench/<name>.py``), sharing bench/harness.py
(arguments, the idle check, the command and machine lines, writing a section of docs/benchmarks.md).
bench/README.md is the index: which script measures what and which section it writes."""

import sys

from bench import _bootstrap

# a script imported as bench.<name> (a test, `python -c` from the repository root) finds the
# `import _bootstrap` it starts with
sys.modules.setdefault("_bootstrap", _bootstrap)
