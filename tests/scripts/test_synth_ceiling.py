"""``scripts/synth_ceiling.py``: the Bayes ceiling of a ``traces synth`` routing, on a small set."""

from __future__ import annotations

import json

import pytest
from expertcast.commands.traces import main as traces_main


def test_ceiling_is_above_every_statistic_and_refuses_what_it_cannot_rebuild(tmp_path, capsys, load_script):
    script = load_script("synth_ceiling")
    t = tmp_path / "t"
    assert traces_main(["synth", "--shape", "4,16,2", "--sequences", "8", "--tokens", "40", "--prompt", "4",
                        "--seed", "3", "--out", str(t)]) == 0
    out = tmp_path / "c.json"
    assert script.main(["--traces", str(t), "--samples", "300", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    r = {x["predictor"]: x["recall_at_k_next_step"] for x in rec["rows"]}
    assert rec["command"] == "synth_ceiling" and rec["targets"] == 8 * 36 * 4 and rec["process"]["seed"] == 3
    # the Bayes forecast with the true preferences beats what it contains: the last step alone, the favourites alone
    assert r["bayes (true rho)"] > max(r["repeat-last"], r["rho top-K"]) > 0, r
    assert script.main(["--traces", str(t), "--samples", "10", "--json", str(out)]) == 0  # its own output: rewritten
    foreign = tmp_path / "f.json"
    foreign.write_text("{}")
    with pytest.raises(SystemExit, match="--json .* exists and was not written by expertcast as this output"):
        script.main(["--traces", str(t), "--json", str(foreign)])
    assert foreign.read_text() == "{}"
    # a manifest whose settings do not redraw the set: refused, nothing computed
    m = json.loads((t / "manifest.json").read_text())
    m["run"]["seed"] = 4
    (t / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(SystemExit, match="differs from the trace set"):
        script.main(["--traces", str(t)])
    x = tmp_path / "x"
    assert traces_main(["synth", "--shape", "4,16,2", "--sequences", "2", "--tokens", "8", "--prompt", "2",
                        "--cross-layer", "0.5", "--out", str(x)]) == 0
    with pytest.raises(SystemExit, match="cross_layer 0 only"):
        script.main(["--traces", str(x)])
