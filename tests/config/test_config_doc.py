"""The manual's config table (docs/configuration.md) is generated from the config's field
metadata (``python -m mmalign.config.doc``) and this file fails when it is stale."""

from __future__ import annotations

import pytest

from mmalign.config import Config
from mmalign.config import doc as config_doc
from mmalign.config.checks import fields_of
from tests.harness import ROOT

PAGE = ROOT / "docs" / "configuration.md"


def test_the_configuration_page_table_is_the_generated_one():
    text = PAGE.read_text(encoding="utf-8")
    assert config_doc.updated(text) == text, (
        "the config table of docs/configuration.md is stale: run `python -m mmalign.config.doc`"
    )
    assert config_doc.main([str(PAGE), "--check"]) == 0
    # without an argument it checks the checkout's page, wherever the module sits in the package
    assert config_doc.PAGE.resolve() == PAGE.resolve() and config_doc.main(["--check"]) == 0
    # the table left the README: no second copy to go stale there
    assert config_doc.BEGIN not in (ROOT / "README.md").read_text(encoding="utf-8")


def test_the_table_links_resolve_in_docs():
    """The metadata's links name the manual's sections; in docs/ each must name a page there."""
    import re

    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", config_doc.table())
    assert targets, "the metadata links to the guides"
    missing = [t for t in targets if not (ROOT / "docs" / t).is_file()]
    assert not missing, missing


def test_every_key_has_one_row_with_its_domain_and_unit():
    table = config_doc.table()
    keys = [key for key, _, _ in fields_of(Config)]
    assert len(config_doc.rows()) == len(keys) > 90
    for key in keys:
        assert table.count(f"| `{key}` |") == 1, key
    assert (
        "| `dist.timeout_s` | float | `0` | in [0, 86400] seconds (0 = 600 s on GPU, 120 s on CPU) |" in table
    )
    assert "| `loss.positive_mask` | `none` / `attribute_subset` | `none` |" in table  # a Literal's values


def test_check_fails_on_a_stale_table_and_the_writer_fixes_only_the_table(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    stale = config_doc.table().replace(
        "| `seed` | int | `0` | >= 0 | RNG seed |", "| `seed` | int | `7` | | |"
    )
    path.write_text(f"# Title\n\nprose before\n\n{stale}\n\nprose after\n", encoding="utf-8")
    assert config_doc.main([str(path), "--check"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("config_doc: the config table of") and "\n" not in err
    assert config_doc.main([str(path)]) == 0
    assert (
        path.read_text(encoding="utf-8")
        == f"# Title\n\nprose before\n\n{config_doc.table()}\n\nprose after\n"
    )
    assert config_doc.main([str(path), "--check"]) == 0


def test_a_page_without_the_markers_is_one_line(tmp_path, capsys):
    path = tmp_path / "configuration.md"
    path.write_text("# no table here\n", encoding="utf-8")
    assert config_doc.main([str(path), "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no config table markers" in err and "\n" not in err
    assert config_doc.main([str(tmp_path / "missing.md")]) == 2


@pytest.mark.parametrize("doc", ["a | pipe", "two\nlines"])
def test_a_cell_cannot_break_the_table(doc):
    cell = config_doc._cell(doc)
    assert "\n" not in cell and "| " not in cell.replace("\\|", "")
