"""``syncless query``'s text table: one line a row, numbers right-aligned, NULL spelled."""

from __future__ import annotations

import io

from syncless.run.text_table import write_table


def test_rows_columns_and_the_count():
    out = io.StringIO()
    write_table(["name", "value", "note"], [("a", 1.5, None), ("bb", 10, "x\ny")], out)
    lines = out.getvalue().splitlines()
    assert lines == [
        "┏━━━━━━┳━━━━━━━┳━━━━━━┓",
        "┃ name ┃ value ┃ note ┃",
        "┡━━━━━━╇━━━━━━━╇━━━━━━┩",
        "│ a    │   1.5 │ NULL │",
        "│ bb   │    10 │ x\\ny │",
        "└──────┴───────┴──────┘",
        "2 row(s)",
    ]


def test_an_empty_result_still_has_its_header():
    out = io.StringIO()
    write_table(["n"], [], out)
    assert out.getvalue().splitlines()[1] == "┃ n ┃" and out.getvalue().endswith("0 row(s)\n")
