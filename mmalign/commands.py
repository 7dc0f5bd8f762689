"""Sub-commands that packages built on mmalign add to the ``mmalign`` command line.

mmalign's own commands (train, eval, export, ...) are defined in :mod:`mmalign.cli`. The
offline data builders (``mmalign shards``, ``mine``, ``tokenizer``) live in
``data_pipelines``, which imports mmalign; for the CLI to import them back would make the
layers circular. Instead a package declares its commands as entry points of the group
``mmalign.commands`` (``[project.entry-points."mmalign.commands"]`` in its pyproject), each
naming a :class:`Command`; the CLI discovers them through the installed package metadata.
So a change to an entry point takes effect after the package is installed again
(``pip install -e .`` for a checkout).

A command whose package cannot be imported still gets its name on the command line; running
it is then a one-line :class:`~mmalign.errors.UsageError`, and every other command works.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from importlib import metadata

from mmalign.errors import UsageError, first_line

GROUP = "mmalign.commands"

__all__ = ["GROUP", "Command", "discover", "add_commands"]


@dataclass(frozen=True)
class Command:
    """One ``mmalign NAME ...`` command: its arguments and what it runs (the return value is ignored)."""

    name: str
    help: str
    add_args: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], object]


def _unloadable(name: str, error: Exception) -> Command:
    """A stand-in for a command whose entry point cannot be loaded: it fails when it runs."""
    why = f"{type(error).__name__}: {first_line(error)}"

    def add_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("rest", nargs="*", help=argparse.SUPPRESS)
        p.prefix_chars = (
            ""  # every word is a positional, so any flags given reach run() and its one-line reason
        )

    def run(args: argparse.Namespace) -> None:
        raise UsageError(
            f"mmalign {name}: its package cannot be imported ({why}); install it with mmalign "
            f"(pip install -e . in a checkout)"
        )

    return Command(name, f"(unavailable: {why})", add_args, run)


def discover(
    entry_points: Iterable[metadata.EntryPoint] | None = None, reserved: Iterable[str] = ()
) -> dict[str, Command]:
    """The commands declared in the group :data:`GROUP`, by name, in declaration order.

    ``entry_points``: the entry points to load (default: those of the installed packages).
    A name in ``reserved`` (mmalign's own commands) or seen before is refused: a package
    cannot replace ``mmalign train``.
    """
    if entry_points is None:
        entry_points = metadata.entry_points(group=GROUP)
    reserved = set(reserved)
    found: dict[str, Command] = {}
    for ep in entry_points:
        if ep.name in reserved or ep.name in found:
            raise RuntimeError(
                f"entry point {ep.name} = {ep.value} in group {GROUP}: the command "
                f"{ep.name!r} is already defined"
            )
        try:
            command = ep.load()
        except ImportError as e:
            command = _unloadable(ep.name, e)
        if not isinstance(command, Command) or command.name != ep.name:
            raise TypeError(
                f"entry point {ep.name} = {ep.value} in group {GROUP} is not a Command named {ep.name!r}"
            )
        found[ep.name] = command
    return found


def add_commands(sub: argparse._SubParsersAction, commands: dict[str, Command]) -> None:
    """One sub-parser per command; ``args.func`` runs it and returns exit status 0."""
    for command in commands.values():
        p = sub.add_parser(command.name, help=command.help)
        command.add_args(p)
        p.set_defaults(func=_runner(command))


def _runner(command: Command) -> Callable[[argparse.Namespace], int]:
    def func(args: argparse.Namespace) -> int:
        command.run(args)
        return 0

    return func
