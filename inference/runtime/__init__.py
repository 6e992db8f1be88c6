"""Real expert offloading for transformers-5 MoE models (docs/design.md, "Runtime").

- :mod:`.store`: host expert store (packed rows; pinned on CUDA; optional memory-mapped safetensors)
- :mod:`.slots`: device slot pool bound to the shared :class:`~expertcast.inference.cache.expert_cache.ExpertCache`
- :mod:`.transfer`: CUDA side-stream copies ordered by events / CPU transfer thread with a bandwidth limit
- :mod:`.experts`: the ``expertcast_offload`` experts implementation (expert-aligned repacking)
- :mod:`.residency`: the transport of the shared policy driver (:mod:`expertcast.inference.cache.driver`): real copies
- :mod:`.run_state`: book-keeping of one generate()/replay() call (schedule, phases, fed tokens, recorded routing)
- :mod:`.stats`: :class:`RuntimeStats` (decode counters, timings) and :class:`MemoryReport`
- :mod:`.engine`: :class:`OffloadedModel` (generate, forced-routing replay, stats, memory report)
- :mod:`.forced`: forced routing for the full-load baseline of the benchmarks; any trace laid onto a model's shape
- :mod:`.real_shapes`: random-weight checkpoints of real configurations, written shard by shard (``build-shape``)

    >>> from expertcast.inference.runtime import OffloadedModel
    >>> om = OffloadedModel(model, make_policy("lru"), 0.25)         # 25% of the experts resident
    >>> out = om.generate(input_ids, attention_mask, max_new_tokens=64)
    >>> om.stats.metrics()                                            # hit, adj_hit, MB/token, tokens/s...
"""

from __future__ import annotations

__all__ = ["OffloadedModel", "RuntimeStats", "MemoryReport", "HostExpertStore", "FullLoadReplayer"]


def __getattr__(name: str):  # lazy: importing the package does not import torch/transformers
    if name in ("OffloadedModel", "RuntimeStats", "MemoryReport"):
        from expertcast.inference.runtime import engine

        return getattr(engine, name)
    if name == "HostExpertStore":
        from expertcast.inference.runtime.store import HostExpertStore

        return HostExpertStore
    if name == "FullLoadReplayer":
        from expertcast.inference.runtime.forced import FullLoadReplayer

        return FullLoadReplayer
    raise AttributeError(name)
