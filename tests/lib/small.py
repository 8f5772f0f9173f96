"""A small pool-mode allocator the regression tests share (page size 2, window W - 1 = 3)."""

from __future__ import annotations

import graphalloc as ga

__all__ = ["small"]


def small(**kw) -> ga.HybridAllocator:
    args = dict(page_size=2, num_full_pages=24, num_swa_pages=16, max_reqs=4,
                max_context_len=16, sliding_window=3)
    args.update(kw)
    return ga.HybridAllocator(ga.AllocatorConfig(**args))
