"""SGLang's Mamba slot allocator on a graphalloc host-counted ring.

Contract. :class:`GraphallocMambaSlotAllocator` has the surface of SGLang's
``MambaSlotAllocator`` (the free list of recurrent-state slots inside its
``HybridReqToTokenPool``, one slot per request): ``available_size()``,
``schedulable_available_size()``, ``alloc(n)`` -> a device tensor of ``n`` slot ids or
``None`` when short (nothing changed), ``free(slots)``, ``alloc_group_begin(n)`` /
``alloc_group_end()`` (slots taken ahead for a batch's matches, the unused ones given
back), ``clear()``. Slot 0 is the padding sink and never handed out. The free slots are a
:class:`~.page_ring.PageRing` (slot = page of one token): the host knows how many are
free and where a pop starts, the device holds the ids, so neither call reads the device
or resizes a tensor (SGLang's own list is re-sliced and concatenated on every call).
Plug it in where SGLang builds its pool: ``pool.mamba_allocator =
GraphallocMambaSlotAllocator(pool.mamba_allocator.size, device)`` before serving.

Invariants: free + taken == ``size``; a freed slot is one that was taken (the caller's
contract, as in SGLang; :meth:`check` audits the ring by reading the device).
Cost: ``alloc`` and ``free`` O(1) host work and at most two device ops; queries O(1).
"""

from __future__ import annotations

import torch

from ..errors import ContractError
from .page_ring import PageRing

__all__ = ["GraphallocMambaSlotAllocator"]


class GraphallocMambaSlotAllocator:
    """SGLang's ``MambaSlotAllocator``, on a host-counted ring (module docstring)."""

    def __init__(self, size: int, device):
        if size < 1:
            raise ContractError(f"a Mamba pool of {size} slots: at least one")
        self.size, self.device = int(size), device
        self.ring = PageRing(self.size, device)
        self._group: torch.Tensor | None = None  # slots taken ahead by alloc_group_begin
        self._group_used = 0

    def available_size(self) -> int:
        return self.ring.fill

    def schedulable_available_size(self) -> int:
        return self.available_size()

    def alloc(self, need_size: int) -> torch.Tensor | None:
        """``need_size`` free slots (a device tensor), or ``None`` when fewer are free. One
        slot inside a group comes from the group's slots first."""
        group = self._group
        if group is not None and need_size == 1 and self._group_used < group.numel():
            self._group_used += 1
            return group[self._group_used - 1:self._group_used]
        if need_size > self.ring.fill:
            return None
        return self.ring.pop(need_size)

    def free(self, free_index: torch.Tensor) -> None:
        """Give slots back (a device tensor; its length is the host's count)."""
        if free_index.numel():
            self.ring.push(free_index.reshape(-1))

    def alloc_group_begin(self, num_reqs: int) -> None:
        """Take ``num_reqs`` slots ahead (none when short) for the batch's one-slot allocs."""
        self._group, self._group_used = None, 0
        if 0 < num_reqs <= self.ring.fill:
            self._group = self.ring.pop(num_reqs)

    def alloc_group_end(self) -> None:
        """Give the group's unused slots back."""
        group, used = self._group, self._group_used
        self._group, self._group_used = None, 0
        if group is not None and used < group.numel():
            self.free(group[used:])

    def clear(self) -> None:
        self.ring.clear()
        self._group, self._group_used = None, 0

    def check(self) -> None:
        """Reads the device: the free slots are distinct and in ``1..size``."""
        self.ring.check()
