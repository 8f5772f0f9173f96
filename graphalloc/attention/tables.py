"""The step's attention page tables on the device, and their host copies per descriptor
buffer (see :mod:`graphalloc.attention.spec` for what they hold).

========================  ==================  ===============================================
buffer (``*_buf``)        shape, dtype        contents
========================  ==================  ===============================================
full_kv_indptr_buf        [B+1] out_dtype     FlashInfer CSR of FULL layers: lane i's pages are
full_kv_indices_buf       [max_full_indices]  ``indices[indptr[i]:indptr[i+1]]``, the FULL page
full_kv_last_page_len_buf [B]                 ids of positions [0, L); its last page holds
                                              ``last_page_len[i]`` tokens (0 on an empty lane)
swa_kv_indptr_buf         [B+1]               the same for SWA layers, in SWA page ids, over
swa_kv_indices_buf        [max_swa_indices]   the pages of ``[floor_page(ws), L)``
swa_kv_last_page_len_buf  [B]
full_block_table_buf      [B, width]          FlashAttention/vLLM: column c = position // ps;
swa_block_table_buf       [B, width]          SWA ids inside the range, 0 (the null page)
                                              elsewhere
seq_lens_buf              [B]                 L per lane (0 on padded lanes)
========================  ==================  ===============================================

Only the buffers of the configured forms x layers exist (the rest are ``None``). They are
allocated once and written in place by the page-table kernel inside the step's replay
(after its allocations), so a captured graph -- and a FlashInfer CUDA-graph wrapper built
on them -- keeps valid addresses. Host copies (indptr, last-page lengths, seq lens; pinned
on CUDA) are written by the planner per descriptor buffer and come back on the
``PlannedStep`` (``p.tables``): FlashInfer's ``plan()`` reads them, never the device. They
stay valid until the ring comes back to that buffer. A step with no descriptor rows (no
release, no allocation; its batch is empty) launches nothing under the eager and graph
executors, so the device buffers keep the previous batch's tables while ``p.tables``
describes an empty batch (a launch captured by an engine, ``alloc.launch(i)``, writes them
empty). The block tables' entries outside each lane's range are zero after every launch;
``bt_range_buf`` (int64 ``[B, 3]``, device) records the ranges the last launch wrote, so a
launch zeroes only what left them (whole rows at the first launch). Cost: the kernel (a
fixed grid of programs over the batch's page blocks, :mod:`graphalloc.kernels.page_table`)
per step with a batch; host O(B) copies.
"""

from __future__ import annotations

import dataclasses

import torch

from ..kernels.page_table import write_page_tables, write_page_tables_torch
from .spec import PageTableSpec

__all__ = ["AttentionTables", "PlannedTables"]

_HOST = ("full_kv_indptr", "full_kv_last_page_len", "swa_kv_indptr", "swa_kv_last_page_len",
         "seq_lens")


@dataclasses.dataclass
class PlannedTables:
    """The host copies of one step's tables (views of descriptor buffer ``buffer_index``'s
    pinned arrays; ``None`` for forms/layers not configured) and their counts."""

    buffer_index: int
    n_lanes: int
    n_full_pages: int  # FULL kv_indices entries written (full_kv_indptr[B])
    n_swa_pages: int
    full_kv_indptr_host: torch.Tensor | None
    full_kv_last_page_len_host: torch.Tensor | None
    swa_kv_indptr_host: torch.Tensor | None
    swa_kv_last_page_len_host: torch.Tensor | None
    seq_lens_host: torch.Tensor | None


