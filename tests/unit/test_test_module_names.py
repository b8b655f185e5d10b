"""Test modules of the suite's folders never share a basename: pytest imports each by its
basename (rootdir-relative ``prepend`` mode), and a second module of the same name fails the
whole collection ("import file mismatch"), as ``tests/unit/test_expertpool.py`` beside
``tests/cluster/test_expertpool.py`` once did on CI."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_two_test_modules_share_a_basename() -> None:
    names = Counter(p.name for p in TESTS.glob("*/test_*.py"))
    assert [name for name, n in names.items() if n > 1] == []
