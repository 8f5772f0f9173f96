"""How many compiled variants a Triton kernel holds (the graph tests count them)."""

from __future__ import annotations

__all__ = ["n_variants"]


def n_variants(kernel):
    """Compiled variants of a jit function across devices, or None (e.g. the interpreter).
    Triton 3.2 keeps ``cache[device]``; 3.3+ ``device_caches[device][0]``."""
    caches = getattr(kernel, "device_caches", None)
    if isinstance(caches, dict):
        return sum(len(entry[0]) for entry in caches.values())
    cache = getattr(kernel, "cache", None)
    if isinstance(cache, dict):
        return sum(len(per_device) for per_device in cache.values())
    return None
