"""Replace one benchmark's section of a markdown document, leaving the others alone.

A section runs from its ``## `` heading to the next ``## `` heading (or the end);
every bench script writes its own table this way, so reruns replace rather than append.
Bench scripts call it through bench/idle.py (re-exported by bench/harness.py), which adds the
load note or refuses a loaded run.
"""

from __future__ import annotations

from pathlib import Path


def write_section(doc: Path, text: str, title: str = "# Benchmarks") -> None:
    """Put ``text`` (which starts with its ``## `` heading line) into ``doc``:
    in place of the section with the same heading, else appended."""
    heading = text.split("\n", 1)[0]
    current = doc.read_text() if doc.is_file() else title + "\n"
    start = current.find(heading + "\n")
    if start < 0:
        current = current.rstrip("\n") + "\n\n" + text
    else:
        nxt = current.find("\n## ", start + len(heading))
        current = current[:start] + text.rstrip("\n") + "\n" + (current[nxt:] if nxt >= 0 else "")
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(current.rstrip("\n") + "\n")
