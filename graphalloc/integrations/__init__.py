"""Seams between serving engines' schedulers and graphalloc, one step per iteration.

* :mod:`graphalloc.integrations.sglang` -- :class:`SGLangAllocator`: SGLang's
  request-level allocator calls (``prepare_for_extend`` / ``prepare_for_decode``,
  ``release_kv_cache``, ``free_group_begin`` / ``free_group_end``, ``available_size``,
  ``translate_loc_from_full_to_swa``) and, with a prefix cache, its radix-cache calls
  (``match_prefix``, ``cache_unfinished_req``, ``cache_finished_req``,
  ``evictable_size``) on plain objects with SGLang's attribute names.
* :mod:`graphalloc.integrations.vllm` -- :class:`GraphallocKVCacheManager`: vLLM v1's
  ``KVCacheManager`` calls (``allocate_slots`` -> blocks | ``None``, ``free``,
  ``get_block_ids`` per KV-cache group, ``get_computed_blocks``, ``cache_blocks``),
  prefix caching included (``enable_caching=True``).
* :mod:`graphalloc.integrations.sglang_pool` -- :class:`GraphallocTokenToKVPoolAllocator`:
  SGLang's own ``token_to_kv_pool_allocator`` (its allocation path calls it unchanged;
  :func:`sglang_classes` subclasses SGLang's allocators with it when SGLang is
  importable); frees recorded on host-counted page rings, one step per allocation.
* :mod:`graphalloc.integrations.sglang_mamba` -- :class:`GraphallocMambaSlotAllocator`:
  SGLang's ``MambaSlotAllocator`` (recurrent-state slots) on a host-counted ring.
* :mod:`graphalloc.integrations.iteration` -- :class:`IterationStep`, the layer below
  both: a thin accumulator of int64 arrays per :class:`~graphalloc.plan.step.Step` kind,
  handed to the allocator as ONE step per iteration; what recorded frees give back is the
  planner's dry run (one rule site), cached per version of the records.

Unknown ids, one policy in both seams: releasing a request that holds no KV here (vLLM
``free`` of an unknown id, SGLang ``release_kv_cache`` of a request whose ``req_pool_idx``
is ``None``) is a no-op returning ``False``; every other call naming a request the seam
does not hold raises :class:`~graphalloc.errors.UnknownRequestError`; malformed engine
objects raise a typed error naming the field. A refused call changes nothing.

Neither seam imports its engine; each module's docstring lists what it covers, what
it does not, and what an engine must still write itself.
"""

from .iteration import IterationStep
from .sglang import SGLangAllocator, SGLangBatchAlloc
from .sglang_mamba import GraphallocMambaSlotAllocator
from .sglang_pool import GraphallocTokenToKVPoolAllocator
from .sglang_subclass import sglang_classes
from .vllm import (
    FULL_GROUP,
    NULL_BLOCK_ID,
    SWA_GROUP,
    GraphallocBlocks,
    GraphallocKVCacheManager,
)

__all__ = ["IterationStep", "SGLangAllocator", "SGLangBatchAlloc",
           "GraphallocTokenToKVPoolAllocator", "sglang_classes",
           "GraphallocMambaSlotAllocator",
           "GraphallocKVCacheManager", "GraphallocBlocks", "FULL_GROUP", "SWA_GROUP",
           "NULL_BLOCK_ID"]
