"""The one JSON-lines reader (utils/io.py: iter_jsonl / read_jsonl)."""

from __future__ import annotations

import pytest
from expertcast.utils.errors import UsageError
from expertcast.utils.io import iter_jsonl, read_jsonl


def test_the_jsonl_reader_skips_blank_lines_limits_and_names_the_bad_line(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"a": 1}\n\n{"a": 2}\n{"a": 3}\nnot json\n', encoding="utf-8")
    assert list(iter_jsonl(p, limit=2)) == [(1, {"a": 1}), (3, {"a": 2})]
    assert read_jsonl(p, limit=3) == [{"a": 1}, {"a": 2}, {"a": 3}]
    with pytest.raises(UsageError, match=rf"^{p}:5: not valid JSON \("):
        read_jsonl(p)

    class Mine(UsageError):
        pass

    with pytest.raises(Mine, match=":5:"):
        read_jsonl(p, error=Mine)
