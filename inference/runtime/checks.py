"""The policies of the decode-path checks (tests and ``scripts/gpu_check_graph.py``; docs/design.md,
"Graph-compatible decode path")."""

from __future__ import annotations


def check_policy(name: str, model, **seqmoe_kw):
    """The policy of the decode-path checks (tests and ``scripts/gpu_check_graph.py``): ``"lru"``, or ``"seqmoe"``
    with :func:`~expertcast.models.forecaster.untrained_forecaster` for ``model``'s routing shape (online forecasts, min_confidence 0.05,
    the device plan's ``prefetch_rule=floor``; ``seqmoe_kw`` overrides)."""
    from expertcast.inference.policies import make_policy
    from expertcast.models.forecaster import untrained_forecaster

    if name == "lru":
        return make_policy("lru")
    if name != "seqmoe":
        raise ValueError(f"check_policy: 'lru' or 'seqmoe', got {name!r}")
    c = model.config
    fc = untrained_forecaster(c.num_hidden_layers, c.num_experts, c.num_experts_per_tok)
    kw = {"precompute": False, "min_confidence": 0.05, "prefetch_rule": "floor", **seqmoe_kw}
    return make_policy("seqmoe", forecaster=fc, **kw)
