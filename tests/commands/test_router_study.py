"""The router study's settings and runs (``expertcast router-eval``): the base sw of every mode, the run
selection by name, and the decode batch in the evaluation key. Combining studies over seeds is tested through
the command (tests/commands/test_router_eval.py)."""

from __future__ import annotations


def test_study_runs_take_the_base_sw():
    from expertcast.commands.router_study import StudyConfig, select_runs, study_runs

    runs = {r.name: r for r in study_runs([0.3], [], 0.25, base_sw=1.0)}
    assert {n: (r.mode, r.sw) for n, r in runs.items() if n != "lm_only"} == {
        "aux_temporal_sw1": ("aux_only", 1.0), "aux_full_sw1": ("aux_only", 1.0), "temporal_sw1": ("temporal", 1.0),
        "full_sw1": ("full", 1.0), "spatio_sw1": ("spatio_only", 1.0), "temporal_sw0.3": ("temporal", 0.3),
        "full_sw0.3": ("full", 0.3)}
    assert runs["lm_only"].sw == 0.0
    cfg = StudyConfig(sw=1.0, sw_sweep=[], modes=["lm_only", "spatio_sw1"])
    assert [(r.name, r.sw) for r in select_runs(cfg)] == [("lm_only", 0.0), ("spatio_sw1", 1.0)]
    # the decode batch is part of what the cached evaluation is keyed by
    assert StudyConfig().decode_settings()["decode_batch_size"] == 1
    assert StudyConfig(decode_batch_size=4).decode_settings()["decode_batch_size"] == 4
