"""A model's further window pools on the device: their tables and their sections' launches.

Each further window pool p >= 1 (:mod:`graphalloc.pools.extra_window`) has tables of its
own, allocated once and written in place (so captured graphs keep their addresses):

===================  ==================================  ==================================
name                 shape (index dtype unless noted)    meaning
===================  ==================================  ==================================
full_to_swa_buf      [(num_full_pages + 1) * ps]         pool p's slot of a full slot
                                                         (page-dense), 0 = none
swa_free_buf         [num_pages + 1]                     pool p's FIFO free ring (+ scratch)
swa_epoch_buf        [num_pages + 1] int64               validate mode: the epoch (step)
                                                         that last pushed each page
===================  ==================================  ==================================

and the step descriptor a release and an allocation section per pool
(:meth:`~graphalloc.device.descriptor.DescriptorRing.window_rows`). A step launches, in
order (:meth:`WindowSections.release`, the main kernels, :meth:`WindowSections.allocate`)::

    for p: release kernel over pool p's release rows   (REL_SWA | REL_CLEAR: the FULL
                                                        page from req_to_token, its peer in
                                                        full_to_swa_p pushed, cleared)
    the step's main kernels (fused, or release then allocation: unchanged)
    for p: allocation kernel over pool p's allocation rows  (AL_SWA_ONLY | AL_NO_OUT: the
                                                        FULL pages the main allocation wrote
                                                        into req_to_token paired with pool
                                                        p's popped pages)

The release sections run first: they read ``req_to_token`` at positions the step's main
allocation may rewrite (a trimmed row extended again). Every launch carries the step's
stamp (counted once per step whatever launches it). The sections' rows are launched whole
(padded rows exit at once), in an eager step and a captured graph alike. Cost per step: two
kernel launches per further pool.
"""

from __future__ import annotations

import torch

from ..pools.extra_window import section_tokens

__all__ = ["WindowTables", "WindowSections"]


class WindowTables:
    """The device tables of further window pool ``pool`` (see the module docstring)."""

    def __init__(self, config, pool):
        dev, dt = config.device, config.index_dtype
        self.index, self.num_pages = pool.index, pool.num_pages
        self.full_to_swa_buf = torch.zeros(config.num_full_slots, dtype=dt, device=dev)
        self.swa_free_buf = torch.zeros(pool.num_pages + 1, dtype=dt, device=dev)
        self.swa_epoch_buf = torch.zeros(pool.num_pages + 1, dtype=torch.int64, device=dev)
        self.reset()

    def reset(self) -> None:
        """No mapping, every page free in order ``1..num_pages``. In place."""
        self.full_to_swa_buf.zero_()
        self.swa_epoch_buf.zero_()
        self.swa_free_buf[:-1].copy_(torch.arange(1, self.num_pages + 1,
                                                  dtype=self.swa_free_buf.dtype,
                                                  device=self.swa_free_buf.device))
        self.swa_free_buf[-1:].zero_()

    @property
    def full_to_swa(self) -> torch.Tensor:
        return self.full_to_swa_buf

    @property
    def swa_free(self) -> torch.Tensor:
        return self.swa_free_buf[:-1]

    def tables(self) -> dict[str, torch.Tensor]:
        """``window{p}_full_to_swa`` and ``window{p}_swa_free`` (state, for snapshots)."""
        prefix = f"window{self.index}_"
        return {prefix + "full_to_swa": self.full_to_swa, prefix + "swa_free": self.swa_free}


class WindowSections:
    """The launches of the further window pools' sections of one allocator (built by
    :class:`~graphalloc.device.backend.StepKernels` with its backend's launchers)."""

    def __init__(self, config, state, ring, release, allocate):
        self.config, self.state, self.ring = config, state, ring
        self._release, self._allocate = release, allocate
        self.n_tokens = section_tokens(config)  # the allocation sections' token lanes

    def __bool__(self) -> bool:
        return bool(self.state.windows)

    def _common(self, tables) -> dict:
        cfg = self.config
        return dict(page_size=cfg.page_size, n_full_cap=cfg.num_full_pages,
                    n_swa_cap=tables.num_pages, validate=cfg.validate)

    def release(self, index: int, stamp, seen, num_warps: dict) -> None:
        """Every further pool's release section of buffer ``index`` (before the step's
        main kernels)."""
        st = self.state
        for tables in st.windows:
            rows = self.ring.window_rows(index, tables.index)[0]
            self._release(rows, st.req_to_token_buf, tables.full_to_swa_buf, st.full_free_buf,
                          tables.swa_free_buf, st.ring_pages_buf, st.err_buf,
                          n_lanes=self.config.max_step_pages,
                          epochs=(st.full_epoch_buf, tables.swa_epoch_buf), stamp=stamp,
                          seen=seen, **self._common(tables), **num_warps)

    def allocate(self, index: int, stamp, seen, num_warps: dict) -> None:
        """Every further pool's allocation section of buffer ``index`` (after the step's
        main kernels: they read the FULL pages it wrote into ``req_to_token``)."""
        st = self.state
        for tables in st.windows:
            rows = self.ring.window_rows(index, tables.index)[1]
            self._allocate(rows, st.req_to_token_buf, tables.full_to_swa_buf, st.full_free_buf,
                           tables.swa_free_buf, st.ring_pages_buf, st.window_out_buf,
                           st.window_out_buf, st.err_buf, n_lanes=self.n_tokens, stamp=stamp,
                           seen=seen, **self._common(tables), **num_warps)
