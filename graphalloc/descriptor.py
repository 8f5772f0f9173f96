"""The fixed-shape step descriptor: its row layouts, and the ring of pinned buffers.

A step is two tables of int64 rows, eight columns each (64 bytes, one vector
load per program), written by the host planner and read by the kernels:

Release rows (``max_release_rows`` of them), one per segment of one request::

    col  name          meaning
    0    REL_REQ       request row r of req_to_token
    1    REL_START_POS first position s of the segment (page-aligned)
    2    REL_N_PAGES   pages in the segment; 0 marks a padded row (exits at once)
    3    REL_FLAGS     REL_SWA | REL_FULL | REL_CLEAR | REL_RING_RETURN
    4    REL_SWA_PUSH  free-ring position where SWA page j is pushed (+ j, mod capacity)
    5    REL_FULL_PUSH free-ring position where FULL page j is pushed (+ j, mod capacity)
    6    REL_LANE      exclusive prefix sum of pages: the row's first page lane
    7    REL_EPOCH     the step's epoch (> 0, a step counter; 0 skips validate mode's
                       duplicate-free check for the row)

    For page j < n: rep = req_to_token[r, s + j*ps]; the full page is rep // ps.
    REL_SWA:   peer = full_to_swa[rep]; push peer // ps (0, the sink marker, and a
               fault, when unmapped).
    REL_CLEAR: zero full_to_swa over the whole full page (a partial tail too).
    REL_FULL:  push the full page.
    REL_RING_RETURN: push ring_pages[r, j] (ring mode release); nothing else.

Allocation rows (``max_alloc_rows``), one per allocating request::

    col  name          meaning
    0    AL_REQ        request row r
    1    AL_START_POS  first new position s (may be mid-page: the page is continued)
    2    AL_N_TOKENS   tokens to allocate; 0 with AL_N_PAGES 0 marks a padded row
    3    AL_FULL_POP   free-ring position of the first popped FULL page
    4    AL_SWA_POP    free-ring position of the first popped SWA page
    5    AL_OUT        exclusive prefix sum of tokens: the row's first output lane
    6    AL_FLAGS      AL_RING (SWA slot from the request's ring) | AL_RING_ADMIT
    7    AL_N_PAGES    new pages (informative); for AL_RING_ADMIT, ring pages to pop

Padded rows are marked in the row itself, so no program reads a shared header
from host memory. Free lists are FIFO rings: pops take from the head, pushes
go to the tail, positions wrap at the pool's page count. The host owns head and
fill count and writes the positions into the rows, so no shape or address ever
depends on device data.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "ROW_WIDTH",
    "REL_REQ", "REL_START_POS", "REL_N_PAGES", "REL_FLAGS", "REL_SWA_PUSH", "REL_FULL_PUSH",
    "REL_LANE", "REL_EPOCH",
    "REL_SWA", "REL_FULL", "REL_CLEAR", "REL_RING_RETURN",
    "AL_REQ", "AL_START_POS", "AL_N_TOKENS", "AL_FULL_POP", "AL_SWA_POP", "AL_OUT", "AL_FLAGS",
    "AL_N_PAGES", "AL_RING", "AL_RING_ADMIT",
    "DescriptorRing",
]

ROW_WIDTH = 8

REL_REQ, REL_START_POS, REL_N_PAGES, REL_FLAGS, REL_SWA_PUSH, REL_FULL_PUSH, REL_LANE = range(7)
REL_EPOCH = 7
REL_SWA, REL_FULL, REL_CLEAR, REL_RING_RETURN = 1, 2, 4, 8

AL_REQ, AL_START_POS, AL_N_TOKENS, AL_FULL_POP, AL_SWA_POP, AL_OUT, AL_FLAGS, AL_N_PAGES = range(8)
AL_RING, AL_RING_ADMIT = 1, 2


class DescriptorRing:
    """A ring of ``n_bufs`` step descriptors, pinned when the device is CUDA.

    Each buffer is one int64 tensor ``[max_release_rows + max_alloc_rows, 8]``;
    ``release_rows(i)`` and ``alloc_rows(i)`` are views of it that never change
    address, so a captured graph can read them on every replay. The GPU reads a
    buffer *when the step runs*, so a buffer is rewritten only after the event
    recorded behind its last step has completed. With two or more buffers the
    host plans step k+1 while the GPU runs step k and, in steady state, never
    waits; ``stalls`` counts the times it had to.
    """

    def __init__(self, n_release_rows: int, n_alloc_rows: int, device: torch.device,
                 n_bufs: int = 2):
        if n_bufs < 1:
            raise ValueError(f"n_bufs must be >= 1, got {n_bufs}")
        self.n_release_rows = n_release_rows
        self.n_alloc_rows = n_alloc_rows
        self.is_cuda = device.type == "cuda"
        shape = (n_release_rows + n_alloc_rows, ROW_WIDTH)
        self.bufs = [torch.zeros(shape, dtype=torch.int64, pin_memory=self.is_cuda)
                     for _ in range(n_bufs)]
        # numpy views share memory with the (pinned) tensors: the planner writes here.
        self.np_bufs = [b.numpy() for b in self.bufs]
        # Fixed views the kernels read (made once: slicing a tensor costs microseconds).
        self._release_views = [b[:n_release_rows] for b in self.bufs]
        self._alloc_views = [b[n_release_rows:] for b in self.bufs]
        self.events: list[torch.cuda.Event | None] = [None] * n_bufs
        self.used = [(0, 0)] * n_bufs  # rows written last time, per buffer
        self.fusable = [False] * n_bufs  # per buffer: its step may run as one fused launch
        self.next_index = 0
        self.stalls = 0

    def __len__(self) -> int:
        return len(self.bufs)

    def release_rows(self, index: int) -> torch.Tensor:
        return self._release_views[index]

    def alloc_rows(self, index: int) -> torch.Tensor:
        return self._alloc_views[index]

    def acquire(self) -> int:
        """Index of the next buffer, after making sure the GPU is done reading it."""
        index = self.next_index
        event = self.events[index]
        if event is not None and not event.query():
            self.stalls += 1
            event.synchronize()  # sync ok: only when the GPU is len(ring) steps behind
        return index

    def write(self, index: int, release: np.ndarray, alloc: np.ndarray,
              fusable: bool = False) -> None:
        """Copy the planned rows in; rows past them become padding (all zeros).
        ``fusable``: the step's ``StepBuilder.fusable``, kept for the step runner."""
        buf = self.np_bufs[index]
        n_rel, n_al = len(release), len(alloc)
        old_rel, old_al = self.used[index]
        buf[:n_rel] = release
        if old_rel > n_rel:  # only rows this buffer used before need zeroing
            buf[n_rel:old_rel] = 0
        base = self.n_release_rows
        buf[base:base + n_al] = alloc
        if old_al > n_al:
            buf[base + n_al:base + old_al] = 0
        self.used[index] = (n_rel, n_al)
        self.fusable[index] = fusable

    def submitted(self, index: int) -> None:
        """Record that the step reading buffer ``index`` was enqueued on the current stream."""
        if self.is_cuda:
            event = self.events[index] or torch.cuda.Event()
            event.record()
            self.events[index] = event
        self.next_index = (index + 1) % len(self.bufs)
