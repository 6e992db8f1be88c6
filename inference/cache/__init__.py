"""The cache mechanism shared by the simulator and the runtime: CacheConfig and ExpertCache, the Policy
interface and PolicySpec, the one Driver with its Transport hooks and Counters, metrics, the cost model and
the generic option parsing (docs/design.md, "Layout")."""
