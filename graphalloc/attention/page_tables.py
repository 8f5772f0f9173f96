"""Attention page tables for the step's attention batch, FULL and SWA, written inside the replay.

Most users want :class:`PageTables` (``PageTables.for_allocator(alloc, max_batch)``); the
pure host planner :func:`plan_page_table_rows` (:mod:`graphalloc.page_table_plan`, with
:class:`PageTableSpec` and :class:`PageTablePlan`, all importable from here too) and the
kernel (:func:`graphalloc.kernels.write_page_tables`) are the layers below it.

Per step, for an attention batch of ``B = spec.max_batch`` lanes (lane i is request row
``rows[i]``, in the caller's order; lanes past ``len(rows)`` and lanes with ``rows[i] < 0``
are padding: empty ranges), the host plans one 64-byte row per lane (layout ``PT_*`` in
:mod:`graphalloc.kernels.abi`) into a pinned buffer, and ONE kernel (one program per lane)
gathers page ids from ``req_to_token`` / ``full_to_swa`` into static device buffers:

========================  ==================  ===============================================
buffer (``*_buf``)        shape, dtype        contents
========================  ==================  ===============================================
full_kv_indptr_buf        [B+1] int32         FlashInfer CSR of FULL layers: lane i's pages are
full_kv_indices_buf       [max_full_indices]  ``indices[indptr[i]:indptr[i+1]]``, the FULL page
full_kv_last_page_len_buf [B]                 ids of positions [0, L); last page holds
                                              ``last_page_len[i]`` tokens (0 on an empty lane)
swa_kv_indptr_buf         [B+1] int32         the same for SWA layers, in SWA page ids, over
swa_kv_indices_buf        [max_swa_indices]   the pages of positions [S, L) (see below)
swa_kv_last_page_len_buf  [B]
full_block_table_buf      [B, width] int32    FlashAttention/vLLM: column c = position // ps;
swa_block_table_buf       [B, width] int32    FULL ids for c < ceil(L/ps), SWA ids for
                                              first <= c < ceil(L/ps), 0 (the sink) elsewhere
seq_lens_buf              [B] int32           L per lane (0 on padded lanes)
========================  ==================  ===============================================

Only the buffers of the configured ``forms`` x ``layers`` exist (the rest are ``None``).
They are allocated once and updated in place only, so a captured graph keeps valid
addresses. ``kv_indices`` entries past ``indptr[B]`` keep old values (FlashInfer reads
``[0, indptr[B])`` only). Host copies of what the host already knows (indptr, last page
lengths, seq lens; pinned on CUDA) come with each plan, so FlashInfer's ``plan()`` never
needs a device read.

What the SWA tables cover, exactly
----------------------------------
An SWA layer at length L reads positions ``>= L - W`` (W = ``sliding_window``); SWA
pages below the page-aligned frontier f are freed. Let ``ws = max(f, L - W, 0)`` (the
lane's window start, ``planned.window_start``), ``first = ws // ps`` and
``end = ceil(L / ps)``. The SWA CSR holds the SWA page ids of pages ``[first, end)``,
i.e. positions ``[S, L)`` with ``S = first * ps``: kv length ``L - S`` =
``(n_pages - 1) * ps + last_page_len``. Never an evicted page, never the sink.

Masking rule. Keys of the list at positions ``[S, ws)`` (fewer than ps, in the first page)
are stale tokens of a live page and MUST be masked: use FlashInfer's
``window_left = W - 1`` (a query at position q reads keys ``[q - W + 1, q]``). FlashInfer
counts positions from the start of the list, for queries and keys alike (a query's
position is ``kv_len - n_q + j``), so the relative window equals the absolute one and the
offset S never matters for the mask; it does matter for in-kernel RoPE (apply RoPE before
the KV is cached, as engines do, or pass the positions). A block table keeps absolute
columns: SWA columns below ``first`` are 0 (the sink page, a valid page full of garbage)
and the attention kernel masks positions ``< L - W`` (FlashAttention
``window_size=(W - 1, 0)`` with ``seq_lens = L``).

Clipped lanes. When ``f > max(L - W, 0)`` (the frontier was advanced past the window, or
a request admitted with a shared prefix has not yet grown W past it), positions
``[max(L - W, 0), f)`` have no SWA KV of the request's own: the CSR simply starts at
``S = f`` (no stale keys then; every key is in the window, and attention sees fewer than
W keys), but a block-table kernel would read the sink page for them.
``planned.swa_clipped`` marks those lanes (``planned.n_swa_clipped`` counts them);
frontiers moved only by ``evict_window`` on requests without a shared prefix never clip.

Costs. ``plan``: about 35 numpy calls on ``[B]`` arrays, none per lane, plus a ``[B, 8]``
int64 store into pinned memory and the host copies (measured at B = 256: about 75 us on
a 2-core CPU host, numpy-call bound). ``launch``: one kernel of B programs; per lane a
64-byte row read from host memory, one ``req_to_token`` read per FULL page, one
``full_to_swa`` read per SWA page, 4 bytes written per page per CSR, and ``4 * width``
bytes per block-table form (rows are written whole, so no stale id survives). Measured
on one H200 as a one-node graph (B = 256, ps = 16, 8192-token context, 68,794 FULL +
15,502 SWA pages, both forms, both layer kinds): 6.1 us per replay against 2.5 us for a
graph of one trivial kernel. Lengths, offsets and batch contents are runtime values:
nothing recompiles when they change.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..errors import PendingStepError, TensorSpecError
from ..kernels.abi import ROW_WIDTH
from ..kernels.page_table import write_page_tables, write_page_tables_torch
from .page_table_plan import PageTablePlan, PageTableSpec, plan_page_table_rows

__all__ = ["PageTableSpec", "PageTablePlan", "PlannedPageTables", "PageTables",
           "plan_page_table_rows"]


def _same_device(a: torch.device, b: torch.device) -> bool:
    """``cuda`` names the current device: it matches ``cuda:0`` when that is current."""
    if a.type != b.type:
        return False
    if a.type != "cuda" or (a.index is not None and b.index is not None):
        return a.index == b.index
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (
        b.index if b.index is not None else current)


@dataclasses.dataclass
class PlannedPageTables:
    """A plan written into row table ``buffer_index``; launch it (``launch(buffer_index)``,
    or a graph captured over it), then ``mark_submitted`` -- or ``run`` for both -- before
    the next ``plan``.

    The ``*_host`` tensors (pinned on CUDA, ``out_dtype``; ``None`` for forms/layers not
    configured) are the host copies for the attention wrapper's planning (FlashInfer's
    ``plan()`` takes indptr and last page lengths on the host). They belong to this
    buffer and stay valid until the ring comes back to it (``n_bufs`` plans later).
    """

    buffer_index: int
    plan: PageTablePlan
    full_kv_indptr_host: torch.Tensor | None
    full_kv_last_page_len_host: torch.Tensor | None
    swa_kv_indptr_host: torch.Tensor | None
    swa_kv_last_page_len_host: torch.Tensor | None
    seq_lens_host: torch.Tensor | None

    @property
    def lane_rows(self) -> np.ndarray:
        return self.plan.lane_rows

    @property
    def window_start(self) -> np.ndarray:
        return self.plan.window_start

    @property
    def swa_clipped(self) -> np.ndarray:
        return self.plan.swa_clipped

    @property
    def n_swa_clipped(self) -> int:
        return int(self.plan.swa_clipped.sum())

    @property
    def n_full_pages(self) -> int:
        """FULL ``kv_indices`` entries written (``full_kv_indptr[B]``)."""
        return int(self.plan.full_indptr[-1])

    @property
    def n_swa_pages(self) -> int:
        """SWA ``kv_indices`` entries written (``swa_kv_indptr[B]``)."""
        return int(self.plan.swa_indptr[-1])


class PageTables:
    """Static page-table buffers for one attention batch shape, and the ring of pinned row
    tables that fill them. See the module docstring for shapes, the SWA range and costs.

    ``plan`` is host work (numpy, never captured, never reads the device); ``launch(i)``
    is device work (one kernel reading row table ``i``; capture-safe, never syncs), so
    an engine captures ``launch(i)`` once per ring buffer, right after the allocator's
    step kernels (the tables read ``req_to_token`` and ``full_to_swa`` as that step
    leaves them) and before the attention that reads the outputs.

    The row tables are read by the device when the kernel runs, so they form a ring of
    ``spec.n_bufs``, each guarded by an event recorded at ``mark_submitted``: ``plan``
    waits (counted in ``stalls``) only if the device is ``n_bufs`` steps behind.
    The output buffers are single: the next launch overwrites them in stream order.
    """

    def __init__(self, spec: PageTableSpec, req_to_token: torch.Tensor,
                 full_to_swa: torch.Tensor):
        for name, t, dim in (("req_to_token", req_to_token, 2), ("full_to_swa", full_to_swa, 1)):
            if not (isinstance(t, torch.Tensor) and t.dim() == dim
                    and _same_device(t.device, spec.device)):
                raise TensorSpecError(f"{name} must be a {dim}-D tensor on {spec.device}")
            if t.dtype not in (torch.int32, torch.int64):
                raise TensorSpecError(f"{name} must be int32 or int64, got {t.dtype}")
        if req_to_token.shape[1] < spec.max_context_len or req_to_token.stride(1) != 1:
            raise TensorSpecError(f"req_to_token needs >= {spec.max_context_len} contiguous "
                                  f"columns, got {tuple(req_to_token.shape)}")
        self.spec = spec
        self.req_to_token = req_to_token
        self.full_to_swa = full_to_swa
        B, dev, dt = spec.max_batch, spec.device, spec.out_dtype
        width = spec.max_pages_per_req

        def dev_buf(form, layer, *shape):
            return torch.zeros(shape, dtype=dt, device=dev) if spec.has(form, layer) else None

        self.full_kv_indptr_buf = dev_buf("csr", "full", B + 1)
        self.full_kv_indices_buf = dev_buf("csr", "full", spec.max_full_indices)
        self.full_kv_last_page_len_buf = dev_buf("csr", "full", B)
        self.swa_kv_indptr_buf = dev_buf("csr", "swa", B + 1)
        self.swa_kv_indices_buf = dev_buf("csr", "swa", spec.max_swa_indices)
        self.swa_kv_last_page_len_buf = dev_buf("csr", "swa", B)
        self.full_block_table_buf = dev_buf("block_table", "full", B, width)
        self.swa_block_table_buf = dev_buf("block_table", "swa", B, width)
        self.seq_lens_buf = (torch.zeros(B, dtype=dt, device=dev)
                             if "block_table" in spec.forms else None)

        pin = dev.type == "cuda"

        def host_bufs(present: bool, n: int):
            if not present:
                return None
            return [torch.zeros(n, dtype=dt, pin_memory=pin) for _ in range(spec.n_bufs)]

        # The row tables the kernel reads (pinned) and their numpy views (the planner writes).
        self.table_bufs = [torch.zeros(B, ROW_WIDTH, dtype=torch.int64, pin_memory=pin)
                           for _ in range(spec.n_bufs)]
        self._table_np = [t.numpy() for t in self.table_bufs]
        self.full_kv_indptr_host = host_bufs(spec.has("csr", "full"), B + 1)
        self.full_kv_last_page_len_host = host_bufs(spec.has("csr", "full"), B)
        self.swa_kv_indptr_host = host_bufs(spec.has("csr", "swa"), B + 1)
        self.swa_kv_last_page_len_host = host_bufs(spec.has("csr", "swa"), B)
        self.seq_lens_host = host_bufs("block_table" in spec.forms, B)
        self._host_np = {name: [t.numpy() for t in getattr(self, name)]
                         for name in ("full_kv_indptr_host", "full_kv_last_page_len_host",
                                      "swa_kv_indptr_host", "swa_kv_last_page_len_host",
                                      "seq_lens_host") if getattr(self, name) is not None}
        self._events: list[torch.cuda.Event | None] = [None] * spec.n_bufs
        self._write = write_page_tables if spec.backend == "triton" else write_page_tables_torch
        self._pending: PlannedPageTables | None = None
        self.next_index = 0
        self.stalls = 0

    @classmethod
    def for_allocator(cls, alloc, max_batch: int, **options) -> PageTables:
        """Page tables over a :class:`~graphalloc.HybridAllocator`'s ``req_to_token`` and
        ``full_to_swa`` (its public views), with the spec taken from its config."""
        spec = PageTableSpec.from_config(alloc.config, max_batch, **options)
        return cls(spec, alloc.req_to_token, alloc.full_to_swa)

    def outputs(self) -> dict[str, torch.Tensor]:
        """The device output buffers that exist, by name (without the ``_buf`` suffix)."""
        names = ("full_kv_indptr", "full_kv_indices", "full_kv_last_page_len",
                 "swa_kv_indptr", "swa_kv_indices", "swa_kv_last_page_len",
                 "full_block_table", "swa_block_table", "seq_lens")
        return {n: getattr(self, n + "_buf") for n in names
                if getattr(self, n + "_buf") is not None}

    # ---- host half ------------------------------------------------------------------
    def plan(self, rows, seq_len, frontier, query_lens=None) -> PlannedPageTables:
        """Plan the batch (see :func:`plan_page_table_rows` for the arguments and the
        refusals; ``query_lens``: query tokens per lane, e.g. ``1 + k`` for a speculative
        verify, default 1) and write its rows and host copies into the next ring buffer.
        Host only; nothing is written when a contract is broken."""
        if self._pending is not None:
            raise PendingStepError(
                f"page tables planned into buffer {self._pending.buffer_index} were not "
                "submitted: call mark_submitted(p) after launching (or run(p)) before the "
                "next plan()")
        i = self._acquire()  # before planning into buffer i: the device is done with it
        p = plan_page_table_rows(rows, seq_len, frontier, self.spec, out=self._table_np[i],
                                 query_lens=query_lens)
        host_np = self._host_np

        def put(name, values):
            bufs = getattr(self, name)
            if bufs is None:
                return None
            host_np[name][i][...] = values
            return bufs[i]

        planned = PlannedPageTables(
            buffer_index=i, plan=p,
            full_kv_indptr_host=put("full_kv_indptr_host", p.full_indptr),
            full_kv_last_page_len_host=put("full_kv_last_page_len_host", p.last_page_len),
            swa_kv_indptr_host=put("swa_kv_indptr_host", p.swa_indptr),
            swa_kv_last_page_len_host=put("swa_kv_last_page_len_host", p.swa_last_page_len),
            seq_lens_host=put("seq_lens_host", p.seq_lens),
        )
        self._pending = planned
        return planned

    def mark_submitted(self, planned: PlannedPageTables) -> None:
        """Record that the launch (or replay) reading ``planned``'s buffer was enqueued on
        the current stream; the ring moves on."""
        if planned is not self._pending:
            raise PendingStepError("mark_submitted() got a plan that is not the pending one "
                                   "of these page tables")
        i = planned.buffer_index
        if self.spec.device.type == "cuda":
            event = self._events[i] or torch.cuda.Event()
            event.record()
            self._events[i] = event
        self.next_index = (i + 1) % self.spec.n_bufs
        self._pending = None

    def _acquire(self) -> int:
        i = self.next_index
        event = self._events[i]
        if event is not None and not event.query():
            self.stalls += 1
            event.synchronize()  # sync ok: only when the device is n_bufs steps behind
        return i

    # ---- device half ----------------------------------------------------------------
    def launch(self, buffer_index: int) -> None:
        """Write every configured output from row table ``buffer_index``: one kernel
        (Triton backend) or the Torch twin's fixed-shape ops. Capture-safe, never syncs;
        returns before the device has finished."""
        full_csr = (None if self.full_kv_indptr_buf is None else
                    (self.full_kv_indptr_buf, self.full_kv_indices_buf,
                     self.full_kv_last_page_len_buf))
        swa_csr = (None if self.swa_kv_indptr_buf is None else
                   (self.swa_kv_indptr_buf, self.swa_kv_indices_buf,
                    self.swa_kv_last_page_len_buf))
        self._write(self.table_bufs[buffer_index], self.req_to_token, self.full_to_swa,
                    page_size=self.spec.page_size, full_csr=full_csr, swa_csr=swa_csr,
                    full_block_table=self.full_block_table_buf,
                    swa_block_table=self.swa_block_table_buf, seq_lens=self.seq_lens_buf)

    def run(self, planned: PlannedPageTables) -> None:
        """Eager form: ``launch(planned.buffer_index)`` then ``mark_submitted(planned)``."""
        self.launch(planned.buffer_index)
        self.mark_submitted(planned)
