"""Live cache-aware routers in the offloading runtime (issue 13, "Live routers").

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

import numpy as np
import pytest
import torch
from expertcast.inference.driver import COUNTER_NAMES, RecordedTransport
from expertcast.inference.policies import make_policy
from expertcast.inference.runtime.engine import OffloadedModel
from expertcast.inference.runtime.live_routers import LiveRouterScores
from expertcast.inference.simulator import build_stream, replay
from expertcast.models.cache_routers import record_router_outputs
from expertcast.models.router_export import load_adaptation_export

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
    sim = replay(build_stream(res_meta(om), res.traces, batch_size=batch), sim_policy, om.cache_config,
                 transport=RecordedTransport(res.landings))
    st = om.stats
    for k in COUNTER_NAMES:
        assert np.array_equal(getattr(st, k), getattr(sim, k)), (k, getattr(st, k), getattr(sim, k))
    assert st.decoded_tokens == sim.decoded_tokens and st.A > 0
    assert resident == sim.resident
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