class AttentionTables:
    """Device buffers and per-buffer host copies of the step's tables (see the module)."""

    def __init__(self, spec: PageTableSpec, config, state, n_bufs: int):
        self.spec = spec = spec.resolve(config)
        self.config = config
        B, dev, dt = spec.max_batch, config.device, spec.out_dtype
        self.req_to_token, self.full_to_swa = state.req_to_token_buf, state.full_to_swa_buf

        def dev_buf(form, layer, *shape):
            return torch.zeros(shape, dtype=dt, device=dev) if spec.has(form, layer) else None

        self.full_kv_indptr_buf = dev_buf("csr", "full", B + 1)
        self.full_kv_indices_buf = dev_buf("csr", "full", spec.max_full_indices)
        self.full_kv_last_page_len_buf = dev_buf("csr", "full", B)
        self.swa_kv_indptr_buf = dev_buf("csr", "swa", B + 1)
        self.swa_kv_indices_buf = dev_buf("csr", "swa", spec.max_swa_indices)
        self.swa_kv_last_page_len_buf = dev_buf("csr", "swa", B)
        self.full_block_table_buf = dev_buf("block_table", "full", B, spec.max_pages_per_req)
        self.swa_block_table_buf = dev_buf("block_table", "swa", B, spec.max_pages_per_req)
        self.seq_lens_buf = (torch.zeros(B, dtype=dt, device=dev)
                             if "block_table" in spec.forms else None)
        # Per lane, the block-table columns the last launch left ids in (FULL end, SWA first,
        # SWA end): the next launch zeroes only what leaves them. Whole rows at first, so the
        # first launch writes every row whole whatever the buffers held.
        width = spec.max_pages_per_req
        self.bt_range_buf = (torch.tensor([[width, 0, width]] * B, dtype=torch.int64,
                                          device=dev)
                             if "block_table" in spec.forms else None)
        pin = dev.type == "cuda"
        present = {"full_kv_indptr": spec.has("csr", "full"),
                   "full_kv_last_page_len": spec.has("csr", "full"),
                   "swa_kv_indptr": spec.has("csr", "swa"),
                   "swa_kv_last_page_len": spec.has("csr", "swa"),
                   "seq_lens": "block_table" in spec.forms}
        self.host = {name: [torch.zeros(B + (name.endswith("indptr")), dtype=dt,
                                        pin_memory=pin) for _ in range(n_bufs)]
                     for name in _HOST if present[name]}
        self.host_np = {name: [t.numpy() for t in bufs] for name, bufs in self.host.items()}
        # per buffer: the PlannedTables fields that never change (its host views)
        self._views = [{n + "_host": self.host[n][i] if n in self.host else None
                        for n in _HOST} for i in range(n_bufs)]
        self._write = (write_page_tables if config.backend == "triton"
                       else write_page_tables_torch)
        self._csr = {layer: (getattr(self, f"{layer}_kv_indptr_buf"),
                             getattr(self, f"{layer}_kv_indices_buf"),
                             getattr(self, f"{layer}_kv_last_page_len_buf"))
                     if spec.has("csr", layer) else None for layer in ("full", "swa")}

    def outputs(self) -> dict[str, torch.Tensor]:
        """The device output buffers that exist, by name (without the ``_buf`` suffix)."""
        names = ("full_kv_indptr", "full_kv_indices", "full_kv_last_page_len",
                 "swa_kv_indptr", "swa_kv_indices", "swa_kv_last_page_len",
                 "full_block_table", "swa_block_table", "seq_lens")
        return {n: getattr(self, n + "_buf") for n in names
                if getattr(self, n + "_buf") is not None}

    def write_host(self, index: int, lanes) -> PlannedTables:
        """Copy a step's host values (a :class:`~graphalloc.plan.lanes.LaneOutcome`) into
        buffer ``index``'s pinned arrays; returns the step's :class:`PlannedTables`. O(B)."""
        values = {"full_kv_indptr": lanes.full_indptr, "full_kv_last_page_len":
                  lanes.last_page_len, "swa_kv_indptr": lanes.swa_indptr,
                  "swa_kv_last_page_len": lanes.swa_last_page_len, "seq_lens": lanes.seq_lens}
        for name, arrays in self.host_np.items():
            arrays[index][...] = values[name]
        return self.planned(index, lanes.n_lanes, int(lanes.full_indptr[-1]),
                            int(lanes.swa_indptr[-1]))

    def planned(self, index: int, n_lanes: int, n_full_pages: int,
                n_swa_pages: int) -> PlannedTables:
        """The :class:`PlannedTables` of buffer ``index``'s host copies as they are (the
        compiled planner writes them in place). O(1)."""
        return PlannedTables(index, n_lanes, n_full_pages, n_swa_pages, **self._views[index])

    def launch(self, lane_rows: torch.Tensor) -> None:
        """Write every configured output from ``lane_rows`` (a descriptor buffer's lane
        section): one kernel (Triton backend) or the Torch twin. Capture-safe, never syncs."""
        self._write(lane_rows, self.req_to_token, self.full_to_swa,
                    page_size=self.config.page_size, full_csr=self._csr["full"],
                    swa_csr=self._csr["swa"], full_block_table=self.full_block_table_buf,
                    swa_block_table=self.swa_block_table_buf, seq_lens=self.seq_lens_buf,
                    bt_ranges=self.bt_range_buf)


