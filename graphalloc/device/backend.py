"""Backends: which kernels execute a planned step.

``torch`` is the fixed-shape, sync-free reference (any device); ``triton`` runs
the Triton kernels (a GPU, or the CPU through ``TRITON_INTERPRET=1``). Both
take the same arguments and must leave identical state.

A step runs as two launches (release, then allocation) or, where the planner
marked it fusable, as one fused launch (``kernels.step``): programs
``[0, R)`` release, ``[R, R + A)`` allocate. Fusing is safe only when the
step's pops of each FIFO ring fit in what was free before the step (then pops
and pushes touch disjoint ring positions and no allocation program reads what
a release program writes); ``StepBuilder.fusable`` says so per step, and the
caller passes it in. A :class:`~graphalloc.device.graph.StepGraph` captures both
variants per descriptor buffer and replays the one the step allows.

Stamp: a launch over a descriptor buffer of the allocator's ring carries that buffer's step
stamp and the device's seen word (:mod:`graphalloc.kernels.stamp`), whoever launches it
(an executor, ``alloc.launch(i)`` inside an engine's graph, a test's own executor): the
buffer is recognised by its release-row view, which never changes.

With recurrent-state slots the step's state section (:mod:`graphalloc.kernels.state`) follows:
one launch writes the state table, one per registered state tensor copies snapshots. Their
programs loop to the section header's counts, so a graph captured over the whole section
costs what the step's state rows do.

Staging (:mod:`graphalloc.kernels.stage`): a staged launch first copies the rows its
kernels read (and the buffer's stamp) from the pinned descriptor buffer into the buffer's
device mirror (``DescriptorRing.mirror``), one small kernel at the head of the step, and the
step's kernels read the mirror: the PCIe round trip is paid once per step, not once per
kernel, and the page-table kernel's every program reads the lanes from device memory.
Captured graphs stage always (``StepGraph``, ``alloc.launch(i)`` inside a capture); an eager
launch stages when it writes page tables (``staged=None``), else reads the pinned rows (one
launch fewer on the host). Only buffers of the allocator's ring are staged, and only on a
CUDA device (``stage_anywhere``: on any device, for tests of the plumbing).

A model's further window pools (:mod:`graphalloc.device.window_sections`): a launch over a
buffer of the ring runs each pool's release section before the main kernels and its
allocation section after them, every section's rows whole.

Grid: a launch covers the first rows of each table that a
:class:`~graphalloc.device.buckets.StepGrid` names (the eager executor: exactly the step's
rows, ``StepKernels.grids.exact``; a graph: the bucket it was captured for), with
long allocation rows shared by several programs. Without a grid it covers every row.
"""

from __future__ import annotations

import torch

from ..config import AllocatorConfig
from .buckets import GridPolicy, StepGrid
from .layout import ALLOCATION, LANES, RELEASE, STATES, Section
from .tables import DeviceState
from .window_sections import WindowSections

__all__ = ["StepKernels"]


