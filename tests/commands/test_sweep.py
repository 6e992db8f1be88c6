"""`expertcast sweep`: policies x capacities x benchmarks through eval's code, one table/CSV/PNG, resumable
per cell (a finished cell is re-read, not regenerated), refusals before the model loads."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from expertcast.cli import main as cli_main
from expertcast.commands.evaluate import SAMPLES
from expertcast.commands.sweep import main
from expertcast.utils.errors import UsageError

ARGS = ["--model", "qwen3_moe-tiny", "--benchmarks", "gsm8k,math500", "--policies", "lru", "--capacity", "0.5",
        "--limit", "1", "--max-new-tokens", "3", "--no-progress", "--device", "cpu", "--speed-repeats", "1"]


def with_opt(flag: str, value: str) -> list[str]:
    """ARGS with ``flag``'s value replaced."""
    out = list(ARGS)
    out[out.index(flag) + 1] = value
    return out


def test_sweep_table_and_resume(tmp_path, data_dir, capsys, wandb_dir, offline_contents):
    out = tmp_path / "sw"
    assert main([*ARGS, "--wandb", "--wandb-project", "t", "--out", str(out)]) == 0
    table = list(csv.DictReader((out / "sweep.csv").open()))
    [run] = sorted((wandb_dir / "wandb").glob("offline-run-*"))  # the table and the plot, logged offline
    # the media files land before wandb's service writes the run's log (its metric definitions): wait for all three
    got = offline_contents(run, lambda g: any(Path(t).name.startswith("sweep") for t in g["tables"])
                           and any(Path(i).name.startswith("sweep_plot") for i in g["images"])
                           and {"gsm8k lru/hit", "math500 lru/hit"} <= set(g["step_axes"]))
    [logged] = [json.loads((run / t).read_text()) for t in got["tables"] if Path(t).name.startswith("sweep")]
    assert [r[logged["columns"].index("benchmark")] for r in logged["data"]] == ["gsm8k", "math500"]
    assert any(Path(i).name.startswith("sweep_plot") for i in got["images"])
    assert got["step_axes"]["gsm8k lru/hit"] == got["step_axes"]["math500 lru/hit"] == "capacity"  # per-capacity series
    assert [(r["benchmark"], r["policy"], float(r["capacity"])) for r in table] == [
        ("gsm8k", "lru", 0.5), ("math500", "lru", 0.5)]
    assert (out / "sweep.png").stat().st_size > 0
    rows = json.loads((out / "sweep.json").read_text())["rows"]
    for r in rows:
        assert 0 <= r["hit"] <= 1 and r["baseline"] == "all-resident" and r["tokens_match"]
        # against the same runtime with every expert resident; a ratio whose passes disagree is flagged, not given
        assert r["pct_full"] is None if r["speed_flag"] else r["pct_full_min"] <= r["pct_full"] <= r["pct_full_max"]
        assert r["peak_rss_gb"] > 0  # each cell's own peak
    for bench in ("gsm8k", "math500"):
        cell = out / "cells" / bench / "lru@c0.5"
        assert (cell / SAMPLES).is_file()
        assert json.loads((cell / "settings.json").read_text())["benchmark"] == bench
        assert (cell / "speed.json").is_file()
    samples = {p: (p / SAMPLES).read_bytes() for p in (out / "cells").glob("*/*")}
    capsys.readouterr()

    assert main([*ARGS, "--out", str(out)]) == 0  # finished cells are re-read, nothing regenerated
    o = capsys.readouterr().out
    assert o.count("speed: reusing") == 2 and o.count("0 to go") == 2
    assert {p: (p / SAMPLES).read_bytes() for p in (out / "cells").glob("*/*")} == samples

    # the same values from a --config file: the same resume keys (cells re-read), the file recorded beside them
    settings = json.loads((out / "sweep.json").read_text())["settings"]
    cfg = tmp_path / "sweep.yaml"
    cfg.write_text("model: qwen3_moe-tiny\nbenchmarks: gsm8k,math500\npolicies: lru\ncapacity: 0.5\nlimit: 1\n"
                   "max-new-tokens: 3\nno_progress: true\ndevice: cpu\nspeed_repeats: 1\n")
    assert main(["--config", str(cfg), "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("0 to go") == 2
    saved = json.loads((out / "sweep.json").read_text())
    assert saved["settings"] == settings and saved["config"]["path"] == str(cfg.resolve())

    # a cell made with other settings is refused, naming the setting
    assert main([*with_opt("--max-new-tokens", "4"), "--out", str(out)]) == 2
    assert "max_new_tokens" in capsys.readouterr().err


def test_sweep_refuses_bad_cells_before_loading(tmp_path, data_dir, capsys):
    assert main([*with_opt("--benchmarks", "gsm8k,nope"), "--out", str(tmp_path / "a")]) == 2
    assert "unknown benchmark 'nope'" in capsys.readouterr().err
    assert main([*with_opt("--policies", "lru,belady"), "--out", str(tmp_path / "b")]) == 2
    assert "oracle" in capsys.readouterr().err
    assert main([*with_opt("--capacity", "0.25,1.5"), "--out", str(tmp_path / "c")]) == 2
    assert "--capacity" in capsys.readouterr().err
    assert not any((tmp_path / d).exists() for d in "abc")
    assert cli_main(["sweep", "--help"]) == 0 and "--policies" in capsys.readouterr().out


def test_sweep_resume_with_a_limit_that_cuts_a_batch_is_refused(tmp_path, data_dir, capsys):
    """A cell resumes as eval does: a smaller --limit inside a batch of the earlier run is refused."""
    base = [*with_opt("--benchmarks", "gsm8k"), "--batch-size", "2", "--baseline", "none"]
    out = tmp_path / "sw"
    assert main([*base[:base.index("--limit")], "--limit", "2", *base[base.index("--limit") + 2:], "--out",
                 str(out)]) == 0
    capsys.readouterr()
    assert main([*base, "--out", str(out)]) == 2  # --limit 1 cuts the first batch (2 problems)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "counters cannot be split" in err[0], err


def test_config_file_values_and_flag_override_equal_the_command_line(tmp_path):
    from expertcast.commands.sweep import build_parser

    cfg = tmp_path / "sweep.yaml"
    cfg.write_text("model: qwen3_moe-tiny\nbenchmarks: arith\npolicies: lru,lfu\ncapacity: 0.25,0.5\n"
                   "max_new_tokens: 16\nno-progress: true\nout: runs/s\n")
    got = vars(build_parser().parse_args(["--config", str(cfg), "--capacity", "0.5", "--out", "runs/t"]))
    flags = vars(build_parser().parse_args(["--model", "qwen3_moe-tiny", "--benchmarks", "arith",
                                            "--policies", "lru,lfu", "--capacity", "0.5", "--max-new-tokens", "16",
                                            "--no-progress", "--out", "runs/t"]))
    assert got.pop("config") == str(cfg) and flags.pop("config") is None
    assert got == flags


def test_sweep_runs_int8_experts_and_records_the_format(tmp_path, data_dir):
    out = tmp_path / "q"
    argv = [*with_opt("--benchmarks", "arith"), "--expert-dtype", "int8", "--baseline", "resident"]
    assert main([*argv, "--out", str(out)]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert sweep["expert_dtype"] == "int8" and sweep["guard"] == {}
    (cell,) = out.glob("cells/arith/*/summary.json")
    s = json.loads(cell.read_text())
    assert s["expert_dtype"] == "int8" and s["load"]["plan"]["expert_format"] == "int8" and s["speed"]["tokens_match"]


def test_a_byte_budget_sweep_plans_its_cells_in_place_of_the_default_fractions(data_dir):
    """``--budget-gb`` (no ``--capacity``): the default fractions give way; each cell is an eval run at
    ``--budget-gb G`` whose capacity row is ``{"budget_gb": G}`` and whose folder names the bytes."""
    from expertcast.commands.sweep import SWEEP_CAPACITIES, build_parser, plan_cells, table_row
    from expertcast.inference.cache.expert_cache import Budget
    from expertcast.inference.runtime.session import model_spec

    spec = model_spec("qwen3_moe-tiny")
    gb = spec.num_layers * (spec.num_experts // 2) * spec.expert_bytes / 1e9  # half the experts at the config dtype
    argv = [a for a in ARGS if a not in ("--capacity", "0.5")]
    cells = plan_cells(build_parser().parse_args([*argv, "--budget-gb", str(gb), "--out", "unused"]))
    assert [c["cap"] for c in cells] == [Budget.gb(gb)] * 2 and cells[0]["args"].budget_gb == str(gb)
    info = cells[0]["cell"]["info"]
    assert info["capacity"] == {"budget_gb": gb} and cells[0]["rel"].endswith(f"lru@b{round(gb * 1e9)}")
    assert info["cache"] == f"per-layer pools of {spec.num_experts // 2} slots (50.0% of L*E)"
    row = table_row("gsm8k", "lru", cells[0]["cap"], {})
    assert row["capacity"] == gb and row["capacity_kind"] == "budget_gb"
    with pytest.raises(UsageError, match="give --budget-gb"):
        plan_cells(build_parser().parse_args([*ARGS, "--budget-gb", str(gb), "--out", "unused"]))
    assert build_parser().parse_args([*argv, "--out", "x"]).capacity == SWEEP_CAPACITIES
