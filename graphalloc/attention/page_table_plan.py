"""The host half of the attention page tables: a lane row per lane, planned in numpy.

:func:`plan_page_table_rows` is a pure function of the batch (request row per lane), the
ledger's ``seq_len`` and ``frontier`` and a :class:`PageTableSpec`: it validates every
lane, then writes one 64-byte row per lane (layout ``PT_*`` in
:mod:`graphalloc.kernels.abi`: request row, L, ``ceil(L / ps)``, the SWA window start and
first page, the lanes' CSR offsets, the last page length) and returns them with the host
copies FlashInfer's ``plan()`` needs, as a :class:`PageTablePlan`. It never touches the
device and is never captured. Most users want :class:`graphalloc.attention.page_tables.PageTables`,
which plans into its pinned ring with this and launches the kernel
(:func:`graphalloc.kernels.write_page_tables`) that reads the rows; its module docstring
states the output buffers, exactly which SWA pages a lane covers, the masking rule and
the costs. ``PageTableSpec`` and friends are importable from there too.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..errors import (
    AlignmentError,
    BatchTooLargeError,
    ConfigError,
    PositionError,
    TensorSpecError,
    UnknownRequestError,
)
from ..kernels.abi import (
    PT_END_PAGE,
    PT_FULL_OFF,
    PT_LAST_LEN,
    PT_REQ,
    PT_SEQ_LEN,
    PT_SWA_FIRST,
    PT_SWA_OFF,
    PT_WINDOW_START,
    ROW_WIDTH,
)

__all__ = ["PageTableSpec", "PageTablePlan", "plan_page_table_rows"]

_FORMS = ("csr", "block_table")
_LAYERS = ("full", "swa")


@dataclasses.dataclass(frozen=True)
class PageTableSpec:
    """What a :class:`~graphalloc.attention.page_tables.PageTables` writes, and its frozen sizes.

    Args:
        max_batch: B, lanes of the attention batch (the frozen batch size of the buffers).
        page_size: ps, tokens per page (the allocator's).
        sliding_window: W in tokens: an SWA layer at length L reads positions ``>= L - W``.
        max_context_len: columns of ``req_to_token``.
        forms: any of ``"csr"`` (FlashInfer) and ``"block_table"`` (FlashAttention/vLLM).
        layers: any of ``"full"`` and ``"swa"``; an engine pays only for what it lists.
        max_pages_per_req: block-table width; 0: ``ceil(max_context_len / ps)``.
        max_full_indices: FULL ``kv_indices`` capacity; 0: ``B * max_pages_per_req``
            (prefix sharing can make a batch hold more page entries than the pool has pages).
        max_swa_indices: SWA ``kv_indices`` capacity; 0: ``B * min(max_pages_per_req,
            ceil(W / ps) + 1)`` (a window spans at most that many pages).
        out_dtype: ``torch.int32`` (what FlashInfer and FlashAttention take) or int64.
        device: where the allocator's tables and the outputs live.
        backend: ``"triton"`` (the kernel) or ``"torch"`` (the reference twin).
        n_bufs: pinned row tables in the ring (>= 2 lets the host plan step k+1 while the
            device runs step k).
    """

    max_batch: int
    page_size: int
    sliding_window: int
    max_context_len: int
    forms: tuple = _FORMS
    layers: tuple = _LAYERS
    max_pages_per_req: int = 0
    max_full_indices: int = 0
    max_swa_indices: int = 0
    out_dtype: torch.dtype = torch.int32
    device: str | torch.device = "cpu"
    backend: str = "triton"
    n_bufs: int = 2

    def __post_init__(self) -> None:
        def fix(name: str, value) -> None:
            object.__setattr__(self, name, value)

        for name in ("max_batch", "page_size", "sliding_window", "max_context_len", "n_bufs"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"{name} must be a positive int, got {value!r}")
        forms, layers = tuple(self.forms), tuple(self.layers)
        if not forms or any(f not in _FORMS for f in forms) or len(set(forms)) != len(forms):
            raise ConfigError(f"forms must be a non-empty subset of {_FORMS}, got {forms!r}")
        if not layers or any(k not in _LAYERS for k in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"layers must be a non-empty subset of {_LAYERS}, got {layers!r}")
        fix("forms", forms)
        fix("layers", layers)
        if self.out_dtype not in (torch.int32, torch.int64):
            raise ConfigError(f"out_dtype must be torch.int32 or torch.int64, got "
                              f"{self.out_dtype}")
        if self.backend not in ("torch", "triton"):
            raise ConfigError(f"backend must be 'torch' or 'triton', got {self.backend!r}")
        fix("device", torch.device(self.device))
        ps = self.page_size
        fix("max_pages_per_req", self.max_pages_per_req or -(-self.max_context_len // ps))
        window_pages = min(self.max_pages_per_req, -(-self.sliding_window // ps) + 1)
        fix("max_full_indices", self.max_full_indices or self.max_batch * self.max_pages_per_req)
        fix("max_swa_indices", self.max_swa_indices or self.max_batch * window_pages)
        for name in ("max_pages_per_req", "max_full_indices", "max_swa_indices"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")

    @classmethod
    def from_config(cls, config, max_batch: int, **options) -> PageTableSpec:
        """The spec for an :class:`~graphalloc.AllocatorConfig` (page size, window, context
        length, device, backend taken from it; ``options`` override any field)."""
        base = dict(max_batch=max_batch, page_size=config.page_size,
                    sliding_window=config.sliding_window,
                    max_context_len=config.max_context_len, device=config.device,
                    backend=config.backend)
        base.update(options)
        return cls(**base)

    def has(self, form: str, layer: str) -> bool:
        return form in self.forms and layer in self.layers


@dataclasses.dataclass
class PageTablePlan:
    """The host planner's result (numpy, ``[B]`` per lane unless noted).

    ``table`` ``[B, 8]`` int64: the rows the kernel reads. ``lane_rows``: request row per
    lane, -1 on padding. ``end_page`` = ``ceil(L / ps)``; ``swa_first``: first SWA page
    column; ``full_indptr`` / ``swa_indptr`` ``[B+1]``: exclusive prefix sums of page
    counts; ``last_page_len`` (FULL) and ``swa_last_page_len`` (0 where the SWA range is
    empty); ``seq_lens``: L; ``window_start``: ``max(f, L - W, 0)``; ``swa_clipped``: lanes
    with ``f > max(L - W, 0)`` (see :mod:`graphalloc.attention.page_tables`).
    """

    table: np.ndarray
    lane_rows: np.ndarray
    seq_lens: np.ndarray
    end_page: np.ndarray
    swa_first: np.ndarray
    full_indptr: np.ndarray
    swa_indptr: np.ndarray
    last_page_len: np.ndarray
    swa_last_page_len: np.ndarray
    window_start: np.ndarray
    swa_clipped: np.ndarray


def _as_int_array(x, name: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or not (a.dtype.kind in "iu" or a.size == 0):
        raise TensorSpecError(f"{name} must be a 1-D integer array, got {a.dtype} {a.shape}")
    return a.astype(np.int64, copy=False)


def plan_page_table_rows(rows, seq_len, frontier, spec: PageTableSpec,
                         out: np.ndarray | None = None, query_lens=None) -> PageTablePlan:
    """Plan lane rows: a pure function of ``(rows, seq_len, frontier, spec)``.

    ``rows`` ``[n]``, n <= B: request row per lane, in lane order (entries < 0 are padding;
    lanes n..B-1 are padding too; a row may appear on several lanes). ``seq_len`` and
    ``frontier``: per request row (the ledger's arrays, e.g. ``alloc.ledger.seq_len``), the
    lengths the attention reads (after this step's allocation). ``frontier`` may be
    ``None`` when ``"swa"`` is not in ``spec.layers``. ``out``: an int64 ``[B, 8]`` array
    (a pinned buffer's numpy view) that receives the rows; a new one when omitted.
    ``query_lens`` ``[n]`` (optional, default 1 per lane): the lane's query tokens, the last
    q positions of ``[0, L)`` -- a speculative verify of ``1 + k`` tokens, a prefill chunk.
    The SWA range must serve the lane's first query too: its window starts at
    ``max(f, L - (q - 1) - W, 0)`` (the first query, at length ``L - q + 1``, reads from
    ``L - q + 1 - W``). Vectorised (about 35 numpy calls, none per lane); raises a
    :class:`~graphalloc.errors.ContractError` naming the first bad lane, with ``out``
    untouched, when a lane breaks a contract.
    """
    B, ps, W = spec.max_batch, spec.page_size, spec.sliding_window
    rows = _as_int_array(rows, "rows")
    seq_len = _as_int_array(seq_len, "seq_len")
    frontier = (np.zeros_like(seq_len) if frontier is None
                else _as_int_array(frontier, "frontier"))
    if len(frontier) != len(seq_len):
        raise TensorSpecError(f"seq_len ({len(seq_len)}) and frontier ({len(frontier)}) "
                              "must both be per request row")
    n = len(rows)
    if n > B:
        raise BatchTooLargeError(f"{n} lanes exceed the frozen batch of {B} (max_batch); "
                                 "build the page tables with a larger max_batch")
    if n and rows.max() >= len(seq_len):
        i = int(np.argmax(rows >= len(seq_len)))
        raise UnknownRequestError(f"lane {i}: request row {rows[i]} is out of range "
                                  f"[0, {len(seq_len)}); use a negative row for padding")
    # Columns are computed in place in a column-major [8, B] array, then stored as rows.
    cols = np.empty((ROW_WIDTH, B), dtype=np.int64)
    r, L, end = cols[PT_REQ], cols[PT_SEQ_LEN], cols[PT_END_PAGE]
    lane_rows = np.full(B, -1, dtype=np.int64)
    np.maximum(rows, -1, out=lane_rows[:n])
    np.maximum(lane_rows, 0, out=r)
    L[...] = seq_len[r]
    f = frontier[r]
    pad = lane_rows < 0
    if n < B or (n and rows.min() < 0):
        L[pad] = 0
        f[pad] = 0
    max_len = min(spec.max_context_len, spec.max_pages_per_req * ps)
    if L.view(np.uint64).max() > max_len:  # a negative length reads as a huge one
        i = int(np.argmax((L < 0) | (L > max_len)))
        raise PositionError(f"lane {i} (request {lane_rows[i]}): length {L[i]} is outside "
                            f"[0, {max_len}] (max_context_len {spec.max_context_len}, "
                            f"{spec.max_pages_per_req} pages of {ps} per block-table row)")
    if (f.view(np.uint64) > L.view(np.uint64)).any() or (ps > 1 and (f % ps).any()):
        i = int(np.argmax((f % ps != 0) | (f < 0) | (f > L)))
        cls = AlignmentError if f[i] % ps else PositionError
        raise cls(f"lane {i} (request {lane_rows[i]}): frontier {f[i]} must be a multiple of "
                  f"page_size {ps} in [0, length {L[i]}]")
    np.add(L, ps - 1, out=end)
    np.floor_divide(end, ps, out=end)  # ceil(L / ps)
    lo = L - W
    if query_lens is not None:  # the first of q query tokens reads from L - (q - 1) - W
        q = _as_int_array(query_lens, "query_lens")
        if len(q) != n:
            raise TensorSpecError(f"query_lens has {len(q)} entries for {n} lanes")
        bad = (lane_rows[:n] >= 0) & ((q < 1) | (q > np.maximum(L[:n], 1)))
        if bad.any():
            i = int(np.argmax(bad))
            raise PositionError(f"lane {i} (request {lane_rows[i]}): query_lens {q[i]} must "
                                f"be in [1, length {L[i]}]")
        lo[:n] -= np.where(lane_rows[:n] >= 0, q - 1, 0)
    np.maximum(lo, 0, out=lo)  # the window's start, max(L - (q - 1) - W, 0)
    clipped = f > lo
    window_start = cols[PT_WINDOW_START]
    np.maximum(lo, f, out=window_start)
    first = cols[PT_SWA_FIRST]
    np.floor_divide(window_start, ps, out=first)  # <= end, as window_start <= L
    n_swa = end - first
    full_indptr = np.empty(B + 1, dtype=np.int64)
    swa_indptr = np.empty(B + 1, dtype=np.int64)
    full_indptr[0] = swa_indptr[0] = 0
    np.add.accumulate(end, out=full_indptr[1:])
    np.add.accumulate(n_swa, out=swa_indptr[1:])
    for layer, total, cap in (("full", full_indptr[-1], spec.max_full_indices),
                              ("swa", swa_indptr[-1], spec.max_swa_indices)):
        if total > cap and spec.has("csr", layer):
            raise BatchTooLargeError(f"the batch needs {total} {layer.upper()} kv_indices "
                                     f"entries, the buffer holds {cap}; raise "
                                     f"max_{layer}_indices")
    cols[PT_FULL_OFF] = full_indptr[:-1]
    cols[PT_SWA_OFF] = swa_indptr[:-1]
    last = cols[PT_LAST_LEN]
    np.multiply(end, ps, out=last)
    np.subtract(L, last, out=last)
    last += ps  # L - (end - 1) * ps, in [1, ps] where L > 0 ...
    np.minimum(last, L, out=last)  # ... and 0 where L == 0
    table = np.empty((B, ROW_WIDTH), dtype=np.int64) if out is None else out
    table[...] = cols.T
    return PageTablePlan(
        table=table, lane_rows=lane_rows, seq_lens=L, end_page=end, swa_first=first,
        full_indptr=full_indptr, swa_indptr=swa_indptr, last_page_len=last,
        swa_last_page_len=last * (n_swa > 0), window_start=window_start,
        swa_clipped=clipped,
    )
