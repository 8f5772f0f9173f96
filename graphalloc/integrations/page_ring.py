"""A device FIFO of free page ids whose head and fill count live on the host.

Contract. :class:`PageRing` holds the free pages of one pool (page ids ``1..n_pages``;
page 0 is the sink and never enters) in a device tensor ``ring_buf`` of ``n_pages``
entries. The host keeps ``head`` (position of the oldest free page) and ``fill`` (how many
are free), so it always knows how many pages a pop takes and where a push lands, and
never needs to read the ring: a pop of ``k`` pages is the device view of positions
``[head, head + k)`` (mod ``n_pages``), a push of ``k`` page ids writes positions
``[head + fill, head + fill + k)``. This is graphalloc's free ring (docs/design.md,
"Free lists") in the form an engine-facing allocator uses when the page ids themselves
come from device tensors the engine hands over (SGLang's frees): the host mirrors the
counts and positions, the device holds the ids.

Invariants: ``0 <= fill <= n_pages``; every id in ``[head, head + fill)`` is a distinct
page in ``1..n_pages`` as long as callers push only pages they were given (the caller's
contract; :meth:`audit` checks it by reading the device, off the fast path).

Cost: :meth:`take` and :meth:`tail` are host only (the engine-facing step's kernels read
and write the ring at those positions); :meth:`positions` is two device ops, :meth:`pop`
and :meth:`push` one more each; all shapes come from host ints, nothing synchronises.
"""

from __future__ import annotations

import torch

from ..errors import CapacityError, IntegrityError

__all__ = ["PageRing"]


class PageRing:
    """Free pages ``1..n_pages`` of one pool: device ids, host head and fill."""

    __slots__ = ("n_pages", "device", "ring_buf", "head", "fill", "_arange")

    def __init__(self, n_pages: int, device):
        self.n_pages = int(n_pages)
        self.device = torch.device(device)
        self.ring_buf = torch.empty(max(self.n_pages, 1), dtype=torch.int64, device=device)
        self._arange = torch.arange(max(self.n_pages, 1), dtype=torch.int64, device=device)
        self.clear()

    def clear(self) -> None:
        """Every page free, in id order. One device op."""
        self.ring_buf.copy_(self._arange + 1)
        self.head, self.fill = 0, self.n_pages

    def positions(self, start: int, k: int) -> torch.Tensor:
        """Ring positions ``[start, start + k)`` mod ``n_pages`` (a device tensor)."""
        if k > self.n_pages:
            raise CapacityError(f"{k} ring positions asked of a ring of {self.n_pages}")
        return (self._arange[:k] + start) % self.n_pages

    @property
    def tail(self) -> int:
        """Where the next push lands (a ring position)."""
        return (self.head + self.fill) % max(self.n_pages, 1)

    def take(self, k: int) -> int:
        """Host half of a pop: the ``k`` oldest free pages are now taken; returns the ring
        position of the first (the device reads them there). ``CapacityError`` when
        fewer than ``k`` are free, nothing changed."""
        if k > self.fill:
            raise CapacityError(f"{k} pages asked, {self.fill} free")
        head = self.head
        self.head = (head + k) % max(self.n_pages, 1)
        self.fill -= k
        return head

    def pop(self, k: int) -> torch.Tensor:
        """The ``k`` oldest free pages (a device tensor); the host moves ``head``.
        ``CapacityError`` (nothing changed) when fewer than ``k`` are free."""
        if k > self.fill:
            raise CapacityError(f"{k} pages asked, {self.fill} free")
        pages = self.ring_buf[self.positions(self.head, k)] if k else self.ring_buf[:0]
        self.head = (self.head + k) % max(self.n_pages, 1)
        self.fill -= k
        return pages

    def push(self, pages: torch.Tensor) -> None:
        """Append device page ids (``pages.numel()`` is the host's count) at the tail."""
        k = pages.numel()
        if k == 0:
            return
        if self.fill + k > self.n_pages:
            raise CapacityError(f"pushing {k} pages onto a ring holding {self.fill} of "
                                f"{self.n_pages}: a page freed twice")
        self.ring_buf.index_copy_(0, self.positions(self.head + self.fill, k),
                                  pages.to(torch.int64))
        self.fill += k

    def free_ids(self) -> torch.Tensor:
        """The free page ids, oldest first (a device tensor; a debug view)."""
        return self.ring_buf[self.positions(self.head, self.fill)]

    def audit(self) -> list[str]:
        """Reads the device: the free ids must be distinct pages in ``1..n_pages``."""
        ids = self.free_ids().cpu()  # off the fast path: an audit reads the device
        problems = []
        if len(ids) and (int(ids.min()) < 1 or int(ids.max()) > self.n_pages):
            problems.append(f"a free id outside 1..{self.n_pages}")
        if len(torch.unique(ids)) != len(ids):  # off the fast path (host tensor)
            problems.append("a page is free twice")
        return problems

    def check(self) -> None:
        problems = self.audit()
        if problems:
            raise IntegrityError("; ".join(problems))
