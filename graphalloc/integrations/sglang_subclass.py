"""graphalloc's SGLang allocator as a subclass of SGLang's own allocators, built lazily.

Contract. :func:`sglang_classes` returns ``{"paged": ..., "swa": ...}``: classes whose
first base is :class:`~.sglang_pool.GraphallocTokenToKVPoolAllocator` (every method SGLang's
allocation path calls is graphalloc's) and whose second is SGLang's
``PagedTokenToKVPoolAllocator`` / ``SWATokenToKVPoolAllocator`` (SGLang's constructor
signature, its ``isinstance`` checks, and the scheduler-facing capacity hooks graphalloc
does not override: ``create_prefill_budget``, ``evict_to_free_tokens``,
``check_decode_capacity``, ...). ``None`` when SGLang cannot be imported; graphalloc never
needs SGLang otherwise. This is SGLang's out-of-tree allocator route: a subclass of its
paged allocator that returns whole pages. Cost: the import once, then a cached dict.
"""

from __future__ import annotations

import functools
import importlib

from .sglang_pool import GraphallocTokenToKVPoolAllocator

__all__ = ["sglang_classes"]


@functools.lru_cache(maxsize=1)
def sglang_classes() -> dict | None:
    """``{"paged": ..., "swa": ...}``: graphalloc's allocator subclassing SGLang's
    ``PagedTokenToKVPoolAllocator`` / ``SWATokenToKVPoolAllocator`` (SGLang's
    constructor signatures; SGLang's capacity hooks inherited), or ``None`` when SGLang
    cannot be imported. Import cost once."""
    try:
        paged = importlib.import_module("sglang.srt.mem_cache.allocator.paged")
        swa = importlib.import_module("sglang.srt.mem_cache.allocator.swa")
    except ImportError:
        return None

    class GraphallocPagedTokenToKVPoolAllocator(GraphallocTokenToKVPoolAllocator,
                                                paged.PagedTokenToKVPoolAllocator):
        def __init__(self, size, page_size, dtype, device, kvcache, need_sort):
            GraphallocTokenToKVPoolAllocator.__init__(
                self, size=size, page_size=page_size, dtype=dtype, device=device,
                kvcache=kvcache, need_sort=need_sort)

    class GraphallocSWATokenToKVPoolAllocator(GraphallocTokenToKVPoolAllocator,
                                              swa.SWATokenToKVPoolAllocator):
        def __init__(self, size, size_swa, page_size, dtype, device, kvcache, need_sort,
                     req_to_token_pool=None):
            GraphallocTokenToKVPoolAllocator.__init__(
                self, size=size, size_swa=size_swa, page_size=page_size, dtype=dtype,
                device=device, kvcache=kvcache, need_sort=need_sort,
                req_to_token_pool=req_to_token_pool)

    return {"paged": GraphallocPagedTokenToKVPoolAllocator,
            "swa": GraphallocSWATokenToKVPoolAllocator}
