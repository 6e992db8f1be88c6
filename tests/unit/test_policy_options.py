"""Typed policy options: parsing, validation messages naming the valid keys, file kinds, agreement with the
policy constructors, and a registry that never drops a policy silently."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from expertcast.data.synthetic import zipf_traces
from expertcast.data.traces import write_traces
from expertcast.inference import policies as registry
from expertcast.inference.cache.options import (
    OPTIONS,
    constructor_options,
    parse_policy_options,
    split_policy_list,
)
from expertcast.inference.policies import (
    REGISTRY,
    available_policies,
    make_policy,
    parse_policy_spec,
    policy_class,
)
from expertcast.utils.errors import UsageError


def test_values_are_typed_and_only_given_options_reach_the_constructor():
    o = parse_policy_options("lrfu:lam=0.1")
    assert o.lam == 0.1 and isinstance(o.lam, float) and o.history == "perfect"
    assert o.to_kwargs() == {"lam": 0.1} and o.spec() == "lrfu:lam=0.1"
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


def test_every_policy_has_options_matching_its_constructor():
    """Each option is a keyword of the policy's constructor with the constructor's default, so the typed
    options cannot drift from the classes they configure."""
    assert set(OPTIONS) == set(REGISTRY)
    for name, opts in OPTIONS.items():
        cls = policy_class(name)
        accepted = constructor_options(cls)
        defaults = {}
        for klass in cls.__mro__:
            if "__init__" in klass.__dict__ and klass is not object:
                for p in inspect.signature(klass.__init__).parameters.values():
                    defaults.setdefault(p.name, p.default)
        for f in dataclasses.fields(opts):
            assert f.name in accepted, (name, f.name)
            assert defaults[f.name] == f.default, (name, f.name, defaults[f.name], f.default)
        assert opts.describe() == [] or all(d["help"] for d in opts.describe()), name


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
    monkeypatch.setitem(REGISTRY, "broken", "expertcast.inference.no_such_module:Nope")
    with pytest.warns(RuntimeWarning, match="'broken' is unavailable: expertcast.inference.no_such_module:Nope: "
                                            "ModuleNotFoundError"):
        names = available_policies()
    assert "broken" not in names and "lru" in names
    assert "no_such_module" in registry.policy_import_errors()["broken"]
    with pytest.raises(UsageError, match="registered as expertcast.inference.no_such_module:Nope but cannot be "
                                         "imported"):
        make_policy("broken")
