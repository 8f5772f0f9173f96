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

import dataclasses

import numpy as np

from .layers import fix_count
from .window import WindowPool

__all__ = ["ChunkedLocal", "ChunkRule", "chunked_pool"]


@dataclasses.dataclass(frozen=True)
class ChunkedLocal:
    """Chunked local attention layers of chunk size ``chunk`` tokens (Llama 4's
    ``attention_chunk_size``): a query at position t reads the keys of its own chunk,
    ``[floor(t / chunk) * chunk, t]``; ``num_pages`` usable pages, paired with FULL pages
    like a sliding window's."""

    chunk: int
    num_pages: int

    def __post_init__(self) -> None:
        fix_count(self, "chunk", 1)
        fix_count(self, "num_pages", 1)


class ChunkRule:
    """The chunk rule of chunk size ``chunk`` tokens (see the module)."""

    kind = "chunked"
    c_kind = 1  # the compiled twin's rule id (_cplan_chunked.c)

    def __init__(self, chunk: int):
        self.chunk = int(chunk)
        self.tokens = self.chunk
        self.model_window = self.chunk  # (what describe() shows as the layers' window)
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


def chunked_pool(layer: ChunkedLocal, index: int) -> WindowPool:
    """The window pool of ``layer`` (the registry's builder)."""
    return WindowPool(ChunkRule(layer.chunk), layer.num_pages, 0, index)
