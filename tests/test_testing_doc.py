"""docs/testing.md's table of test files is complete: every tests/test_*.py has its row, and every row names a file
that exists, so the page a newcomer reads to find where something is proved cannot drift from the suite."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_test_file_has_its_row_and_every_row_its_file():
    text = (ROOT / "docs" / "testing.md").read_text()
    first_cells = re.findall(r"^\| (`test_[^|]*)\|", text, re.M)   # a row may name several files
    rows = {name for cell in first_cells for name in re.findall(r"`(test_[a-z0-9_]+\.py)`", cell)}
    files = {path.name for path in (ROOT / "tests").glob("test_*.py")}
    assert sorted(files - rows) == [], "test files without a row in docs/testing.md's table"
    assert sorted(rows - files) == [], "rows of docs/testing.md's table naming no test file"
