"""expertcast: learned expert-activation forecasting, cache-aware routers and real expert offloading
for Mixture-of-Experts LLMs."""

__version__ = "0.1.0"
