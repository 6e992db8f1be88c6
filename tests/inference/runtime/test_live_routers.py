"""Live cache-aware routers in the offloading runtime (docs/design.md, "Live cache-aware routers").

A router-adaptation export (tiny Qwen3-MoE preset, routers randomly initialised, written by the
module's own export) is loaded without Lightning; its routers are attached to the live model
(:class:`LiveRouterScores`) and drive Algorithm 1 / 2 through the one driver. For every router mode,
at batch 1 and batch 4 (left padding, members ending early on EOS):

* token identity: the offloaded greedy generation equals the full-load model's ``generate``;
* live scores: what the hooks wrote at each position equals a teacher-forced pass of the routers over
  the generated sequence (so each step really reads the router outputs of its own position);
* parity: the simulator replaying the run the runtime recorded (routing, landings, and the router
  outputs as a RouterReplay) ends with equal counters and resident set.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from expertcast.inference.cache.counters import COUNTER_NAMES
from expertcast.inference.cache.driver import RecordedTransport
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.runtime.live_routers import LiveRouterScores
from expertcast.inference.sim.simulator import build_stream, replay
from expertcast.models.backbone import load_adaptation_export
from expertcast.models.cache_routers import record_router_outputs

torch.set_num_threads(1)

EOS = [7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31]
NEW = 12
SLOTS = 6  # per layer, of E=16 (top-K=4)
LINK_GBPS = 0.02  # prefetches land late
CASES = [("temporal", "router-temporal", None), ("full", "router-full", 3), ("spatio_only", "router-spatio", 3)]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    from expertcast.train.router_module import RouterAdaptationModule

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for mode, _, _ in CASES:
        module = RouterAdaptationModule(model="qwen3_moe-tiny", mode=mode, init="random", seed=1)
        out[mode] = module.export(root / mode)
    return out


def assert_simulator_replays_the_run(om: OffloadedModel, res: Any, sim_policy: Any, batch: int, resident: Any) -> Any:
    """The simulator replaying the runtime's recorded run (routing, landings, router outputs in ``sim_policy``)
    ends with the runtime's counters, decoded tokens and resident set; returns the runtime's stats."""
    sim = replay(build_stream(res_meta(om), res.traces, batch_size=batch), sim_policy, om.cache_config,
                 transport=RecordedTransport(res.landings))
    st = om.stats
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(sim, k)), (k, getattr(st, k), getattr(sim, k))
    assert st.decoded_tokens == sim.decoded_tokens and st.A > 0
    assert resident == sim.resident
    return st


def prompts(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(40, 500, (batch, 8), generator=g)
    am = torch.ones_like(ids)
    for i in range(1, batch):  # left padding: prompts of 8, 7, 6, ... tokens
        am[i, :i] = 0
        ids[i, :i] = 0
    return ids, am


@pytest.mark.parametrize("batch", [1, 4], ids=["batch1", "batch4"])
@pytest.mark.parametrize("mode,policy_name,R", CASES, ids=[c[0] for c in CASES])
def test_live_routers_token_identical_and_parity(exports, mode, policy_name, R, batch):
    model, _, routers, info = load_adaptation_export(exports[mode])
    assert info["router_mode"] == mode and routers is not None
    ids, am = prompts(batch)
    ref = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=EOS,
                         pad_token_id=0)
    seq_ids = [f"s{i}" for i in range(batch)]
    live = LiveRouterScores(model, routers)
    policy = make_policy(policy_name, replay=live, R=R)
    om = OffloadedModel(model, policy, SLOTS, link_gbps=LINK_GBPS)
    try:
        res = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0, record=True, seq_ids=seq_ids)
        resident = om.cache.resident_set()
    finally:
        model = om.restore()
        live.remove()
    assert torch.equal(res.sequences, ref), "offloading with live routers changed the greedy tokens"
    if batch > 1:
        assert len({s.num_tokens - s.prompt_len for s in res.traces}) > 1, "members should end at different steps"

    # the live scores are the routers' outputs at each position (teacher-forced pass over the generated text)
    recorded = live.recorded(res.traces)
    for s in res.traces:
        tf = record_router_outputs(model, routers, torch.as_tensor(s.token_ids[None].astype(np.int64)))
        rec = recorded[s.seq_id]
        for name in ("p_R", "p_T", "p_S"):
            got, want = getattr(rec, name), getattr(tf, name)
            assert (got is None) == (want is None), name
            if got is not None:
                np.testing.assert_allclose(got.astype(np.float32), want[0].numpy(), atol=2e-3, err_msg=name)

    # the simulator replays the recorded run (routing, landings, router outputs) with equal counters
    sim_policy = make_policy(policy_name, replay=recorded, R=R)
    st = assert_simulator_replays_the_run(om, res, sim_policy, batch, resident)
    if policy_name != "router-temporal":
        assert st.P > 0, "the pre-access refinement should have issued proactive loads"


def res_meta(om: OffloadedModel):
    from expertcast.data.trace_format import TraceMeta

    return TraceMeta("tiny", om.L, om.E, om.K, om.layout.expert_bytes)


def test_router_scores_drive_retention(exports):
    """The live Temporal scores change what the cache keeps: router-temporal's counters differ from LRU's
    on the same generation (else the scores would not reach the policy)."""
    model, _, routers, _ = load_adaptation_export(exports["temporal"])
    ids, am = prompts(4)
    stats = {}
    for name in ("lru", "router-temporal"):
        live = LiveRouterScores(model, routers)
        om = OffloadedModel(model, make_policy(name, **({"replay": live} if name != "lru" else {})), 5)
        try:
            om.generate(ids, am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0)
            stats[name] = om.stats.demand.copy()
        finally:
            model = om.restore()
            live.remove()
    assert not np.array_equal(stats["lru"], stats["router-temporal"])


def _eval(argv: list[str], capsys) -> tuple[int, str]:
    from expertcast.commands.evaluate import main

    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


def test_eval_runs_live_router_policies_on_an_export(exports, tmp_path, capsys, data_dir):
    """`expertcast eval --model EXPORT --policy router-*`: the export's routers drive the runtime, the
    completions equal LRU's on the same weights (offloading never changes tokens), the routers' hash is
    part of the settings; an export without the scores a policy reads is refused in one line."""
    import json

    base = ["--benchmark", "arith", "--limit", "2", "--max-new-tokens", "6", "--slots", "6", "--no-progress",
            "--device", "cpu", "--baseline", "none", "--batch-size", "2"]
    done = {}
    for name, spec in (("lru", "lru"), ("full", "router-full:R=3")):
        rc, err = _eval(["--model", str(exports["full"] / "model") if name == "lru" else str(exports["full"]),
                         "--policy", spec, "--out", str(tmp_path / name), *base], capsys)
        assert rc == 0, err
        done[name] = json.loads((tmp_path / name / "summary.json").read_text())
    lru, full = done["lru"], done["full"]
    assert full["settings"]["policy"]["artefacts_sha256"]["routers"]
    assert full["proactive_loads"] > 0 and full["accesses"] == lru["accesses"]
    comp = {k: [r["completion"] for r in map(json.loads, (tmp_path / k / "samples.jsonl").read_text().splitlines())]
            for k in done}
    assert comp["full"] == comp["lru"]
    rc, err = _eval(["--model", str(exports["temporal"]), "--policy", "router-spatio", "--out",
                     str(tmp_path / "bad"), *base], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "reads the scores of spatio_only or full routers" in err


# ---------------------------------------------------------------------------------------------- hybrid -----------
HYBRID_CASES = [("temporal", "auto"), ("full", "routers"), ("full", "forecast+routers+stage")]
CUES = dict(cues="a|e", decoder=lambda i: bytes([int(i) % 256]))


def _tiny_forecaster(model) -> Any:
    from expertcast.models.forecaster import ExpertForecaster, ForecasterConfig
    from expertcast.models.spec import MoESpec

    spec = MoESpec.from_config(model.config)
    torch.manual_seed(0)
    return ExpertForecaster(ForecasterConfig(num_layers=spec.num_layers, num_experts=spec.num_experts,
                                             top_k=spec.top_k, hidden_size=32, num_blocks=1, state_size=8,
                                             head_dim=16, chunk_size=16)).eval()


def _hybrid(fc, parts: str, **extra):
    kw = dict(forecaster=fc, precompute=False, prefetch_rule="floor", min_confidence=0.05, parts=parts, **extra)
    if "stage" in parts:
        kw.update(CUES)
    return make_policy("hybrid", **kw)


@pytest.mark.parametrize("batch", [1, 4], ids=["batch1", "batch4"])
@pytest.mark.parametrize("mode,parts", HYBRID_CASES, ids=[f"{m}-{p}" for m, p in HYBRID_CASES])
def test_hybrid_live_routers_token_identical_and_parity(exports, mode, parts, batch, capsys):
    """`hybrid` on a router export in the runtime: attach_live_routers (what `expertcast eval` calls) gives its
    routers part the live s^T; greedy tokens equal full load; the simulator replaying the recorded run (routing,
    landings, the routers' outputs) with the same hybrid ends with equal counters and resident set."""
    from expertcast.inference.runtime.live_routers import attach_live_routers, detach_live_routers

    model, _, _, _ = load_adaptation_export(exports[mode])
    fc = _tiny_forecaster(model)
    ids, am = prompts(batch)
    ref = model.generate(input_ids=ids, attention_mask=am, max_new_tokens=NEW, do_sample=False, eos_token_id=EOS,
                         pad_token_id=0)
    policy = _hybrid(fc, parts)
    om = OffloadedModel(model, policy, SLOTS, link_gbps=LINK_GBPS)
    try:
        attach_live_routers(policy, om.model, str(exports[mode]))
        live = policy.replay
        assert isinstance(live, LiveRouterScores) and "routers" in policy.parts
        res = om.generate(ids, am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0, record=True,
                          seq_ids=[f"s{i}" for i in range(batch)])
        resident = om.cache.resident_set()
        router_term = policy._router_term.copy()
    finally:
        detach_live_routers(policy)
        model = om.restore()
    assert policy.replay is None  # detached: a full-load pass runs without the hooks
    assert "hybrid: routers part on" in capsys.readouterr().err
    assert torch.equal(res.sequences, ref), "hybrid with live routers changed the greedy tokens"
    assert router_term.sum() > 0, "the live s^T never reached the priority"

    sim_policy = _hybrid(fc, parts, replay=live.recorded(res.traces))
    assert sim_policy.parts == policy.parts
    st = assert_simulator_replays_the_run(om, res, sim_policy, batch, resident)
    if "forecast" in policy.parts:
        assert st.P > 0, "the forecast part should have issued proactive loads"
    else:
        assert st.P == 0, "without the forecast part the hybrid is demand-only"


def test_hybrid_live_router_part_changes_counters(exports):
    """The live s^T reach the eviction priority: forecast+routers evicts differently from forecast alone."""
    from expertcast.inference.runtime.live_routers import attach_live_routers, detach_live_routers

    model, _, _, _ = load_adaptation_export(exports["temporal"])
    fc = _tiny_forecaster(model)
    ids, am = prompts(1)
    demand = {}
    for parts in ("forecast", "forecast+routers"):  # a heavy router term: its s^T must change what is evicted
        policy = _hybrid(fc, parts, prefetch=False, router_weight=20.0)
        om = OffloadedModel(model, policy, 8)
        try:
            attach_live_routers(policy, om.model, str(exports["temporal"]))
            om.generate(ids, am, max_new_tokens=NEW, eos_token_id=EOS, pad_token_id=0)
            demand[parts] = om.stats.demand.copy()
        finally:
            detach_live_routers(policy)
            model = om.restore()
    assert not np.array_equal(demand["forecast"], demand["forecast+routers"])


def test_hybrid_without_router_export_runs_without_the_part_and_says_so(exports, capsys):
    """No router export (a plain model, or an export whose routers give no s^T): `auto` keeps its other parts and
    says why on stderr; an explicit routers part is refused in one line; replay= belongs to `simulate`."""
    from expertcast.inference.runtime.live_routers import attach_live_routers
    from expertcast.utils.errors import UsageError

    model, _, _, _ = load_adaptation_export(exports["spatio_only"])
    fc = _tiny_forecaster(model)
    plain = str(exports["spatio_only"] / "model")
    for where, why in ((plain, "no router-adaptation export"), (str(exports["spatio_only"]), "spatio_only routers")):
        policy = _hybrid(fc, "auto")
        om = OffloadedModel(model, policy, SLOTS)
        try:
            attach_live_routers(policy, om.model, where)
            attach_live_routers(policy, om.model, where)  # a second pass says nothing new
            assert policy.parts == ("forecast",) and policy.replay is None
            err = capsys.readouterr().err
            assert err.count("hybrid: routers part off") == 1 and why in err, err
            om.generate(*prompts(2), max_new_tokens=4, eos_token_id=EOS, pad_token_id=0)
        finally:
            model = om.restore()
        explicit = _hybrid(fc, "forecast+routers")
        om = OffloadedModel(model, explicit, SLOTS)
        try:
            with pytest.raises(UsageError, match="the routers part cannot run") as e:
                attach_live_routers(explicit, om.model, where)
            assert why in str(e.value)
            with pytest.raises(ValueError, match="needs the routers' scores"):  # never silently without them
                om.generate(*prompts(1), max_new_tokens=2, eos_token_id=EOS, pad_token_id=0)
        finally:
            model = om.restore()


def test_eval_runs_hybrid_with_live_routers(exports, tmp_path, capsys, data_dir):
    """`expertcast eval --model ROUTER_EXPORT --policy hybrid:...`: the routers part reads the export's live
    routers (said on stderr), tokens equal the run on the plain model folder, where the part is off (said too);
    the export's files (routers included) are in the settings; an explicit routers part on a plain model is
    refused with one error line."""
    import json

    from expertcast.models.forecaster_export import save_forecaster

    model, _, _, _ = load_adaptation_export(exports["temporal"])
    fc = save_forecaster(_tiny_forecaster(model), tmp_path / "fc", source={"model_id": "qwen3_moe-tiny"},
                         training={"train_ids": [], "val_ids": []})
    base = ["--benchmark", "arith", "--limit", "2", "--max-new-tokens", "6", "--slots", "6", "--no-progress",
            "--device", "cpu", "--baseline", "none", "--batch-size", "2",
            "--allow-model-mismatch"]  # the forecaster learnt the base's routing: allowed, and reported (below)
    spec = f"hybrid:forecaster={fc},prefetch_rule=floor,min_confidence=0.05"
    runs = {"export": str(exports["temporal"]), "plain": str(exports["temporal"] / "model")}
    done, errs = {}, {}
    for name, where in runs.items():
        rc, errs[name] = _eval(["--model", where, "--policy", spec, "--out", str(tmp_path / name), *base], capsys)
        assert rc == 0, errs[name]
        done[name] = json.loads((tmp_path / name / "summary.json").read_text())
        assert done[name]["guard_note"] and "allow-model-mismatch" in done[name]["guard_note"], done[name]["guard"]
    assert "hybrid: routers part on: s^T from the live temporal routers" in errs["export"]
    assert "hybrid: routers part off (--model" in errs["plain"] and "no router-adaptation export" in errs["plain"]
    from expertcast.utils.provenance import sha256_files

    # the run's model identity hashes the whole export folder: its routers are part of the resume key
    assert done["export"]["settings"]["model"]["files_sha256"] == sha256_files(exports["temporal"])
    assert any(p.parts[0] != "model" for p in (q.relative_to(exports["temporal"])
                                                for q in exports["temporal"].rglob("*.safetensors")))
    assert done["export"]["accesses"] == done["plain"]["accesses"] and done["export"]["proactive_loads"] > 0
    comp = {k: [r["completion"] for r in map(json.loads, (tmp_path / k / "samples.jsonl").read_text().splitlines())]
            for k in done}
    assert comp["export"] == comp["plain"]
    rc, err = _eval(["--model", runs["plain"], "--policy", spec + ",parts=forecast+routers", "--out",
                     str(tmp_path / "bad"), *base], capsys)
    last = err.strip().splitlines()[-1]
    assert rc == 2 and last.startswith("expertcast eval: error:") and "the routers part cannot run" in last, err


def test_live_router_specs_read_by_the_policy_option_parser():
    """A live router policy's text is read and typed by the one policy option parser: R typed and bounded by the
    options, replay= refused (the routers come from the --model export)."""
    from expertcast.inference.runtime.live_routers import live_router_policy
    from expertcast.utils.errors import UsageError

    assert live_router_policy("router-full:R=3") == ("router-full", {"R": 3})
    assert live_router_policy("Router-Temporal") == ("router-temporal", {})
    for spec, msg in [("router-full:R=0", "option R=0: must be >= 1"), ("router-full:R=x", "expected an integer"),
                      ("router-full:R", "must be key=value"), ("router-full:R=2,R=3", "given twice"),
                      ("router-spatio:replay=/x", "takes only R=N"), ("lru", "not a router policy")]:
        with pytest.raises(UsageError, match=msg):
            live_router_policy(spec)
