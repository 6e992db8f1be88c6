"""The eval session (inference/runtime/session.py): typed settings checked on construction, every cheap check of
a run before the model loads, the model loaded once and its host store reused by every offloaded run, the
paired speed passes in their interleaved order; the lm-eval adapter and the commands build it from their own
flags (no argparse namespace in the library)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from expertcast.inference.cache.expert_cache import Budget
from expertcast.inference.runtime.session import (
    ModelSession,
    SessionSettings,
    SpeedRun,
    check_run,
    paired_speed,
)
from expertcast.utils.errors import UsageError

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("kwargs, says", [
    ({"store": "disk"}, "needs the path of its expert file"),
    ({"store": "disk", "disk_path": "x", "mmap_path": "y"}, "--store disk and --mmap-store exclude each other"),
    ({"store": "disk", "disk_path": "x", "link_gbps": 1.0}, "--link-gbps emulates a link"),
    ({"disk_path": "x"}, "--disk-path needs --store disk"),
    ({"dtype": "int3"}, "dtype 'int3'"),
    ({"pool": "global"}, "pool 'global'"),
    ({"decode_path": "fast"}, "decode path 'fast'"),
])
def test_settings_refuse_what_cannot_run(kwargs, says):
    with pytest.raises(UsageError, match=says):
        SessionSettings(model="m", model_path="m", **kwargs)


def test_check_run_checks_before_anything_loads():
    run = check_run("qwen3_moe-tiny", "lrfu:lam=0.1", Budget.fraction(0.5), "per-layer")
    assert run.policy_name == "lrfu" and run.options == {"lam": 0.1} and run.files == {}
    L, E, K = run.shape
    assert run.cache_config.total_slots == L * (E // 2) and run.model_path == "qwen3_moe-tiny"
    with pytest.raises(UsageError, match="is an oracle"):
        check_run("qwen3_moe-tiny", "belady", Budget.fraction(0.5), "per-layer")
    with pytest.raises(UsageError, match="--slots 1"):
        check_run("qwen3_moe-tiny", "lru", Budget.slots(1), "per-layer")  # below top-K


def test_a_byte_budget_is_checked_with_the_models_expert_size():
    """``--budget-gb``: check_run resolves bytes // (one expert at the config's dtype) slots, split over the
    layers, and names the flag when what it buys is below top-K."""
    from expertcast.inference.runtime.session import model_spec

    spec = model_spec("qwen3_moe-tiny")
    L, E, K, xb = spec.num_layers, spec.num_experts, spec.top_k, spec.expert_bytes
    run = check_run("qwen3_moe-tiny", "lru", Budget.bytes(L * (E // 2) * xb), "per-layer")
    assert run.cache_config.total_slots == L * (E // 2)
    with pytest.raises(UsageError, match="^--budget-gb "):
        check_run("qwen3_moe-tiny", "lru", Budget.bytes(L * (K - 1) * xb), "per-layer")
    assert check_run("qwen3_moe-tiny", "lru", Budget.bytes(L * (E // 2) * xb // 2), "per-layer",
                     expert_bytes=xb // 2).cache_config.total_slots == L * (E // 2)  # a format of half the bytes


def test_a_flag_dict_never_reaches_the_cache():
    """The session and the engine take a Budget: the flags' old dict form is refused before anything loads."""
    from expertcast.inference.policies import make_policy

    session = ModelSession(SessionSettings(model="qwen3_moe-tiny", model_path="qwen3_moe-tiny"))
    with pytest.raises(UsageError, match="a cache budget is"):
        session.offload(make_policy("lru"), {"capacity": 0.5})
    assert session.model is None
    with pytest.raises(UsageError, match="as a Budget"):
        check_run("qwen3_moe-tiny", "lru", {"slots": 8}, "per-layer")


def test_the_model_loads_once_and_its_store_serves_every_run():
    import torch
    from expertcast.inference.policies import make_policy

    session = ModelSession(SessionSettings(model="qwen3_moe-tiny", model_path="qwen3_moe-tiny"))
    om = session.offload(make_policy("lru"), Budget.fraction(0.5))
    model, store = session.model, session.store
    ids = session.tok(["1 + 1 ="], return_tensors="pt")
    first = om.generate(ids["input_ids"], ids["attention_mask"], max_new_tokens=4).sequences
    session.give_back(om)
    assert om.pool is None  # its slots released before the next run allocates its own
    om2 = session.offload(make_policy("lfu"), Budget.slots(8))
    assert session.model is model and om2.store is store  # loaded once, the store reused
    again = om2.generate(ids["input_ids"], ids["attention_mask"], max_new_tokens=4).sequences
    assert torch.equal(first, again)  # offloading never changes a token
    session.give_back(om2)


