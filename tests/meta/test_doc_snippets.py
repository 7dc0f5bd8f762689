"""Every shell and Python block of the README and the guides runs in a test or says why not.

The marker is an HTML comment on the line before the fence (tests/harness/doc_snippets.py):
``<!-- run: tests/<package>/test_x.py::test_name -->`` or ``<!-- not run: the reason -->``.
A block without one fails, as does a ``run:`` naming a test that does not exist, or one whose
file does not read that page (it must take the block from the page, so the two cannot drift).
Every fence names its language, so that an unmarked shell block cannot pass as plain text."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.harness import ROOT
from tests.harness.doc_snippets import CHECKED, MARKER, Block, blocks, pages


def _all() -> list[Block]:
    return [b for page in pages() for b in blocks(page)]


def _test_functions(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def _problem(block: Block) -> str | None:
    """What is wrong with one block's marking, or None."""
    if not block.lang:
        return "a fence without a language (fence output and examples as `text`)"
    if block.lang not in CHECKED:
        return None
    if block.marker is None:
        return "no <!-- run: tests/...::test --> or <!-- not run: reason --> on the line before"
    kind, what = block.marker
    if kind == "not run":
        return None if what else "'not run' without a reason"
    path, _, name = what.partition("::")
    test = ROOT / path
    if not (path.startswith("tests/") and test.is_file() and name):
        return f"'run: {what}' names no test file and function"
    if name not in _test_functions(test):
        return f"{path} has no function {name}"
    page = block.page.relative_to(ROOT).as_posix()
    source = test.read_text(encoding="utf-8")
    if page not in source and f'"{block.page.name}"' not in source:
        return f"{path} does not read {page}"
    return None


def test_every_shell_and_python_block_is_marked():
    problems = [f"{b.where()}: {p}" for b in _all() if (p := _problem(b))]
    assert not problems, "\n".join(problems)


def test_the_pages_have_runnable_blocks_and_most_run_or_say_why():
    checked = [b for b in _all() if b.lang in CHECKED]
    run = [b for b in checked if b.marker and b.marker[0] == "run"]
    assert len(checked) >= 10 and len(run) >= 3, (len(checked), len(run))
    readme = [b for b in checked if b.page.name == "README.md" and b.marker and b.marker[0] == "run"]
    assert readme, "the README's tour runs in a test"


@pytest.mark.parametrize(
    "text, problem",
    [
        ("```bash\nmmalign train\n```\n", "no <!-- run"),
        ("<!-- not run: -->\n```python\nx = 1\n```\n", "without a reason"),
        ("<!-- run: tests/nowhere/test_x.py::test_y -->\n```bash\nls\n```\n", "names no test file"),
        ("<!-- run: tests/meta/test_doc_snippets.py::test_nothing -->\n```sh\nls\n```\n", "no function"),
        ("```\nplain\n```\n", "without a language"),
        (
            "<!-- run: tests/cli/test_readme_tour.py::test_the_tour_covers_every_stage -->\n```bash\nls\n```\n",
            "does not read",
        ),
    ],
)
def test_the_check_fails_on_a_bad_block(text, problem):
    """The checker itself can fail: each kind of bad block is named (a page under docs/)."""
    found = [_problem(b) for b in blocks(ROOT / "docs" / "not_a_page.md", text)]
    assert len(found) == 1 and found[0] and problem in found[0], found


def test_good_blocks_pass():
    ok = [b for b in _all() if b.marker and b.marker[0] == "run"]
    assert ok and all(_problem(b) is None for b in ok)
    assert MARKER.match("<!-- not run: needs a GPU -->").groups() == ("not run", "needs a GPU")
    text = [b for b in _all() if b.lang in {"text", "yaml"}]
    assert all(_problem(b) is None for b in text)
