"""``scripts/bench_disk_resim.py``: a finished run's card again, on another link figure. At the run's own figure it
gives the run's ``sim_*`` columns exactly (the same code path); on a slower link every stall grows; a record whose
routing no longer matches its fingerprint, or a link figure that is not one, is refused in one line."""

from __future__ import annotations

import json

import pytest
import torch


def test_resim_reproduces_the_run_and_refuses_what_it_cannot(tmp_path, capsys, load_script):
    threads = torch.get_num_threads()
    try:
        assert load_script("bench_disk").main(["--quick", "--out", str(tmp_path / "o"), "--policies", "lru",
                                               "belady"]) == 0
    finally:
        torch.set_num_threads(threads)
    path = tmp_path / "o" / "bench_disk.json"
    rec = json.loads(path.read_text())
    assert all(r["sim_disk_gbps"] == rec["disk_gbps_bound"] for r in rec["rows"])
    script = load_script("bench_disk_resim")
    slow = rec["disk_gbps_bound"] / 4
    assert script.main(["--record", str(path), "--link", "bound", str(slow), "--json", str(tmp_path / "r.json")]) == 0
    out = json.loads((tmp_path / "r.json").read_text())
    assert out["command"] == "bench_disk_resim" and out["code_version"]
    again, slower = out["tables"]["bound"]["rows"], out["tables"][str(slow)]["rows"]
    assert len(again) == len(rec["rows"]) == len(slower)
    for r, a, s in zip(rec["rows"], again, slower, strict=True):
        assert (a["policy"], a["budget"]) == (r["policy"], r["budget"])
        assert a["sim_hit"] == r["sim_hit"] and a["sim_tokens_per_s"] == pytest.approx(r["sim_tokens_per_s"], rel=1e-9)
        assert a["sim_vs_measured"] == pytest.approx(r["sim_tokens_per_s"] / r["tokens_per_s"], rel=1e-9)
        assert s["sim_disk_gbps"] == slow and s["sim_stall_ms_per_token"] > a["sim_stall_ms_per_token"] > 0
    capsys.readouterr()
    bad = dict(rec, provenance=dict(rec["provenance"], routing_fingerprint="0" * 16))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    for argv, msg in ((["--record", str(tmp_path / "bad.json")], "fingerprint differs"),
                      (["--record", str(path), "--link", "fast"], "expected one-pass, bound or GB/s"),
                      (["--record", str(path), "--link", "-1"], "must be positive"),
                      (["--record", str(path), "--json", str(path)], "--json")):
        with pytest.raises(SystemExit) as e:
            script.main(argv)
        assert msg in str(e.value), (argv, e.value)
    assert json.loads(path.read_text()) == rec  # the foreign --json left as it was