class StepKernels:
    """Launches one step's kernels for a descriptor buffer.

    Args:
        config: the allocator's configuration (backend, geometry, ``validate``).
        state: its device tables.
        fused: allow the one-launch variant. Off, every call is two launches.

    ``grids`` (a :class:`~graphalloc.device.buckets.GridPolicy`) chooses launch grids for the
    executors. Never synchronises; safe to call inside CUDA graph capture. Returns before
    the device has finished.
    """

    STATE_TABLE_PROGRAMS = 32  # a graph's programs over the state table rows (a loop each)
    STATE_COPY_PROGRAMS = 8  # ... over the state copy rows (each x up to 64 over a slot)

    def __init__(self, config: AllocatorConfig, state: DeviceState, *, fused: bool = False,
                 tables=None, ring=None, state_tensors=()):
        self.config = config
        self.ring = ring  # the DescriptorRing whose buffers carry step stamps (or None)
        self.state_tensors = tuple(state_tensors)  # copied by ST_COPY rows (fixed: graphs)
        from ..kernels.state import bit_views

        self.copy_tensors = bit_views(self.state_tensors, config.backend)  # what copies move
        self.tables = tables  # the step's attention tables (AttentionTables), or None
        self.state = state
        self.fused = bool(fused)
        self.grids = GridPolicy(config)
        self.num_warps: int | None = None  # warps per program (None: Triton's default)
        # Whether the latest step's release (or fused) launch returned: the pipeline clears
        # it before a step and reads it when a launch raises (graphalloc.device.restore).
        self.released = False
        self.stage_anywhere = False  # stage off a CUDA device too (tests of the plumbing)
        # Per-call constants, built once (a launch is on every step's path).
        self._common = dict(page_size=config.page_size, n_full_cap=config.num_full_pages,
                            # (no window layers: a ring of capacity 1 that no row reads)
                            n_swa_cap=max(config.num_swa_pages, 1), validate=config.validate)
        self._epochs = (state.full_epoch_buf, state.swa_epoch_buf)
        self._tables = (state.req_to_token_buf, state.full_to_swa_buf, state.full_free_buf,
                        state.swa_free_buf, state.ring_pages_buf)
        if config.backend == "triton":
            from ..kernels.allocate import allocate_tokens
            from ..kernels.release import release_pages
            from ..kernels.step import run_step_fused
            self._release, self._allocate = release_pages, allocate_tokens
            self._step = run_step_fused
            from ..kernels.stage import stage_rows
            from ..kernels.state import copy_state_rows, write_state_rows
        else:
            from ..kernels.allocate import allocate_tokens_torch
            from ..kernels.release import release_pages_torch
            from ..kernels.step import run_step_fused_torch
            self._release, self._allocate = release_pages_torch, allocate_tokens_torch
            self._step = run_step_fused_torch
            from ..kernels.stage import stage_rows_torch as stage_rows
            from ..kernels.state import copy_state_rows_torch as copy_state_rows
            from ..kernels.state import write_state_rows_torch as write_state_rows
        self._write_states, self._copy_states = write_state_rows, copy_state_rows
        self._stage = stage_rows
        # a model's further window pools: their sections run around the main kernels
        self.windows = WindowSections(config, state, ring, self._release, self._allocate)
        # the sections a staged launch copies: (first row, rows) of each, from the layout
        self._stage_sections = None if ring is None else tuple(
            ring.layout[name] if name in ring.layout else Section(name, 0, 0)
            for name in (RELEASE, ALLOCATION, LANES, STATES))

    def __call__(self, release_rows: torch.Tensor, alloc_rows: torch.Tensor, *,
                 fusable: bool = False, grid: StepGrid | None = None,
                 lane_rows: torch.Tensor | None = None, state_rows: torch.Tensor | None = None,
                 state_counts: tuple[int, int] | None = None, staged: bool | None = None
                 ) -> None:
        """Run the step in ``release_rows`` / ``alloc_rows``. ``fusable``: the step's
        ``PlannedStep.fusable``; with it and ``fused=True`` the step is one launch,
        otherwise release then allocation (a table with no rows in ``grid`` is not
        launched). ``grid``: the rows and chunks to launch (None: every row, one program
        each); it must cover the step's rows. ``lane_rows`` / ``state_rows``: the buffer's
        attention-lane and recurrent-state sections (None: the allocator has none);
        ``state_counts``: the step's ``(n_copy, n_table)`` state rows (eager: exact
        programs, nothing launched for none) or None (a graph: fixed programs). ``staged``:
        copy the rows to the buffer's device mirror first and launch over it (the module
        docstring; None: when ``lane_rows`` are given)."""
        cfg, st, common = self.config, self.state, self._common
        if grid is None:
            n_rel = n_al = None
            rel_chunks = al_chunks = 1
        else:
            n_rel, rel_chunks, n_al, al_chunks = grid
        ring = self.ring
        # the buffer of the ring these rows are (None: another table, a replica's payload)
        index = None if ring is None else ring.index_of(release_rows)
        stamp = None if index is None else ring.stamp(index)
        seen = None if stamp is None else st.seen_buf
        windows = index if self.windows else None
        if (index is not None and (lane_rows is not None if staged is None else staged)
                and (ring.is_cuda or self.stage_anywhere)):
            release_rows, alloc_rows, lane_rows, state_rows, stamp = self._staged(
                index, n_rel, n_al, lane_rows is not None, state_rows is not None, stamp)
        if windows is not None:  # (a model's further window pools: their release sections)
            self.windows.release(windows, stamp, seen, self._warps())
        if fusable and self.fused:
            self._step(release_rows, alloc_rows, *self._tables, st.out_full_buf,
                       st.out_swa_buf, st.err_buf, n_release_lanes=cfg.max_step_pages,
                       n_alloc_lanes=cfg.max_step_tokens, epochs=self._epochs,
                       n_release_rows=n_rel, n_alloc_rows=n_al, n_release_chunks=rel_chunks,
                       n_alloc_chunks=al_chunks, stamp=stamp, seen=seen, **common,
                       **self._warps())
            self.released = True
        elif n_rel is None or n_rel or n_al:
            self._release(release_rows, *self._tables, st.err_buf, n_lanes=cfg.max_step_pages,
                          epochs=self._epochs, n_rows=n_rel, n_chunks=rel_chunks, stamp=stamp,
                          seen=seen, **common, **self._warps())
            self.released = True
            self._allocate(alloc_rows, *self._tables, st.out_full_buf, st.out_swa_buf,
                           st.err_buf, n_lanes=cfg.max_step_tokens, n_rows=n_al,
                           n_chunks=al_chunks, stamp=stamp, seen=seen, **common,
                           **self._warps())
        if windows is not None:  # ... and their allocation sections, after the main kernels
            self.windows.allocate(windows, stamp, seen, self._warps())
        if lane_rows is not None:
            self.tables.launch(lane_rows)
        if state_rows is not None:
            self.launch_states(state_rows, state_counts)

    def _staged(self, index: int, n_rel, n_al, lanes: bool, states: bool, stamp):
        """Copy buffer ``index``'s rows of this launch (the first ``n_rel`` / ``n_al`` release
        and allocation rows, None: all; the lane and state sections whole when the launch has
        them) and its stamp into the buffer's device mirror; the mirror's views to launch
        over: ``(release, alloc, lanes or None, states or None, stamp or None)``."""
        ring = self.ring
        dev, dev_stamp, (d_rel, d_al, d_lanes, d_states) = ring.mirror(index)
        rel, al, lane, state = self._stage_sections
        sections = ((rel.first_row, rel.n_rows if n_rel is None else n_rel),
                    (al.first_row, al.n_rows if n_al is None else n_al),
                    (lane.first_row, lane.n_rows if lanes else 0),
                    (state.first_row, state.n_rows if states else 0))
        self._stage(ring.bufs[index], dev, sections, stamp,
                    None if stamp is None else dev_stamp)
        return (d_rel, d_al, d_lanes if lanes else None, d_states if states else None,
                None if stamp is None else dev_stamp)

    def launch_states(self, state_rows: torch.Tensor, counts: tuple[int, int] | None) -> None:
        """The state section's kernels: the table writes, then one copy launch per state
        tensor. ``counts``: ``(n_copy, n_table)`` (exact programs; a zero skips the launch)
        or None (the fixed programs of a captured graph)."""
        if counts is None:
            n_copy, n_table = self.STATE_COPY_PROGRAMS, self.STATE_TABLE_PROGRAMS
        else:
            n_copy, n_table = counts
        if n_table:
            self._write_states(state_rows, self.state.state_table_buf, n_table)
        if n_copy and self.copy_tensors:
            self._copy_states(state_rows, self.copy_tensors, n_copy)

    def _warps(self) -> dict:
        # Passed only when set, so a launcher (or a test's stand-in) without the option works.
        return {} if self.num_warps is None else {"num_warps": self.num_warps}
