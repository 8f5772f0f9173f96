"""Block lists the vLLM plug-in hands to vLLM's scheduler: ids resolved when the step is planned.

Contract. vLLM's scheduler receives a ``KVCacheBlocks``-shaped value from every
``allocate_slots`` / ``get_computed_blocks`` / ``get_blocks`` call and reads block ids from
it only after its scheduling loop (``get_block_ids(allow_none=True)`` while building the
``SchedulerOutput``). :class:`LazyBlocks` is that value: a request's block index range
``[first_block, end_block)`` per KV-cache group and nothing else until its ids are asked
for. The first id read of an iteration makes the manager plan the iteration's ONE
graphalloc step (:meth:`~graphalloc.integrations.vllm_manager.GraphallocKVCacheManager.
flush`); the ids are then read from the host's page mirror (``ledger.refs.page_of`` for the
full-attention group, ``swa_of`` of those pages for a sliding-window group; ``0``, vLLM's
null block, below the window): exactly the pages the step writes, no device read.

Invariants: a value never changes after its ids were resolved (the ids are copied); the
null block is id 0 (graphalloc's sink page, never allocated); groups are in the order of
the manager's ``kv_cache_groups``. Cost: O(1) to build; resolving is O(blocks) numpy.
"""

from __future__ import annotations

__all__ = ["LazyBlocks", "BlockRef", "NULL_BLOCK_ID"]

NULL_BLOCK_ID = 0


class BlockRef:
    """A block as vLLM's code reads it: ``block_id``, ``block_hash`` (``None``: these ids
    are graphalloc's; the hashes live in the request), ``is_null``, ``ref_cnt``."""

    __slots__ = ("block_id", "block_hash", "is_null", "ref_cnt")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.block_hash = None
        self.is_null = block_id == NULL_BLOCK_ID
        self.ref_cnt = 1

    def __repr__(self) -> str:
        return f"BlockRef({self.block_id})"


class LazyBlocks:
    """``KVCacheBlocks`` of one request (see the module docstring).

    ``manager``: the plug-in; ``request_id``; ``[first_block, end_block)`` the block
    indices of the request's table this value names (``end_block == first_block``: empty).
    ``handle``: a prefix-cache hit's cache handle (-1 when this is not a hit)."""

    __slots__ = ("manager", "request_id", "first_block", "end_block", "handle", "_ids")

    def __init__(self, manager, request_id, first_block: int, end_block: int,
                 handle: int = -1):
        self.manager, self.request_id = manager, request_id
        self.first_block, self.end_block, self.handle = first_block, end_block, handle
        self._ids = None

    def __len__(self) -> int:
        return self.end_block - self.first_block

    def __repr__(self) -> str:
        return (f"LazyBlocks({self.request_id!r}, [{self.first_block}, {self.end_block}), "
                f"handle={self.handle})")

    def _resolve(self) -> tuple[list[int], ...]:
        if self._ids is None:
            n_groups = self.manager.num_kv_cache_groups
            if self.end_block <= self.first_block:
                self._ids = tuple([] for _ in range(n_groups))
            else:
                self._ids = self.manager.resolve_block_ids(self)
        return self._ids

    def get_block_ids(self, allow_none: bool = False, *, group_ids=None):
        """Block ids per group (vLLM's ``KVCacheBlocks.get_block_ids``): the first call of
        an iteration plans its step. ``allow_none``: ``None`` when every selected group is
        empty. O(blocks)."""
        ids = self._resolve()
        if group_ids is not None:
            ids = tuple(ids[g] for g in group_ids)
        if allow_none and all(not group for group in ids):
            return None
        return tuple(list(group) for group in ids)

    @property
    def blocks(self) -> tuple[list[BlockRef], ...]:
        """The blocks as objects (vLLM's field), built on demand. O(blocks)."""
        return tuple([BlockRef(i) for i in group] for group in self._resolve())

    def get_unhashed_block_ids(self) -> list[int]:
        ids = self._resolve()
        return [i for i in ids[0] if i != NULL_BLOCK_ID]

    def get_unhashed_block_ids_all_groups(self) -> list[list[int]]:
        return [[i for i in group if i != NULL_BLOCK_ID] for group in self._resolve()]

    def new_empty(self) -> LazyBlocks:
        return LazyBlocks(self.manager, self.request_id, 0, 0)

    def __add__(self, other: LazyBlocks) -> LazyBlocks:
        if len(other) == 0:
            return self
        if len(self) == 0:
            return other
        if other.request_id != self.request_id or other.first_block != self.end_block:
            raise ValueError("LazyBlocks: only adjacent ranges of one request add up")
        return LazyBlocks(self.manager, self.request_id, self.first_block, other.end_block)
