"""The samples file of `expertcast eval`: torn tails are dropped and cut, corruption and mixed runs are
errors naming file:line, and the summary counts each batch's counters once."""

from __future__ import annotations

import json

import pytest
from expertcast.commands.evaluate import summarize
from expertcast.inference.runtime.eval_samples import append_samples, read_samples
from expertcast.utils.errors import ResumeMismatchError, UsageError


def _stats(accesses: int, demand: int, tokens: int) -> dict:
    return {"accesses": accesses, "demand_misses": demand, "proactive_loads": 1, "late_prefetches": 0, "cpu_exec": 0,
            "decoded_tokens": tokens, "decode_seconds": 0.5, "ttft_s": 0.1, "stall_seconds": 0.0, "expert_bytes": 1000,
            "tokens_per_s": tokens / 0.5, "per_layer_accesses": [accesses], "per_layer_demand": [demand]}


def _rows(batch: int, ids: list[str], correct: bool = False, h: str = "H") -> list[dict]:
    stats = _stats(10 * (batch + 1), batch + 1, 4)
    return [{"id": i, "batch": batch, "batch_rows": len(ids), "batch_stats": stats, "correct": correct,
             "settings_hash": h} for i in ids]


@pytest.fixture
def path(tmp_path):
    p = tmp_path / "samples.jsonl"
    append_samples(p, _rows(0, ["a", "b"]))
    append_samples(p, _rows(1, ["c", "d"], correct=True))
    return p


def test_whole_file_round_trip(path):
    rows = read_samples(path, "H")
    assert [r["id"] for r in rows] == ["a", "b", "c", "d"]
    s = summarize(rows)
    # two batches, counted once each: A = 10 + 20, D = 1 + 2, P = 1 + 1, tokens = 4 + 4
    assert (s["samples"], s["correct"], s["batches"], s["accesses"], s["demand_misses"]) == (4, 2, 2, 30, 3)
    assert s["hit"] == pytest.approx(1 - 3 / 30) and s["adj_hit"] == pytest.approx(27 / 32)
    assert s["mb_per_token"] == pytest.approx((3 + 2) * 1000 / 1e6 / 8)


@pytest.mark.parametrize("cut", ["mid-line", "before-newline", "mid-batch"])
def test_torn_tail_dropped_and_cut(path, cut, capsys):
    data = path.read_bytes()
    whole_first_batch = data[: data.index(b"\n", data.index(b"\n") + 1) + 1]
    if cut == "mid-line":
        torn = data[:-40]  # the last row loses its end
    elif cut == "before-newline":
        torn = data[:-1]  # a complete JSON row whose newline never reached the disk
    else:
        torn = data[: data.rindex(b"\n", 0, len(data) - 1) + 1]  # batch 1 lost its second row
    path.write_bytes(torn)
    rows = read_samples(path, "H", repair=True)
    assert [r["id"] for r in rows] == ["a", "b"]  # batch 1 is dropped whole: it runs again as one batch
    assert "dropping a torn last" in capsys.readouterr().err
    assert path.read_bytes() == whole_first_batch
    append_samples(path, _rows(1, ["c", "d"]))
    assert [r["id"] for r in read_samples(path, "H")] == ["a", "b", "c", "d"]


def test_corrupt_middle_line_names_file_and_line(path):
    lines = path.read_text().splitlines(keepends=True)
    lines[1] = lines[1][:20] + "\n"
    path.write_text("".join(lines))
    with pytest.raises(UsageError, match=rf"{path}:2: not a JSON sample row"):
        read_samples(path)


def test_row_without_fields_is_refused(path):
    with path.open("a") as f:
        f.write(json.dumps({"id": "e"}) + "\n")
    with pytest.raises(UsageError, match=rf"{path}:5: not a sample row"):
        read_samples(path)


def test_duplicate_problem_refused(path):
    append_samples(path, _rows(2, ["b"]))
    with pytest.raises(UsageError, match=rf"{path}:5: problem b already has a sample \(line 2\)"):
        read_samples(path)


def test_rows_of_other_settings_refused(path):
    append_samples(path, _rows(2, ["e"], h="OTHER"))
    with pytest.raises(ResumeMismatchError, match=rf"{path}:5: sample e was written with other settings"):
        read_samples(path, "H")
    assert len(read_samples(path)) == 5  # without a hash to check, the rows are read as they are


def test_missing_file_is_empty(tmp_path):
    assert read_samples(tmp_path / "none.jsonl", repair=True) == []
