"""The FULL pool: pages of the full-attention layers, and the request rows' page table.

Every position a request holds has a FULL page (``req_to_token`` on the device, ``page_of``
in the host mirror); window pools pair their pages with these. Pages ``1..num_pages`` sit
in one FIFO free ring (``full_free``; the host ring ``Ledger.full``), referenced by request
rows and handles (``full_ref``): a page goes back when its last reference goes. Its rules
are the planner's base (every kind allocates and frees FULL pages); what this object owns is
its size, its share of the frozen shapes and the step's main descriptor sections. Cost: O(1).
"""

from __future__ import annotations

from ..device.layout import ALLOCATION, RELEASE

__all__ = ["FullPool"]


class FullPool:
    """``FullAttention(num_pages)``'s pool."""

    def __init__(self, num_pages: int):
        self.num_pages = int(num_pages)

    @staticmethod
    def descriptor_sections(config) -> tuple:
        """The step's main sections (:mod:`graphalloc.device.layout`): its release and
        allocation rows, which the first window pool shares."""
        return ((RELEASE, config.max_release_rows), (ALLOCATION, config.max_alloc_rows))
