"""The per-pool handles of SGLang's SWA allocator pair, on graphalloc's allocator.

Contract. SGLang's SWA allocator composes two paged allocators and its caches reach into
them: the radix cache's FULL component gives a tree node's full pages back through
``token_to_kv_pool_allocator.full_attn_allocator.free_segment(value, start_pos=0)``
(its SWA component frees the node's SWA side separately, a tombstone), and capacity
checks read each side's ``available_size()``. :class:`FullPoolView` is that handle on
:class:`~.sglang_pool.GraphallocTokenToKVPoolAllocator`: its frees are the owner's
full-only frees, recorded like every free and run by the next step. :class:`SwaPoolView`
answers the SWA side's queries; freeing or allocating SWA slots directly (HiCache load
and the external-linker paths, which address the SWA pool by its own slots) raises
``ContractError``: graphalloc pairs SWA pages with full pages and takes no SWA slot alone.
Cost: O(1) per query; a free costs what the owner's free costs.
"""

from __future__ import annotations

import torch

from ..errors import ContractError

__all__ = ["FullPoolView", "SwaPoolView"]


class _PoolView:
    """One pool of graphalloc's SGLang pair, as SGLang's single-pool allocator: its size and
    free count (the pool's ``size_<pool>`` and ``<pool>_available_size()`` on the owner)."""

    debug_mode = False
    pool = ""

    def __init__(self, owner):
        self._owner = owner
        self.page_size = owner.page_size
        self.device = owner.device

    @property
    def size(self) -> int:
        return getattr(self._owner, f"size_{self.pool}")

    def available_size(self) -> int:
        return getattr(self._owner, f"{self.pool}_available_size")()


class FullPoolView(_PoolView):
    """SGLang's ``full_attn_allocator`` of the pair: the FULL pool alone."""

    pool = "full"

    def free_segment(self, free_index: torch.Tensor, *, start_pos: int) -> None:
        """The full pages of a row segment or a tree value (no SWA side)."""
        self._owner.free_full_segment(free_index, start_pos=start_pos)

    def free(self, free_index: torch.Tensor) -> None:
        self._owner.free_full(free_index)

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        self._owner.free_full_page_ids(page_ids)


class SwaPoolView(_PoolView):
    """SGLang's ``swa_attn_allocator`` of the pair: the SWA pool's queries."""

    pool = "swa"

    def _refuse(self, what: str):
        raise ContractError(f"swa_attn_allocator.{what}: SWA slots are paired with full "
                            "slots in graphalloc and never taken or freed alone (HiCache "
                            "load-back and external-linker paths are not supported)")

    def alloc(self, need_size: int):
        self._refuse("alloc")

    def free(self, free_index: torch.Tensor) -> None:
        self._refuse("free")

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        self._refuse("free_page_ids")
