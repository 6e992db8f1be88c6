"""The shared JSON field checks (utils/jsonfields.py) and the three readers that use them: trace import rows, cue
sets and forecaster exports keep their own error classes and messages, with one set of rules."""

from __future__ import annotations

import json

import pytest
from expertcast.utils.jsonfields import check_format, int_field, is_int, is_str_list, require_keys


class Boom(ValueError):
    pass


def test_int_field_takes_json_integers_only():
    assert [is_int(v) for v in (3, -1, True, 3.0, "3", None)] == [True, True, False, False, False, False]
    assert int_field(5, "token", "f:1", 0, 9, Boom) == 5
    for v, msg in ((True, "f:1: token must be an integer, got true"), ("5", 'f:1: token must be an integer, got "5"'),
                   (2.0, "f:1: token must be an integer, got 2.0"), (10, r"f:1: token 10 outside \[0, 9\]")):
        with pytest.raises(Boom, match=msg):
            int_field(v, "token", "f:1", 0, 9, Boom)


def test_check_format_and_keys():
    words = dict(wrong_format=lambda f: f"format {f!r}", bad_version=lambda v: f"version {v!r}")
    assert check_format({"format": "x", "format_version": 2}, "x", 2, Boom, **words) == 2
    for d, msg in (({"format": "y", "format_version": 1}, "format 'y'"), ([1], "format 'list'"),
                   ({"format_version": 1}, "format None"), ({"format": "x", "format_version": 3}, "version 3"),
                   ({"format": "x", "format_version": 0}, "version 0"), ({"format": "x"}, "version None"),
                   ({"format": "x", "format_version": True}, "version True"),
                   ({"format": "x", "format_version": "1"}, "version '1'")):
        with pytest.raises(Boom, match=msg):
            check_format(d, "x", 2, Boom, **words)
    require_keys({"a": 1, "b": 2}, ("a", "b"), Boom, str)
    with pytest.raises(Boom, match=r"\['c', 'd'\]"):
        require_keys({"a": 1}, ("c", "a", "d"), Boom, str)
    assert is_str_list(["Wait"]) and not is_str_list([]) and is_str_list([], nonempty=False)
    assert not is_str_list(["Wait", ""]) and not is_str_list("Wait") and not is_str_list([3])


def test_readers_keep_their_messages(tmp_path):
    from expertcast.data.importers.common import ImportFormatError
    from expertcast.data.importers.jsonl import read_import_jsonl
    from expertcast.inference.saem.cues import CUESET_FORMAT, CUESET_FORMAT_VERSION, CueSet
    from expertcast.models.forecaster_export import EXPORT_FORMAT, ForecasterExportError, read_export_config
    from expertcast.utils.errors import UsageError

    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps({"seq": 0, "token": True, "layer": 0, "experts": [0, 1]}) + "\n")
    with pytest.raises(ImportFormatError, match=f"{f}:1: token must be an integer, got true"):
        read_import_jsonl(f, 8)
    f.write_text(json.dumps({"seq": 0, "layer": 0}) + "\n")
    with pytest.raises(ImportFormatError, match=f"{f}:1: missing field\\(s\\) token, experts"):
        read_import_jsonl(f, 8)

    with pytest.raises(UsageError, match="is not an expertcast cue set"):
        CueSet.from_dict({"format": "other", "cues": ["Wait"]})
    for ver in (True, 0, CUESET_FORMAT_VERSION + 1):  # a boolean is no version (it was taken for 1 before)
        with pytest.raises(UsageError, match=f"has cue-set format_version {ver!r}; this expertcast reads"):
            CueSet.from_dict({"format": CUESET_FORMAT, "format_version": ver, "cues": ["Wait"]})
    with pytest.raises(UsageError, match='"cues" must be a non-empty list of strings'):
        CueSet.from_dict({"format": CUESET_FORMAT, "format_version": 1, "cues": ["Wait", 3]})

    p = tmp_path / "forecaster.json"
    for doc, msg in (({"format": "nope"}, "is not a forecaster export: format 'nope', expected"),
                     ([], "is not a forecaster export: format 'list'"),
                     ({"format": EXPORT_FORMAT, "format_version": True}, "format version True is not supported"),
                     ({"format": EXPORT_FORMAT, "format_version": 1, "config": {}},
                      "forecaster export is missing the 'weights' entry")):
        p.write_text(json.dumps(doc))
        with pytest.raises(ForecasterExportError, match=msg):
            read_export_config(tmp_path)
