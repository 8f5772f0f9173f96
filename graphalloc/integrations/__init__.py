"""Seams between serving engines' schedulers and graphalloc, one step per iteration.

* :mod:`graphalloc.integrations.sglang` -- :class:`SGLangAllocator`: SGLang's
  request-level allocator calls (``prepare_for_extend`` / ``prepare_for_decode``,
  ``release_kv_cache``, ``free_group_begin`` / ``free_group_end``, ``available_size``,
  ``translate_loc_from_full_to_swa``) on plain objects with SGLang's attribute names.
* :mod:`graphalloc.integrations.vllm` -- :class:`GraphallocKVCacheManager`: vLLM v1's
  ``KVCacheManager`` calls (``allocate_slots`` -> blocks | ``None``, ``free``,
  ``get_block_ids`` per KV-cache group, ``get_computed_blocks``).
* :mod:`graphalloc.integrations.iteration` -- :class:`IterationStep`, the layer below
  both: it records an iteration's frees, window evictions and allocations with O(1)
  host page accounting and runs them as ONE :meth:`HybridAllocator.step`.

Neither seam imports its engine; each module's docstring lists what it covers, what
it does not (the prefix cache is not wired into either yet), and what an engine must
still write itself.
"""

from .iteration import IterationStep
from .sglang import SGLangAllocator, SGLangBatchAlloc
from .vllm import (
    FULL_GROUP,
    NULL_BLOCK_ID,
    SWA_GROUP,
    GraphallocBlocks,
    GraphallocKVCacheManager,
)

__all__ = ["IterationStep", "SGLangAllocator", "SGLangBatchAlloc",
           "GraphallocKVCacheManager", "GraphallocBlocks", "FULL_GROUP", "SWA_GROUP",
           "NULL_BLOCK_ID"]
