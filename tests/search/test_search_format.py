"""`mmalign search` prints aligned columns (issue 39, point 6): every column of the table
starts at the same character on every line, whatever the widths of keys and sources."""

from mmalign.search.searcher import Hit, format_hits


def _starts(line: str, cells: list[str]) -> list[int]:
    """Where each cell starts in ``line``, searching left to right (a naive reference)."""
    out, at = [], 0
    for cell in cells:
        at = line.index(cell, at)
        out.append(at)
        at += len(cell)
    return out


def test_columns_start_at_the_same_place_on_every_line():
    hits = [
        Hit(1, "k", "a cat", 0.91234, 0, "cat/0001.jpg"),
        Hit(2, "0000012345", "a very long caption about a dog", -0.05, 1, None),
        Hit(10, "x7", "a bird", 0.5, 2, "birds/in/a/deep/folder/0003.png"),
    ]
    lines = format_hits(hits).splitlines()
    assert lines[0].split() == ["rank", "score", "key", "source", "caption"]
    cells = [[f"{h.score:.4f}", h.key, h.source_path or "-", h.caption] for h in hits]
    starts = [_starts(line, c) for line, c in zip(lines[1:], cells)]
    # key, source and caption left-aligned under their headers; score right-aligned under its
    header = _starts(lines[0], ["score", "key", "source", "caption"])
    for s, row in zip(starts, cells):
        assert s[1:] == header[1:], (lines, s, header)
        assert s[0] + len(row[0]) == header[0] + len("score")
    assert [line.index(str(h.rank)) + len(str(h.rank)) for line, h in zip(lines[1:], hits)] == [4, 4, 4]


def test_without_sources_there_is_no_source_column():
    lines = format_hits([Hit(1, "abc", "cap", 0.1, 0), Hit(2, "a", "cap two", 0.2, 1)]).splitlines()
    assert lines[0].split() == ["rank", "score", "key", "caption"]
    assert len({line.index("cap") for line in lines[1:]}) == 1 and lines[0].index("caption") == lines[
        1
    ].index("cap")
