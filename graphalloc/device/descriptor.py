"""The ring of pinned step-descriptor buffers.

A step's descriptor (int64 rows of the device ABI, :mod:`graphalloc.kernels.abi`, in the
sections of its :class:`~graphalloc.device.layout.DescriptorLayout`: release rows, then
allocation rows, then the sections the model's pools and page tables add) is written by the
planner and read by the kernels. This module owns where descriptors live between the two:
a ring of pinned host buffers, each guarded by an event, so the host never rewrites
a buffer the GPU has not consumed. Beside each buffer sits its step's stamp (one pinned
int64, :mod:`graphalloc.kernels.stamp`), guarded by the same event.

Each buffer also has a device mirror of the same layout (``mirror(i)``; made at construction
on a CUDA device, on first use elsewhere): a staged launch (:mod:`graphalloc.kernels.stage`)
first copies the rows the step reads, and the stamp, from the pinned buffer into its mirror,
and the step's kernels read the mirror. The mirror is written only by the staging kernel of
a step reading that buffer, in stream order, so the ring's events guard it too. Every offset
here comes from the layout (its sections, looked up once at construction).
"""

from __future__ import annotations

import numpy as np
import torch

from ..kernels.abi import ROW_WIDTH
from .layout import ALLOCATION, LANES, RELEASE, STATES, DescriptorLayout

__all__ = ["DescriptorRing"]


