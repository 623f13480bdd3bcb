"""Every markdown table in the docs has a header: its first row is followed by a `| --- |`
separator row. Without one, a markdown renderer shows no table at all, only the rows'
text with their pipes, and a reader of the source cannot tell what the columns are.

Pages: docs/**/*.md, README.md and benchmarks/README.md. Lines inside fenced code blocks
(``` or ~~~) are not tables, whatever pipes they hold."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "benchmarks" / "README.md"]
)

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
# A separator row: cells of dashes, each with an optional colon at either end (alignment).
SEPARATOR = re.compile(r"^\s*\|?\s*:?-+:?\s*(\|\s*:?-+:?\s*)*\|?\s*$")


def is_table_row(line: str) -> bool:
    """A row as these pages write them: a line that starts with a pipe (after indentation)."""
    return line.lstrip().startswith("|")


def tables(text: str) -> list[tuple[int, list[str]]]:
    """Each table of a page, outside fenced code: (its first line's number, from 1; its
    rows). A fence closes on a line of its character only, at least as long as its opening."""
    found: list[tuple[int, list[str]]] = []
    fence = ""
    rows: list[str] = []
    start = 0
    for number, line in enumerate([*text.splitlines(), ""], start=1):
        opening = FENCE.match(line)
        if fence:
            closing = line.strip()
            if set(closing) == {fence[0]} and len(closing) >= len(fence):
                fence = ""
            continue
        if is_table_row(line):
            if not rows:
                start = number
            rows.append(line)
            continue
        if rows:
            found.append((start, rows))
            rows = []
        if opening:
            fence = opening.group(1)
    return found


def headerless(text: str) -> list[int]:
    """The first line's number of each table whose second row is not a separator."""
    return [start for start, rows in tables(text) if len(rows) < 2 or not SEPARATOR.match(rows[1])]


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_table_has_a_header_row(page):
    lines = headerless(page.read_text(encoding="utf-8"))
    assert not lines, f"{page.relative_to(ROOT)}: a table without a header row at lines {lines}"


def test_the_scan_finds_headerless_tables_and_skips_code():
    page = "\n".join(
        [
            "| a | b |",
            "| --- | :-: |",
            "| 1 | 2 |",
            "",
            "```",
            "| not | a table |",
            "```",
            "~~~~",
            "| nor | this | ``` |",
            "~~~~",
            "text",
            "| no | header |",
            "| 1 | 2 |",
            "",
            "| one row |",
        ]
    )
    assert headerless(page) == [12, 15]
