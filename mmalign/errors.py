"""The errors a user can cause, and nothing else.

Each is one line that names the problem; the CLI prints it as ``mmalign: error: ...`` and
exits with status 2 (never a traceback). Library callers catch :class:`UserError` for both.

* :class:`ConfigError`: a key of the experiment config (file, ``--set`` or recipe) is
  wrong; the message names the key (``config key 'train.lr': ...``).
* :class:`UsageError`: anything else the user handed a command: a path that is not a model
  folder, a missing file, two flags that exclude each other, a data set that cannot be read.

Both derive from ``ValueError`` (as ConfigError always did), so existing ``except
ValueError`` callers keep working.
"""

from __future__ import annotations

__all__ = ["UserError", "ConfigError", "UsageError", "RunStopped", "first_line"]


class UserError(ValueError):
    """A user mistake: one line, exit 2."""


class ConfigError(UserError):
    """A user mistake in a config file or override (one line, names the key)."""


class UsageError(UserError):
    """A user mistake that is not about a config key (a path, a file, a flag)."""


class RunStopped(RuntimeError):
    """A run that cannot go on (too many non-finite steps in a row, a checkpoint that cannot be
    written): one line for the user, exit 1, its last complete checkpoint intact."""


def first_line(error: BaseException) -> str:
    """The first line of ``error``'s message ("" if it has none): what a one-line error quotes of
    a library's multi-line exception."""
    text = str(error).strip()
    return text.splitlines()[0] if text else ""
