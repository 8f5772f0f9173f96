"""Chunked local attention (Llama 4's ``attention_chunk_size``): a window pool whose rule
moves the frontier chunk by chunk.

A query at position t attends to the keys of its own chunk, ``[floor(t / C) * C, t]``. At
committed length L the next query sits at position L, so every position below
``floor(L / C) * C`` is no longer read by these layers: that is the rule's
``needed_from(L)``, and the frontier follows it page by page (``floor_page``), as a sliding
window's does. Everything else -- pages paired with FULL pages, references, prefix sharing,
load-back, the ring policy -- is :class:`~graphalloc.pools.window.WindowPool`'s.

A trim to L' keeps the window it needs when ``floor(L' / C) * C >= f``, i.e. ``L' >=
ceil(f / C) * C``. Pool size: a request holds at most ``ceil(C / ps) + 1`` chunk pages after
its step's eviction (a chunk's pages plus the partial page a chunk boundary can split).
The compiled twin's rule is ``_cplan_chunked.c``. Cost: O(rows) numpy.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ChunkRule"]


class ChunkRule:
    """The chunk rule of chunk size ``chunk`` tokens (see the module)."""

    kind = "chunked"
    c_kind = 1  # the compiled twin's rule id (_cplan_chunked.c)

    def __init__(self, chunk: int):
        self.chunk = int(chunk)
        self.tokens = self.chunk
        self.reach = self.chunk  # positions behind L a chunked layer can read: < C

    def needed_from(self, length):
        return length // self.chunk * self.chunk

    def min_length(self, frontier):
        return -(-frontier // self.chunk) * self.chunk

    def lane_start(self, length, query, model_window: int):
        """The lane's first query sits at ``length - query``: its chunk's first position."""
        return np.maximum(length - np.maximum(query, 1), 0) // self.chunk * self.chunk

    def describe(self) -> str:
        return f"chunked local attention, chunks of {self.chunk} tokens"
