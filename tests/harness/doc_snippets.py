"""The fenced code blocks of the README and the guides, with the marker comment before each.

A shell or Python block either runs in a test or says why not, on the line before its fence:
``<!-- run: tests/<package>/test_x.py::test_name -->`` or ``<!-- not run: the reason -->``.
A test that runs a block takes its text from the page with :func:`snippet`, so the page cannot
drift from what runs; tests/meta/test_doc_snippets.py checks the markers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tests.harness.paths import ROOT

CHECKED = {"bash", "sh", "shell", "console", "python", "py"}  # the languages that must be marked
MARKER = re.compile(r"^<!--\s*(run|not run):\s*(.*?)\s*-->$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([^\s`]*)")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str  # '' when the fence names none
    code: str
    marker: tuple[str, str] | None  # ("run", "tests/x.py::test_y") or ("not run", reason)

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
    """The README and every page of the manual."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """Every fenced block of ``page`` (or of ``text``, as if it were that page), in order."""
    lines = (page.read_text(encoding="utf-8") if text is None else text).splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        j = i - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        mark = MARKER.match(lines[j].strip()) if j >= 0 else None
        body = []
        k = i + 1
        while k < len(lines) and not lines[k].strip().startswith(fence):
            body.append(lines[k][len(indent) :] if lines[k].startswith(indent) else lines[k])
            k += 1
        marker = (mark.group(1), mark.group(2)) if mark else None
        out.append(Block(page, i + 1, lang.lower(), "\n".join(body) + "\n", marker))
        i = k + 1
    return out


def snippet(page: str | Path, test: str) -> str:
    """The code of the one block of ``page`` (relative to the repository) marked ``run: test``."""
    path = ROOT / page
    found = [b.code for b in blocks(path) if b.marker == ("run", test)]
    assert len(found) == 1, f"{page}: {len(found)} blocks marked 'run: {test}' (want 1)"
    return found[0]


def commands(code: str) -> list[str]:
    """A shell block's command lines: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [c.strip() for c in joined.splitlines() if c.strip() and not c.strip().startswith("#")]
