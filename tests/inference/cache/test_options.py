"""Typed policy options: parsing, validation messages naming the valid keys, file kinds, one spec per policy
whose options live beside its class, and a registry that never drops a policy silently."""

from __future__ import annotations

import inspect

import pytest
from expertcast.data.synthetic import zipf_traces
from expertcast.data.traces import write_traces
from expertcast.inference import policies
from expertcast.inference.cache.options import PolicyOptions, split_policy_list
from expertcast.inference.cache.spec import ENGINES, NEEDS, PolicySpec
from expertcast.inference.policies import (
    available_policies,
    make_policy,
    object_names,
    parse_policy_options,
    parse_policy_spec,
    policy_class,
    policy_spec,
    registry,
    spec_of,
)
from expertcast.utils.errors import UsageError


def test_values_are_typed_and_only_given_options_reach_the_constructor():
    o = parse_policy_options("lrfu:lam=0.1")
    assert o.lam == 0.1 and isinstance(o.lam, float) and o.history == "perfect"
    assert o.given_values() == {"lam": 0.1} and o.spec() == "lrfu:lam=0.1"
    k = parse_policy_options("belady-k:k=3")
    assert k.k == 3 and isinstance(k.k, int)
    assert parse_policy_spec("LFU:history=in-cache") == ("lfu", {"history": "in-cache"})
    assert parse_policy_spec("lru") == ("lru", {})
    assert split_policy_list("lru,lrfu:lam=0.1,history=in-cache,belady") == \
        ["lru", "lrfu:lam=0.1,history=in-cache", "belady"]
    name, kwargs = parse_policy_spec("lrfu:lam=0.1")
    assert make_policy(name, **kwargs).label == "lrfu(lam=0.1)"


@pytest.mark.parametrize("spec, message", [
    ("lru:foo=1", r"lru has no options \(got 'foo'\)"),
    ("lrfu:lamda=0.1", "lrfu has no option 'lamda'; options: lam, history"),
    ("lrfu:lam=2", r"lrfu option lam=2: must be in \[0.0, 1.0\]"),
    ("lrfu:lam=abc", "lrfu option lam=abc: expected a number"),
    ("lrfu:lam=0.1,lam=0.2", "lrfu option lam is given twice"),
    ("lfu:history=never", "lfu option history=never: expected one of perfect, in-cache"),
    ("belady-k:k=1.5", "belady-k option k=1.5: expected an integer"),
    ("belady-k:k=-1", "belady-k option k=-1: must be >= 0"),
    ("static:calibration=/etc/passwd", "static option calibration=/etc/passwd: not a trace set"),
    ("static:calibration=/no/such/dir", "does not exist; expected a trace directory"),
    ("static:miss=disk", "expected one of temp, cpu"),
    ("seqmoe", "seqmoe needs a forecaster"),
    ("seqmoe:forecaster=/etc", "not a forecaster export"),
    ("seqmoe:gamma=0,forecaster=/etc", r"gamma=0: must be in \(0.0, 1.0\]"),
    ("stage:cue_set=/etc/passwd", "stage option cue_set=/etc/passwd: cue set /etc/passwd is not valid JSON"),
    ("stage", "stage needs cues"),
    ("router-full", "router-full needs the routers' recorded outputs"),
    ("router-full:replay=/etc", "not a router replay"),
    ("lru:x", "must be key=value"),
    ("nope", "unknown policy 'nope'; available: lru"),
])
def test_malformed_options_are_one_line_usage_errors(spec, message):
    with pytest.raises(UsageError, match=message):
        parse_policy_options(spec)


def test_every_policy_has_one_spec_with_options_beside_its_class():
    """Each registered name has one spec; its options class is the class's ``Options`` (defined in the policy's
    module), its engines and needs are known words, the constructor takes the options and keyword-only loaded
    objects, and every option has help."""
    specs = registry()
    assert list(specs)[:4] == ["lru", "fifo", "lfu", "lrfu"]
    for name, spec in specs.items():
        assert isinstance(spec, PolicySpec) and spec.name == name and spec.help
        cls = policy_class(name)
        assert spec.options is cls.Options or spec.options is PolicyOptions, name
        assert spec.options is PolicyOptions or spec.options.__module__ == cls.__module__, name
        assert spec.engines <= ENGINES and spec.needs <= NEEDS
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
        assert not params or params[0].name == "options", name
        assert all(p.kind == p.KEYWORD_ONLY for p in params[1:]), name
        assert spec.options.describe() == [] or all(d["help"] for d in spec.options.describe()), name
        if not spec.needs - {"future"}:
            pol = cls()  # the defaults are the Options' (written once)
            assert spec_of(pol) is spec and pol.options == spec.options()
    assert {n for n, s in specs.items() if not s.live} == {"belady", "belady-k", "belady-seq", "stage-oracle"}
    assert {n for n, s in specs.items() if "device" in s.engines} == {"lru", "seqmoe"}
    assert [n for n, s in specs.items() if not s.runs_on("driver")] == ["belady-seq"]
    assert object_names(policy_class("static")) == ["calibration"]