class DescriptorRing:
    """A ring of ``n_bufs`` step descriptors, pinned when the device is CUDA.

    Each buffer is one int64 tensor ``[layout.n_rows, 8]`` in the sections of ``layout``
    (:class:`~graphalloc.device.layout.DescriptorLayout`: release rows, allocation rows, the
    attention lanes' rows when the allocator has page tables, the recurrent-state rows, then
    a release and an allocation section per further window pool of the model);
    ``release_rows(i)``, ``alloc_rows(i)``, ``lane_rows(i)``, ``state_rows(i)`` and
    ``window_rows(i, p)`` are views of its sections (empty for a section the layout does not
    have) that never change address, so a captured graph can read them on every replay. The
    GPU reads a buffer *when the step runs*, so a buffer is rewritten only after the event
    recorded behind its last step has completed. With two or more buffers the
    host plans step k+1 while the GPU runs step k and, in steady state, never
    waits; ``stalls`` counts the times it had to.

    ``stamp(i)`` is buffer i's stamp word (int64 ``[1]``, a view of one pinned ``[n_bufs]``
    tensor that never changes address): the pipeline writes the step's stamp there at plan
    time and program 0 of each step kernel reads it (``kernels.stamp``).
    """

    def __init__(self, layout: DescriptorLayout, device: torch.device, n_bufs: int = 2):
        if n_bufs < 1:
            raise ValueError(f"n_bufs must be >= 1, got {n_bufs}")
        self.layout = layout
        self.is_cuda = device.type == "cuda"
        self.bufs = [torch.zeros((layout.n_rows, ROW_WIDTH), dtype=torch.int64,
                                 pin_memory=self.is_cuda) for _ in range(n_bufs)]
        # numpy views share memory with the (pinned) tensors: the planner writes here.
        self.np_bufs = [b.numpy() for b in self.bufs]
        # Fixed views the kernels read (made once: slicing a tensor costs microseconds).
        self._release_views = [b[layout.rows(RELEASE)] for b in self.bufs]
        self._alloc_views = [b[layout.rows(ALLOCATION)] for b in self.bufs]
        self._lane_views = [b[layout.rows(LANES)] for b in self.bufs]
        self._state_views = [b[layout.rows(STATES)] for b in self.bufs]
        # (the sections the writers fill, looked up once)
        self._alloc_first, self._lanes, self._states = (layout[ALLOCATION].first_row,
                                                        layout.rows(LANES), layout.rows(STATES))
        # per further window pool p >= 1: its (release, allocation) sections, and their views
        # per buffer
        self._window_sections = layout.window_sections()
        self._window_views = [[(b[rel.rows()], b[al.rows()])
                               for rel, al in self._window_sections] for b in self.bufs]
        self.window_used = [[(0, 0)] * len(self._window_sections) for _ in range(n_bufs)]
        self.state_used = [0] * n_bufs  # state rows written last time, per buffer
        self.stamp_buf = torch.zeros(n_bufs, dtype=torch.int64, pin_memory=self.is_cuda)
        self.stamp_np = self.stamp_buf.numpy()
        self._stamp_views = [self.stamp_buf[i:i + 1] for i in range(n_bufs)]
        self.events: list[torch.cuda.Event | None] = [None] * n_bufs
        # The stream submitted() records on, cached by its raw handle: building a Stream
        # object (torch.cuda.current_stream()) costs microseconds on every step.
        self._device_index = (device.index if device.index is not None else
                              torch.cuda.current_device()) if self.is_cuda else -1
        self._raw_stream = _raw_stream_getter() if self.is_cuda else None
        self._stream_handle = None
        self._stream = None
        self._device = device
        self._mirrors: list | None = None  # per buffer: (device buffer, stamp, section views)
        if self.is_cuda:
            self._make_mirrors()
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

    def stamp(self, index: int) -> torch.Tensor:
        """Buffer ``index``'s stamp word (int64 ``[1]``, pinned on a CUDA device)."""
        return self._stamp_views[index]

    def index_of(self, release_rows: torch.Tensor) -> int | None:
        """The buffer whose release-row view this is (the very object :meth:`release_rows`
        returns), else None. O(n_bufs)."""
        for i, view in enumerate(self._release_views):
            if view is release_rows:
                return i
        return None

    def _make_mirrors(self) -> None:
        layout = self.layout
        mirrors = []
        for b in self.bufs:
            dev = torch.zeros(b.shape, dtype=torch.int64, device=self._device)
            views = tuple(dev[layout.rows(name)] for name in (RELEASE, ALLOCATION, LANES,
                                                               STATES))
            mirrors.append((dev, torch.zeros(1, dtype=torch.int64, device=self._device), views))
        self._mirrors = mirrors

    def mirror(self, index: int) -> tuple:
        """Buffer ``index``'s device mirror: ``(buffer, stamp word, (release rows, allocation
        rows, lane rows, state rows))``, views that never change address (made now on first
        use off a CUDA device)."""
        if self._mirrors is None:
            self._make_mirrors()
        return self._mirrors[index]

    def wait_submitted(self) -> None:
        """Wait until every submitted step has run (each buffer's last event). A sync point:
        only ``check()`` calls it."""
        for event in self.events:
            if event is not None:
                event.synchronize()  # sync ok: check() is a sanctioned sync point

    def lane_rows(self, index: int) -> torch.Tensor:
        """The attention lanes' rows of buffer ``index`` (``[max_batch, 8]``; empty when
        the allocator has no page tables)."""
        return self._lane_views[index]

    def write_lanes(self, index: int, rows: np.ndarray) -> None:
        """Copy a step's lane rows in (all ``max_batch`` of them: padding lanes carry the
        running offsets). O(B)."""
        self.np_bufs[index][self._lanes] = rows

    def state_rows(self, index: int) -> torch.Tensor:
        """Buffer ``index``'s recurrent-state rows (``[n_state_rows, 8]``; empty without
        state slots)."""
        return self._state_views[index]

    def write_states(self, index: int, rows: np.ndarray) -> None:
        """Copy a step's state rows in; rows past them become padding. O(rows)."""
        buf, base, n = self.np_bufs[index], self._states.start, len(rows)
        buf[base:base + n] = rows
        old = self.state_used[index]
        if old > n:
            buf[base + n:base + old] = 0
        self.state_used[index] = n

    def window_rows(self, index: int, pool: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Buffer ``index``'s sections of further window pool ``pool`` (>= 1): ``(release
        rows [max_release_rows, 8], allocation rows [max_alloc_rows, 8])``, fixed views."""
        return self._window_views[index][pool - 1]

    def write_windows(self, index: int, sections) -> None:
        """Copy each further window pool's ``(release, allocation)`` rows in (``sections``
        in pool order, one pair per pool); rows past them become padding. O(rows)."""
        buf, used = self.np_bufs[index], self.window_used[index]
        for q, ((rel_section, al_section), (release, alloc)) in enumerate(
                zip(self._window_sections, sections, strict=True)):
            old_rel, old_al = used[q]
            base = rel_section.first_row
            buf[base:base + len(release)] = release
            if old_rel > len(release):
                buf[base + len(release):base + old_rel] = 0
            al_base = al_section.first_row
            buf[al_base:al_base + len(alloc)] = alloc
            if old_al > len(alloc):
                buf[al_base + len(alloc):al_base + old_al] = 0
            used[q] = (len(release), len(alloc))

    def acquire(self) -> int:
        """Index of the next buffer, after making sure the GPU is done reading it."""
        index = self.next_index
        event = self.events[index]
        if event is not None and not event.query():
            self.stalls += 1
            event.synchronize()  # sync ok: only when the GPU is len(ring) steps behind
        return index

    def write(self, index: int, release: np.ndarray, allocation: np.ndarray,
              fusable: bool = False) -> None:
        """Copy the planned rows in (release rows, allocation rows); rows past them become
        padding (all zeros). ``fusable``: the step's ``StepBuilder.fusable``, kept for the
        step runner."""
        buf = self.np_bufs[index]
        n_rel, n_al = len(release), len(allocation)
        old_rel, old_al = self.used[index]
        buf[:n_rel] = release  # (the release section opens the layout: row 0)
        if old_rel > n_rel:  # only rows this buffer used before need zeroing
            buf[n_rel:old_rel] = 0
        base = self._alloc_first
        buf[base:base + n_al] = allocation
        if old_al > n_al:
            buf[base + n_al:base + old_al] = 0
        self.used[index] = (n_rel, n_al)
        self.fusable[index] = fusable

    def submitted(self, index: int) -> None:
        """Record that the step reading buffer ``index`` was enqueued on the current stream.
        Cost: one event record (a Stream object is built only when the current stream
        changed since the last step)."""
        if self.is_cuda:
            event = self.events[index]
            if event is None:
                event = self.events[index] = torch.cuda.Event()
            _record(event, self.current_stream())
        self.next_index = (index + 1) % len(self.bufs)

    def current_stream(self) -> torch.cuda.Stream:
        """The current CUDA stream of the ring's device (cached by its raw handle)."""
        getter = self._raw_stream
        if getter is None:  # this torch has no raw-stream query: build the object
            return torch.cuda.current_stream(self._device_index)
        handle = getter(self._device_index)
        if handle != self._stream_handle:
            self._stream = torch.cuda.current_stream(self._device_index)
            self._stream_handle = handle
        return self._stream


def _raw_stream_getter():
    """``torch._C._cuda_getCurrentRawStream`` (the current stream's ``cudaStream_t`` as an
    int, without building a Stream object) where this torch has it, else None."""
    return getattr(torch._C, "_cuda_getCurrentRawStream", None)  # noqa: SLF001 (torch)


def _record(event, stream) -> None:
    """``event.record(stream)`` without the Python wrapper's default-stream lookup."""
    base = getattr(torch._C, "_CudaEventBase", None)  # noqa: SLF001 (torch)
    if base is not None and isinstance(event, base):
        base.record(event, stream)
    else:
        event.record(stream)
