"""The reference pages under docs/reference are what tools/gen_docs.py renders from the code
now: a flag, engine argument, HTTP field or metric changed without regenerating them fails
here."""

from tools.gen_docs import ROOT, render_pages, stale_pages


def test_generated_reference_pages_are_current(default_server):
    pages = render_pages(default_server.engine)
    stale = [str(path.relative_to(ROOT)) for path in stale_pages(pages)]
    assert not stale, f"stale generated pages {stale}: run python -m tools.gen_docs"