def test_make_policy_names_the_valid_keys_and_loads_trace_options(tmp_path):
    with pytest.raises(UsageError, match="lrfu has no option 'lamda'; options: lam, history"):
        make_policy("lrfu", lamda=0.1)
    with pytest.raises(UsageError, match="lru has no options"):
        make_policy("lru", foo=1)
    tr = zipf_traces(2, 20, num_layers=2, num_experts=8, top_k=2, seed=1)
    d = write_traces(tmp_path / "cal", tr.meta, tr.sequences)
    pol = make_policy("static", calibration=str(d))
    assert pol.label == f"static(calibration={d})" and pol.freq.shape == (2, 8) and pol.freq.sum() > 0
    with pytest.raises(UsageError, match="not a trace set"):
        make_policy("static", calibration=str(tmp_path))


def test_an_unimportable_policy_is_reported_not_dropped(monkeypatch):
    monkeypatch.setattr(policies, "POLICY_MODULES",
                        (*policies.POLICY_MODULES, "expertcast.inference.no_such_module"))
    with pytest.warns(RuntimeWarning, match="'no_such_module' is unavailable: expertcast.inference.no_such_module: "
                                            "ModuleNotFoundError"):
        names = available_policies()
    assert "lru" in names and "mru" in names
    assert "ModuleNotFoundError" in policies.policy_import_errors()["no_such_module"]
    with pytest.warns(RuntimeWarning), pytest.raises(UsageError, match="unknown policy 'broken'.*unimportable policy "
                                                                       "modules: expertcast.inference.no_such_module"):
        make_policy("broken")


def test_typed_values_are_checked_as_text_is_and_objects_pass_through(tmp_path):
    """make_policy checks a typed value by the same field rules as the command line's text; a loaded object of a
    file option's name passes through, its path is loaded by the one loader (policies/artifacts.py)."""
    with pytest.raises(UsageError, match=r"belady-k option k=-1: must be >= 0"):
        make_policy("belady-k", k=-1)
    with pytest.raises(UsageError, match="belady-k option k=1.5: expected an integer"):
        make_policy("belady-k", k=1.5)
    with pytest.raises(UsageError, match="lfu option history=never: expected one of perfect, in-cache"):
        make_policy("lfu", history="never")
    assert make_policy("belady-k", k="3").horizon_steps == 3  # text is converted
    tr = zipf_traces(2, 20, num_layers=2, num_experts=8, top_k=2, seed=1)
    from_objects = make_policy("static", calibration=tr.sequences)
    d = write_traces(tmp_path / "cal", tr.meta, tr.sequences)
    from_path = make_policy("static", calibration=d)  # a PathLike is the file option
    assert (from_objects.freq == from_path.freq).all() and from_objects.label == "static"
    with pytest.raises(UsageError, match="lrfu option lam is given twice"):
        parse_policy_options("lrfu:lam=0.1", {"lam": 0.2})
    o = parse_policy_options("lrfu", {"lam": 0.5})
    assert o.given_values() == {"lam": 0.5} and o.label() == "lrfu(lam=0.5)"


def test_static_declares_its_calibration_and_placement_engine():
    """static's calibration is a declared need and its vectorized replay an engine: the simulator reads the spec
    (no class check) and calibrates in-sample where none was given; a policy without the need is not calibrated."""
    from expertcast.data import synthetic
    from expertcast.inference.policies.static import StaticFrequencyPolicy
    from expertcast.inference.sim.simulator import simulate

    spec = policy_spec("static")
    assert "calibration" in spec.needs and spec.runs_on("placement") and spec.runs_on("driver")
    assert [n for n, s in registry().items() if "calibration" in s.needs] == ["static"]
    assert [n for n, s in registry().items() if s.runs_on("placement")] == ["static"]
    pol = StaticFrequencyPolicy()  # the defaults are the Options'
    assert pol.options == spec.options() and pol.calibration_source is None
    tr = synthetic.markov_traces(num_sequences=2, num_tokens=30, num_layers=2, num_experts=8, top_k=2, seed=0)
    fast = simulate(tr, [pol], [0.5], progress=False, belady_fraction=False)
    assert pol.calibration_source == "in-sample"
    slow = simulate(tr, [make_policy("static")], [0.5], progress=False, belady_fraction=False, engine="python")
    assert fast[0]["hit"] == slow[0]["hit"] and fast[0]["demand_misses"] == slow[0]["demand_misses"]
