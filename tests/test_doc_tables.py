"""The generated tables in docs/ say what the code says now.

A new error code, setting, flag or exit code changes what
``llamapool.doc_tables`` renders; until the pages are regenerated
(``python -m llamapool.doc_tables``) these tests fail and say so.
"""

from __future__ import annotations

import enum

import pytest

from llamapool import doc_tables
from protocol.errors import ErrorCode

DOCS = doc_tables.ROOT / "docs"
REGENERATE = "run `python -m llamapool.doc_tables` and commit the pages"


@pytest.mark.parametrize("name", sorted(doc_tables.BLOCKS))
def test_each_generated_block_is_what_the_code_renders_now(name):
    page = DOCS / doc_tables.BLOCKS[name][0]
    blocks = doc_tables.generated_blocks(page.read_text(encoding="utf-8"))
    assert name in blocks, (
        f"{page.name} has no '<!-- generated: {name} -->' block; {REGENERATE}")
    assert blocks[name] == doc_tables.rendered(name), (
        f"the '{name}' table in docs/{page.name} is stale; {REGENERATE}")


@pytest.mark.parametrize("page", sorted(doc_tables.pages()))
def test_every_block_in_a_page_is_known(page):
    names = doc_tables.generated_blocks((DOCS / page).read_text(encoding="utf-8"))
    assert set(names) <= set(doc_tables.BLOCKS), (
        f"docs/{page} has generated blocks no table renders: "
        f"{sorted(set(names) - set(doc_tables.BLOCKS))}")


def test_the_error_table_has_every_code_once():
    table = doc_tables.error_table()
    for code in ErrorCode:
        assert table.count(f"| `{code.value}` |") == 1, code


def test_meanings_come_from_the_comment_beside_or_above_a_member():
    class Sample(enum.Enum):
        #: Above, in two
        #: lines.
        ABOVE = "above"
        BESIDE = "beside"  # beside wins, even with a ``code`` | pipe
        # A comment above this one
        BOTH = "both"  # is not used when there is one beside
        BARE = "bare"

    assert doc_tables.member_comments(Sample) == {
        "ABOVE": "Above, in two lines.",
        "BESIDE": "beside wins, even with a `code` \\| pipe",
        "BOTH": "is not used when there is one beside",
        "BARE": "",
    }


def test_regenerating_the_pages_changes_nothing_else(tmp_path):
    """``main`` rewrites stale blocks in place and leaves the rest of the
    page as it was."""
    for page in doc_tables.pages():
        text = (DOCS / page).read_text(encoding="utf-8")
        stale = doc_tables._BLOCK.sub(
            lambda m: m["open"] + "\nold\n" + m["close"], text)
        (tmp_path / page).write_text(stale, encoding="utf-8")
    assert doc_tables.main(["--docs", str(tmp_path), "--check"]) == 1
    assert doc_tables.main(["--docs", str(tmp_path)]) == 0
    for page in doc_tables.pages():
        assert (tmp_path / page).read_text(encoding="utf-8") == (
            doc_tables.regenerate((DOCS / page).read_text(encoding="utf-8")))
    assert doc_tables.main(["--docs", str(tmp_path), "--check"]) == 0