def test_paired_passes_interleave_and_pair_each_offloaded_pass_with_its_neighbours():
    order: list[str] = []
    base_speed = iter([100.0, 50.0, 100.0])
    off_speed = iter([40.0, 60.0])

    def run(kind: str, speeds):
        def go() -> SpeedRun:
            order.append(kind)
            return SpeedRun(kind, 10, 10 / next(speeds), [[1, 2]])
        return go

    got = paired_speed(run("offloaded", off_speed), run("base", base_speed), 2)
    assert order == ["base", "offloaded", "base", "offloaded", "base"]
    assert got["paired_pct"] == pytest.approx([100 * 40 / 75, 100 * 60 / 75])
    assert got["pct_full_min"] == pytest.approx(100 * 40 / 75) and got["pct_full_max"] == pytest.approx(80.0)
    assert got["tokens_match"] and got["baseline"] == "base"


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


@pytest.mark.parametrize("module", ["harness/lm_eval_adapter.py", "inference/runtime/session.py"])
def test_the_library_builds_no_argparse_namespace_and_imports_no_command(module):
    names = _imports(REPO / module)
    assert not any(n == "argparse" or n.startswith("argparse.") for n in names)
    assert not any(n.startswith("expertcast.commands") for n in names)
    assert "types.SimpleNamespace" not in names  # no faked namespace
    private = sorted(n for n in names if n.startswith("expertcast.") and n.rsplit(".", 1)[1].startswith("_"))
    assert not private, f"{module} imports private names: {private}"


def test_a_ratio_whose_passes_disagree_or_all_beat_the_baseline_is_flagged_not_reported():
    from expertcast.inference.runtime.session import WIDE_SPREAD_PTS, speed_flag, speed_line

    ok = {"pct_full": 99.0, "pct_full_min": 96.0, "pct_full_max": 103.0, "baseline": "all-resident", "repeats": 3,
          "tokens_per_s": 10.0, "baseline_tokens_per_s": 10.1}
    assert speed_flag(ok) is None  # 100% within its noise: a result
    noisy = {**ok, "pct_full_min": 66.2, "pct_full_max": 66.2 + WIDE_SPREAD_PTS + 1}
    assert speed_flag(noisy).startswith("noisy: the paired ratios span 66.2-77.2%")
    above = {**ok, "pct_full": 129.0, "pct_full_min": 125.0, "pct_full_max": 131.0}
    assert speed_flag(above).startswith("above 100% in every pair")
    line = speed_line({**above, "flag": speed_flag(above)}, "8 problems")
    assert line.startswith("speed: NOT A RESULT (above 100%") and "offloaded 10.0 tokens/s, all-resident 10.1" in line
    assert speed_line({**ok, "flag": None}, "8 problems").startswith("speed: 99.0% of full speed against all-resident")


def test_paired_passes_run_against_the_same_runtime_with_every_expert_resident():
    from expertcast.inference.policies import make_policy
    from expertcast.inference.runtime.eval_run import RESIDENT_BASELINE
    from expertcast.inference.runtime.session import choose_baseline, paired_speed_passes

    session = ModelSession(SessionSettings(model="qwen3_moe-tiny", model_path="qwen3_moe-tiny"))
    session.give_back(session.offload(make_policy("lru"), Budget.fraction(0.25)))  # loaded: the store is there
    kind, choice = choose_baseline("auto", session)
    assert kind == RESIDENT_BASELINE and choice["needed_bytes"] == session.store.nbytes
    enc = session.tok(["1 + 1 =", "2 + 3 ="], return_tensors="pt", padding=True)
    speed = paired_speed_passes(session, [dict(enc)], lambda: make_policy("lru"), Budget.fraction(0.25), 4, kind, 2,
                                max_new_tokens=5, eos=[])
    assert speed["baseline"] == RESIDENT_BASELINE and speed["tokens_match"]  # same runtime, same tokens
    assert len(speed["baseline_passes"]) == 3 and speed["flag"] == speed_flag_of(speed)


def speed_flag_of(speed):
    from expertcast.inference.runtime.session import speed_flag

    return speed_flag(speed)
