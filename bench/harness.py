"""What every bench script shares: its arguments, the idle check, the command and machine lines,
the side-by-side ratio, and writing its section of docs/benchmarks.md.

A script (see docs/architecture.md, "Adding a benchmark")::

    import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

    from bench.harness import DOC, LoadWatch, command, cpu_line, parser, ratio, table, write_section

    p = parser(__doc__)                    # --write-doc and --allow-loaded, described by the doc's first paragraph
    args = p.parse_args()
    watch = LoadWatch()                    # the load average before the bench runs
    ...                                    # time the thing and its anchor
    text = f"{SECTION}\\n\\nCommand: `{command()}` · {cpu_line()}\\n\\n" + table(...)
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)   # refused (exit 3) on a loaded machine

The load guard itself is bench/idle.py and the section writer bench/docsection.py; this module
re-exports what a script needs of them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.idle import EXIT_LOADED, LoadWatch, add_flag, usable_cores, write_section

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks.md"

__all__ = [
    "DOC",
    "EXIT_LOADED",
    "ROOT",
    "LoadWatch",
    "add_flag",
    "bf16_flags",
    "command",
    "cpu_line",
    "device_line",
    "parser",
    "ratio",
    "table",
    "today",
    "usable_cores",
    "write_section",
]


def status_mb(field: str) -> float:
    """VmRSS / VmHWM of this process from /proc, in MB (ru_maxrss would carry the launching
    process's peak across fork + exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak() -> float:
    """Before a measured step: hand the memory freed so far back to the OS, start VmHWM again from
    the current RSS (Linux: clear_refs 5), and return that RSS in MB, so that VmHWM minus it is
    the step's own peak. Without the hand-back (glibc's malloc_trim) the step could reuse the
    set-up's freed memory unseen, and its own peak would read too low."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: what is freed may stay in the heap
        pass
    Path("/proc/self/clear_refs").write_text("5")
    return status_mb("VmRSS")


def parser(doc: str | None, *, full: bool = False, write_doc: str | None = "") -> argparse.ArgumentParser:
    """The script's argument parser: described by the first paragraph of ``doc`` (``full``: all of
    it, as written), with ``--allow-loaded`` and, unless ``write_doc`` is None, ``--write-doc``
    (``write_doc`` is its help text; empty: none)."""
    doc = doc or ""
    if full:
        p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    else:
        p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    if write_doc is not None:
        p.add_argument("--write-doc", action="store_true", help=write_doc or None)
    add_flag(p)
    return p


def command(argv: Sequence[str] | None = None, script: str | None = None) -> str:
    """The command line as a reader types it again: ``python bench/<script>.py ARGS`` (the running
    script and its arguments unless given; an argument with spaces quoted)."""
    name = script or Path(sys.argv[0]).name
    args = sys.argv[1:] if argv is None else argv
    return " ".join([f"python bench/{name}", *(shlex.quote(a) for a in args)])


def bf16_flags() -> str:
    """The CPU's native bf16 flags (avx512_bf16, amx_bf16): a bf16 timing depends on them."""
    info = Path("/proc/cpuinfo")
    flags = set(info.read_text().split()) if info.is_file() else set()
    return ", ".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags) or "no native bf16"


def cpu_line(threads: int | None = None) -> str:
    """The machine a table was taken on, e.g. 'x86_64, 2 CPU cores (avx512_bf16), 2 torch threads'."""
    line = f"{platform.machine()}, {usable_cores()} CPU cores ({bf16_flags()})"
    return line if threads is None else f"{line}, {threads} torch threads"


def device_line(device) -> str:
    """What a GPU bench ran on: the CUDA device's name, or 'CPU dry run (N cores, processor)'."""
    if getattr(device, "type", device) == "cuda":
        import torch

        return torch.cuda.get_device_name(device)
    return f"CPU dry run ({os.cpu_count()} cores, {platform.processor() or platform.machine()})"


def today() -> str:
    return datetime.date.today().isoformat()


def ratio(value: float, anchor: float) -> str:
    """``value`` over the anchor's, as a table cell ('1.23x'; '-' without an anchor)."""
    return f"{value / anchor:.2f}x" if anchor else "-"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
