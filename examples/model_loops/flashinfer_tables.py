"""FlashInfer's paged decode over graphalloc's page tables, in ONE CUDA graph per step.

The check an engine would make before handing graphalloc's CSR tables to FlashInfer: a
seeded workload (admits, chunked prefill extends, decodes, window eviction every step,
releases, a shared prefix through ``take_handle`` / ``admit(handle=)``) runs on a
:class:`graphalloc.HybridAllocator` (pool mode, the default eager executor) built with
``page_tables=PageTableSpec(max_batch=B, forms=("csr",), model_window=W)``: every step it
plans also writes the CSR tables of its batch (its decode rows, then its extend rows) into
``alloc.tables``, in the same launch, after its allocations. Every step is::

    host:   p  = alloc.plan(release=..., evict_all=True, decode=..., extend=...)
            wrappers[i].plan(p.tables.*_kv_indptr_host, ...,
                             p.tables.*_kv_last_page_len_host)          # pinned host copies
    device: graph i = alloc.launch(i) (step kernels, then the tables); new K/V written at
            the step's slots; FULL wrapper.run (window_left=-1); SWA wrapper.run
            (window_left=W-1) (+ the project's Triton paged kernel on the same tables)
            then alloc.mark_submitted(p)

with ``i = p.buffer_index`` and ``BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD",
use_cuda_graph=True, paged_kv_indptr_buffer=alloc.tables.*_kv_indptr_buf,
paged_kv_indices_buffer=alloc.tables.*_kv_indices_buf,
paged_kv_last_page_len_buffer=alloc.tables.*_kv_last_page_len_buf)``, built ONCE per
descriptor buffer: FlashInfer reads graphalloc's buffers directly. Each lane attends with
one query, its token at ``L - 1`` (a prefill chunk's last token): FlashInfer's decode. The
step loop runs under ``torch.cuda.set_sync_debug_mode("error")``.

K/V caches are FlashInfer's NHD tuples ``(k_cache, v_cache)``, each ``[num_pages + 1,
page_size, num_kv_heads, head_dim]`` (page 0 is the allocator's sink), FULL caches indexed
by FULL page ids, SWA caches by SWA page ids; a token's K/V goes to page ``slot // ps``,
offset ``slot % ps`` (the flat view ``cache.view(-1, Hkv, D)[slot]``). The K, V and query
values are an integer hash of (layer kind, request, position) on a 1/128 grid, exact in
fp16 and bf16, so every step is checked three ways (fp16 tolerance ``|a - b| <= atol + rtol
|b|``, atol = rtol = 2e-3 by default: about two fp16 ulps at 1.0, as FlashInfer's split-KV
path stores partial outputs in the output dtype before merging them):

* FlashInfer against ``paged_decode_attention_torch`` (the project's Torch twin) over the
  same CSR tables and caches, FULL and SWA;
* the twin against a dense reference computed from the hash alone (positions ``[0, L)``
  for FULL, ``[max(L - W, f), L)`` for SWA, the shared prefix's positions from its donor):
  the tables, the allocator's slots and the KV writes are right;
* FlashInfer against the dense reference; and a negative control that must fail: the
  dense reference with the window one key short (``window_left = W - 2``) differs from
  FlashInfer's output on lanes longer than the window.

Window convention. FlashInfer masks a key of list index ``kv_idx`` unless ``kv_idx +
qo_len + window_left >= kv_len + qo_idx`` (include/flashinfer/attention/variants.cuh,
``DefaultAttention``'s logits mask); for a decode (``qo_len = 1``, ``qo_idx = 0``) that keeps
``kv_idx >= kv_len - 1 - window_left``: ``window_left + 1`` keys, the query's own
included ("the left (inclusive) window size", ``plan()``'s docstring). graphalloc's tables
with ``model_window = W`` (the model's window, transformers' convention) hold the pages of
positions ``[S, L)``, ``S = floor_page(max(f, L - (q - 1) - W, 0))`` (q the lane's query
tokens: a prefill chunk's range reaches back to its first query's window), and the query at
``L - 1`` reads ``>= L - W``: list index ``>= kv_len - W``, i.e. ``window_left = W - 1``
(indices count from the list's start for queries and keys alike, so S never matters).
The allocator's own window is ``W - 1`` (``AllocatorConfig``), the same ``- 1``.

What ``plan()`` does with graphalloc's buffers (read in flashinfer-ai/flashinfer,
``flashinfer/decode.py``, ``BatchDecodeWithPagedKVCacheWrapper.plan`` (the 0.5/0.6 line) and
``_plan_impl`` (main, 0.7); ``csrc/batch_decode.cu`` ``BatchDecodeWithPagedKVCachePlan``;
``include/flashinfer/attention/scheduler.cuh`` ``DecodePlan``):

* CUDA-graph mode copies into the wrapper's buffers, which here ARE the tables' buffers:
  ``self._paged_kv_indptr_buf.copy_(indptr, non_blocking=True)``, the same for
  ``last_page_len``, and ``self._paged_kv_indices_buf[: len(indices)].copy_(indices, ...)``.
  With the pinned host copies this is two async host-to-device copies of values the
  tables' kernel writes again inside the graph (harmless: same values, stream order).
  ``indices`` here is ``alloc.tables.*_kv_indices_buf[:n]`` (n = ``p.tables.n_*_pages``,
  host known), the buffer's own prefix: torch's ``copy_`` returns early for a view of the same
  data (aten/src/ATen/native/Copy.cpp, "Exit early if self and src are views of the same
  data"), so nothing is copied and the indices never go to the host. ``len(indices)`` is
  only checked against the buffer's length; the CUDA-core decode plan never reads indices.
* ``indptr.to("cpu")`` / ``last_page_len.to("cpu")`` are no-ops on host tensors; the C++
  plan reads the host indptr only (pages per lane), writes its work partition
  (request / kv-tile indices, o_indptr, chunk size, block-valid mask) into the wrapper's
  PINNED int workspace and issues ONE ``cudaMemcpyAsync`` of it to the device int
  workspace on the current stream. No synchronisation anywhere on that path (the
  occupancy and attribute queries do not synchronise).
* In CUDA-graph mode the grid is frozen: ``padded_batch_size = split_kv ? max_grid_size /
  num_kv_heads : batch_size`` and ``split_kv`` depends on the batch size and heads only
  (``batch_size * num_kv_heads >= max_grid_size``: no split; otherwise always split), so
  the plan info baked into the captured graph (workspace offsets) is the same for every
  later plan and only the workspace contents change. The batch size is frozen too
  (``len(last_page_len) == len(paged_kv_last_page_len_buffer)``): plan every step with all
  B lanes; padded lanes are empty ranges (``get_length`` is 0 when ``indptr[i+1] ==
  indptr[i]``, include/flashinfer/page.cuh).
* Hidden hazard (not a sync): the pinned int workspace is ONE buffer per wrapper, written
  by the host at every ``plan()`` and read by the device when its copy runs. Re-planning
  a wrapper before the device ran the previous copy overwrites it. This script keeps one
  FULL + SWA wrapper pair per descriptor-ring index (graph i uses pair i): pair i is
  re-planned only after ``alloc.plan()`` handed buffer i out again, i.e. after the event
  recorded behind that buffer's previous replay completed (the allocator's ring guard),
  so no copy is ever overwritten before it ran, with no extra wait.
* ``run()`` creates its ALiBi-slopes cache with a pageable host-to-device copy on first
  use (``_get_cache_alibi_slopes_buf``) and ``plan()`` JIT-compiles on first use: both
  happen in the warm-up before capture and before the sync-debug region.

Timing (``--timing-batches``, CUDA): a steady decode of B lanes (lengths uniform in
``--timing-len``, window ``--timing-window``, page size 16), one graph per step holding
allocator step with its tables + K/V write + one FULL and one SWA attention (FlashInfer, the
Triton paged kernel, or none), the variants alternating step by step. GPU time per step:
CUDA events around the step's device work (FlashInfer's plan copies included) with the
queue kept full by a ``torch.cuda._sleep`` before each interval, so no idle gap or launch
latency falls inside it. After the timed steps one FlashInfer and one Triton step are
checked against the twin.

Every stage is recorded (``ok``, seconds, and on failure the exception text and the
traceback) in ``flashinfer_tables.json`` (+ ``.md``) under ``--out``, rewritten after each
stage, so a run that dies still says exactly what failed: import, JIT compile, plan,
capture, the step loop, a mismatch. Without FlashInfer (a CPU machine) the workload and
the references still run, with the twin as the attention under test, and the report
records "flashinfer not installed".

GPU (an H200; FlashInfer JIT-compiles two decode variants on first use)::

    python examples/model_loops/flashinfer_tables.py --out results/examples/flashinfer-tables-h200

CPU (no FlashInfer: the workload and the Torch reference path, a progress bar per page size;
exit status 1). At the defaults this takes minutes on a CPU (7.5 min on 2 cores, 157 steps per
page size); a smaller model and fewer requests take about 40 s::

    python examples/model_loops/flashinfer_tables.py --device cpu --timing-batches --out '' \
        --requests 16 --max-batch 8 --heads 4 --head-dim 32
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

if not torch.cuda.is_available():  # Triton kernels (if chosen) run in the interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import timing  # noqa: E402
from provenance import add_stamp_option, stamp_or_exit  # noqa: E402

import graphalloc as ga  # noqa: E402
from graphalloc.kernels import paged_decode_attention, paged_decode_attention_torch  # noqa: E402

__all__ = ["main", "content", "dense_attention", "make_requests", "CorrectnessRun",
           "TimingRun", "FlashInferDecode", "Report", "table_spec", "lane_max_pages"]

# the default --out is a folder of the repository's one results tree
RESULTS = Path(__file__).resolve().parents[2] / "results" / "examples"
FULL, SWA = "full", "swa"
# content kinds: one hash stream per tensor
KIND_Q, KIND_K_FULL, KIND_V_FULL, KIND_K_SWA, KIND_V_SWA = range(5)
KV_KINDS = {FULL: (KIND_K_FULL, KIND_V_FULL), SWA: (KIND_K_SWA, KIND_V_SWA)}
Q_SCALE = 2.0
# rows of the per-step token table [3, T] (the step's allocated tokens, in output-lane order)
TOK_SERIAL, TOK_POS, TOK_VALID = range(3)
# rows of the per-step lane table [6, B] (the attention batch)
LANE_SERIAL, LANE_LEN, LANE_DONOR, LANE_SHARED, LANE_SWA_LO, LANE_VALID = range(6)
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


# ---- logical contents ----------------------------------------------------------------------
def content(kind: int, serial: torch.Tensor, pos: torch.Tensor, width: int) -> torch.Tensor:
    """float32 ``[*serial.shape, width]``: the values of tensor ``kind`` of request
    ``serial`` at position ``pos``, an integer hash on a 1/128 grid in ``[-1, 1)`` (exact in
    fp16 and bf16). Pure integer arithmetic: bit-identical on every device and shape.
    ``serial`` and ``pos`` broadcast; no host read."""
    idx = torch.arange(width, device=serial.device, dtype=torch.int64)
    x = (serial.long() * 1000003 + pos.long() * 7919 + kind * 15485863)[..., None]
    x = (x + idx * 104729) & 0xFFFFFFFF
    x = ((x ^ (x >> 13)) * 0x5BD1E995) & 0xFFFFFFFF
    x = x ^ (x >> 15)
    return ((x & 255) - 128).float() / 128


def lane_query(lane: torch.Tensor, n_heads: int, head_dim: int) -> torch.Tensor:
    """float32 ``[B, n_heads, head_dim]``: each lane's query, the token at ``L - 1``."""
    q = content(KIND_Q, lane[LANE_SERIAL], lane[LANE_LEN] - 1, n_heads * head_dim)
    return (Q_SCALE * q).view(-1, n_heads, head_dim)


def dense_attention(q: torch.Tensor, lane: torch.Tensor, kind: str, n_kv_heads: int,
                    max_len: int, window: int | None = None) -> torch.Tensor:
    """Decode attention of ``q`` ``[B, H, D]`` over each lane's LOGICAL keys, from the hash
    alone (no page table, no cache): positions ``[lo, L)`` with ``lo = 0`` (FULL) or
    ``lo = lane[LANE_SWA_LO] = max(L - W, f, 0)`` (SWA; ``window`` overrides W: the
    negative control); positions below the lane's shared-prefix length come from its
    donor. Fixed-shape over ``[B, max_len]`` keys, sync-free; float32 ``[B, H, D]``, zeros on
    invalid lanes."""
    B, H, D = q.shape
    serial, length = lane[LANE_SERIAL], lane[LANE_LEN]
    j = torch.arange(max_len, device=q.device)[None, :]  # [1, T]
    src = torch.where(j < lane[LANE_SHARED][:, None], lane[LANE_DONOR][:, None],
                      serial[:, None])
    k_kind, v_kind = KV_KINDS[kind]
    k = content(k_kind, src, j, n_kv_heads * D).view(B, max_len, n_kv_heads, D)
    v = content(v_kind, src, j, n_kv_heads * D).view(B, max_len, n_kv_heads, D)
    if kind == FULL:
        lo = torch.zeros_like(length)
    elif window is None:
        lo = lane[LANE_SWA_LO]
    else:
        lo = torch.maximum(lane[LANE_SWA_LO], length - window)
    keep = (j < length[:, None]) & (j >= lo[:, None]) & (lane[LANE_VALID][:, None] != 0)
    qg = q.float().view(B, n_kv_heads, H // n_kv_heads, D) * D ** -0.5
    s = torch.einsum("bgrd,btgd->bgrt", qg, k)
    mask = keep[:, None, None, :]
    s = torch.where(mask, s, float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, 0.0)
    p = torch.where(mask, torch.exp(s - m), 0.0)
    den = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bgrt,btgd->bgrd", p, v) / torch.where(den > 0, den, 1.0)
    return o.reshape(B, H, D)


def excess(out: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor, atol: float,
           rtol: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(max |out - ref|, max(|out - ref| - atol - rtol |ref|))`` over valid lanes, as 0-dim
    device tensors (no host read); NaN counts as infinitely wrong; -1 for no valid lane."""
    ref = ref.float()
    d = torch.nan_to_num((out.float() - ref).abs(), nan=float("inf"))
    e = d - atol - rtol * ref.abs()
    m = (valid != 0)[:, None, None]
    return torch.where(m, d, 0.0).amax(), torch.where(m, e, -1.0).amax()


# ---- the workload --------------------------------------------------------------------------
@dataclasses.dataclass
class Request:
    serial: int
    prompt_len: int
    n_out: int  # tokens to generate (the first comes from the last prefill chunk)
    share: bool  # admit on the shared-prefix handle when it is held
    donor: int = -1  # request whose hash fills positions < n_shared
    n_shared: int = 0
    row: int = -1
    lane: int = -1
    length: int = 0  # positions allocated
    n_gen: int = 0


def make_requests(n: int, prompt_len: tuple[int, int], output_len: tuple[int, int],
                  share_tokens: int, share_prob: float, seed: int) -> list[Request]:
    """``n`` requests, lengths uniform in the inclusive ranges; request 0 (the donor of the
    shared prefix) and the sharers get prompts longer than ``share_tokens``."""
    rng = np.random.default_rng(seed)
    reqs = []
    for s in range(n):
        p = int(rng.integers(prompt_len[0], prompt_len[1] + 1))
        o = int(rng.integers(output_len[0], output_len[1] + 1))
        share = bool(share_tokens) and s > 0 and bool(rng.random() < share_prob)
        if share_tokens and (s == 0 or share):
            p = max(p, share_tokens + 1)
        reqs.append(Request(s, p, o, share))
    return reqs


# ---- attention backends --------------------------------------------------------------------
def table_spec(max_batch: int, window: int) -> ga.PageTableSpec:
    """The allocator's page tables here: FlashInfer's CSR form, FULL and SWA layers,
    ``max_batch`` lanes, the model's window ``window`` (W)."""
    return ga.PageTableSpec(max_batch=max_batch, forms=("csr",), model_window=window)


def lane_max_pages(tables) -> dict:
    """The most pages one lane's range holds, per layer kind: FULL the block width, SWA
    ``ceil((W + q_max - 1) / ps) + 1`` (q_max: the longest query a row can have, a prefill
    chunk) -- the Torch twin's fixed grid over each CSR."""
    spec, cfg = tables.spec, tables.config
    q_max = cfg.max_tokens_per_alloc_row
    swa = -(-(spec.model_window + q_max - 1) // cfg.page_size) + 1
    return {FULL: spec.max_pages_per_req, SWA: min(spec.max_pages_per_req, swa)}


class FlashInferDecode:
    """FlashInfer's CUDA-graph paged decode over an allocator's page tables
    (``alloc.tables``): one FULL wrapper (``window_left=-1``) and one SWA wrapper
    (``window_left = W - 1``, W the tables' ``model_window`` unless ``window`` is given) per
    descriptor-ring index, built once, all reading the tables' device buffers, sharing one
    float workspace.

    ``plan(i, t)`` (``t = p.tables``): host planning from the step's pinned host copies
    (FlashInfer's C++ plan + two async copies into the tables' indptr / last-page-length
    buffers + one async copy of its work partition; no sync). ``run(i, ...)``:
    capture-safe, two launches (plus the split-KV merge). Pair i is planned only when the
    allocator handed out buffer i (see the module docstring: the pinned-workspace
    hazard)."""

    def __init__(self, flashinfer, tables, n_ring: int, *, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 window: int | None = None, workspace_mib: int = 128,
                 enable_pdl: bool | None = None):
        self.tables = tables
        self.window = tables.spec.model_window if window is None else window
        self.heads = (num_qo_heads, num_kv_heads, head_dim)
        self.page_size, self.dtype = tables.config.page_size, dtype
        self.run_kwargs = {} if enable_pdl is None else {"enable_pdl": enable_pdl}
        self.workspace = torch.zeros(workspace_mib << 20, dtype=torch.uint8,
                                     device=tables.config.device)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper
        t = tables
        self.pairs = [
            (wrapper(self.workspace, "NHD", use_cuda_graph=True,
                     paged_kv_indptr_buffer=t.full_kv_indptr_buf,
                     paged_kv_indices_buffer=t.full_kv_indices_buf,
                     paged_kv_last_page_len_buffer=t.full_kv_last_page_len_buf),
             wrapper(self.workspace, "NHD", use_cuda_graph=True,
                     paged_kv_indptr_buffer=t.swa_kv_indptr_buf,
                     paged_kv_indices_buffer=t.swa_kv_indices_buf,
                     paged_kv_last_page_len_buffer=t.swa_kv_last_page_len_buf))
            for _ in range(n_ring)]

    def plan(self, i: int, planned) -> None:
        full, swa = self.pairs[i]
        t = self.tables
        kw = dict(q_data_type=self.dtype, kv_data_type=self.dtype)
        full.plan(planned.full_kv_indptr_host, t.full_kv_indices_buf[:planned.n_full_pages],
                  planned.full_kv_last_page_len_host, *self.heads, self.page_size,
                  window_left=-1, **kw)
        swa.plan(planned.swa_kv_indptr_host, t.swa_kv_indices_buf[:planned.n_swa_pages],
                 planned.swa_kv_last_page_len_host, *self.heads, self.page_size,
                 window_left=self.window - 1, **kw)

    def run(self, i: int, q, caches: dict, outs: dict) -> None:
        full, swa = self.pairs[i]
        full.run(q, caches[FULL], out=outs[FULL], **self.run_kwargs)
        swa.run(q, caches[SWA], out=outs[SWA], window_left=self.window - 1, **self.run_kwargs)


def table_attention(fn, tables, q, caches: dict, outs: dict) -> None:
    """The project's paged decode (``paged_decode_attention`` or its twin) on both layer
    kinds' CSR tables (``alloc.tables``), into ``outs``. Capture-safe, sync-free."""
    t, grid = tables, lane_max_pages(tables)
    for kind, csr, window in (
            (FULL, (t.full_kv_indptr_buf, t.full_kv_indices_buf, t.full_kv_last_page_len_buf),
             0),
            (SWA, (t.swa_kv_indptr_buf, t.swa_kv_indices_buf, t.swa_kv_last_page_len_buf),
             t.spec.model_window)):
        k, v = caches[kind]
        fn(q, k, v, *csr, sliding_window=window, max_pages=grid[kind], out=outs[kind])


def progress(total, desc: str, enabled: bool):
    """A tqdm bar on stderr (host only: safe under sync debug), or None (disabled, or tqdm
    not installed)."""
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr)


@contextlib.contextmanager
def sync_debug(enabled: bool):
    """``torch.cuda.set_sync_debug_mode("error")`` for the block (CUDA only)."""
    if not enabled:
        yield
        return
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)


# ---- the correctness run -------------------------------------------------------------------
class CorrectnessRun:
    """The seeded workload of the module docstring at one page size; ``attention`` is the
    attention under test: ``"flashinfer"``, ``"triton"`` (the project's paged kernel) or
    ``"torch"`` (its twin: the CPU path). ``phase`` names what it is doing (for the
    failure record)."""

    METRICS = ("test_vs_twin_full_abs", "test_vs_twin_full_excess",
               "test_vs_twin_swa_abs", "test_vs_twin_swa_excess",
               "twin_vs_dense_full_excess", "twin_vs_dense_swa_excess",
               "test_vs_dense_full_excess", "test_vs_dense_swa_excess",
               "triton_vs_twin_full_excess", "triton_vs_twin_swa_excess",
               "control_swa_excess")
    REQUIRED = ("test_vs_twin_full_excess", "test_vs_twin_swa_excess",
                "twin_vs_dense_full_excess", "twin_vs_dense_swa_excess",
                "test_vs_dense_full_excess", "test_vs_dense_swa_excess")

    def __init__(self, args, *, page_size: int, device: torch.device, attention: str,
                 flashinfer=None):
        self.phase = "setup"
        self.args, self.device, self.attention = args, device, attention
        self.is_cuda = device.type == "cuda"
        self.graph = self.is_cuda and not args.no_graph
        self.with_triton = self.is_cuda and attention == "flashinfer" and not args.no_triton
        self.dtype = DTYPES[args.dtype]
        ps, B, W = page_size, args.max_batch, args.window
        self.ps, self.B, self.W = ps, B, W
        self.H, self.Hkv, self.D = args.heads, args.kv_heads, args.head_dim
        share = args.share_tokens
        if share % ps:
            raise ValueError(f"--share-tokens {share} must be whole pages of {ps}")
        self.requests = make_requests(args.requests, tuple(args.prompt_len),
                                      tuple(args.output_len), share, args.share_prob,
                                      args.seed)
        max_prompt = max(r.prompt_len for r in self.requests)
        max_total = max(r.prompt_len + r.n_out for r in self.requests)
        max_reqs = 2 * B  # finished rows wait one step for their release
        extra = share // ps + 2
        cfg = ga.AllocatorConfig(
            page_size=ps, max_reqs=max_reqs, max_context_len=max_total,
            num_full_pages=max_reqs * -(-max_total // ps) + extra,
            num_swa_pages=max_reqs * (-(-max_prompt // ps) + -(-W // ps) + 2) + extra,
            model_window=W, max_handles=2 if share else 0, device=device,
            backend="triton" if self.is_cuda else "torch")
        self.cfg = cfg
        # the default eager executor; every step writes its batch's CSR tables
        self.alloc = ga.HybridAllocator(cfg, page_tables=table_spec(B, W))
        n_ring = len(self.alloc.ring)
        self.tables = self.alloc.tables
        dev, dt = device, self.dtype
        self.caches = {kind: tuple(torch.zeros(n + 1, ps, self.Hkv, self.D, dtype=dt,
                                               device=dev) for _ in range(2))
                       for kind, n in ((FULL, cfg.num_full_pages), (SWA, cfg.num_swa_pages))}
        self.T = cfg.max_step_tokens
        pin = self.is_cuda
        self.tok_host = [torch.zeros(3, self.T, dtype=torch.int64, pin_memory=pin)
                         for _ in range(n_ring)]
        self.lane_host = [torch.zeros(6, B, dtype=torch.int64, pin_memory=pin)
                          for _ in range(n_ring)]
        self.tok_np = [t.numpy() for t in self.tok_host]
        self.lane_np = [t.numpy() for t in self.lane_host]
        self.tok_dev = torch.zeros(3, self.T, dtype=torch.int64, device=dev)
        self.lane_dev = torch.zeros(6, B, dtype=torch.int64, device=dev)
        self.q = torch.zeros(B, self.H, self.D, dtype=dt, device=dev)
        self.outs = {FULL: torch.zeros_like(self.q), SWA: torch.zeros_like(self.q)}
        self.tri_outs = {FULL: torch.zeros_like(self.q), SWA: torch.zeros_like(self.q)}
        self.fi = None
        if attention == "flashinfer":
            self.fi = FlashInferDecode(flashinfer, self.tables, n_ring, num_qo_heads=self.H,
                                       num_kv_heads=self.Hkv, head_dim=self.D, dtype=dt,
                                       window=W, enable_pdl=args.pdl_flag)
        max_steps = sum(r.n_out + -(-r.prompt_len // args.chunk) for r in self.requests) + 8
        self.stats = torch.zeros(max_steps, len(self.METRICS), dtype=torch.float32, device=dev)
        self.graphs: list = []

    # ---- device work of a step (captured) --------------------------------------------------
    def _body(self, i: int) -> None:
        self.alloc.launch(i)  # the step's kernels, then its batch's tables
        self.tok_dev.copy_(self.tok_host[i], non_blocking=True)
        self.lane_dev.copy_(self.lane_host[i], non_blocking=True)
        tok, st = self.tok_dev, self.alloc.state
        ok = tok[TOK_VALID] != 0
        slots = {FULL: torch.where(ok, st.out_full_buf[:self.T].long(), 0),  # sink 0 if unused
                 SWA: torch.where(ok, st.out_swa_buf[:self.T].long(), 0)}
        width = self.Hkv * self.D
        for kind, (k_kind, v_kind) in KV_KINDS.items():
            for cache, c_kind in zip(self.caches[kind], (k_kind, v_kind), strict=True):
                vals = content(c_kind, tok[TOK_SERIAL], tok[TOK_POS], width)
                cache.view(-1, self.Hkv, self.D)[slots[kind]] = (
                    vals.view(-1, self.Hkv, self.D).to(self.dtype))
        self.q.copy_(lane_query(self.lane_dev, self.H, self.D))
        if self.attention == "flashinfer":
            self.fi.run(i, self.q, self.caches, self.outs)
        else:
            fn = paged_decode_attention if self.attention == "triton" else \
                paged_decode_attention_torch
            table_attention(fn, self.tables, self.q, self.caches, self.outs)
        if self.with_triton:
            table_attention(paged_decode_attention, self.tables, self.q, self.caches,
                            self.tri_outs)

    def _check(self, k: int) -> None:
        """Eager, after step ``k``'s device work (stream order): the references and the
        step's statistics row, all on the device (no host read)."""
        a = self.args
        lane, valid = self.lane_dev, self.lane_dev[LANE_VALID]
        twin = {kind: torch.zeros_like(self.q) for kind in (FULL, SWA)}
        table_attention(paged_decode_attention_torch, self.tables, self.q, self.caches, twin)
        max_len = self.cfg.max_context_len
        dense = {kind: dense_attention(self.q, lane, kind, self.Hkv, max_len)
                 for kind in (FULL, SWA)}
        control = dense_attention(self.q, lane, SWA, self.Hkv, max_len, window=self.W - 1)
        tol = (a.atol, a.rtol)
        vals = []
        for kind in (FULL, SWA):
            vals += excess(self.outs[kind], twin[kind], valid, *tol)
        vals += [excess(twin[kind], dense[kind], valid, *tol)[1] for kind in (FULL, SWA)]
        vals += [excess(self.outs[kind], dense[kind], valid, *tol)[1] for kind in (FULL, SWA)]
        if self.with_triton:
            vals += [excess(self.tri_outs[kind], twin[kind], valid, *tol)[1]
                     for kind in (FULL, SWA)]
        else:
            vals += [torch.full((), -1.0, device=self.device)] * 2
        vals.append(excess(self.outs[SWA], control, valid, *tol)[1])
        self.stats[k].copy_(torch.stack(vals))

    # ---- capture -----------------------------------------------------------------------------
    def _empty_step(self, body) -> None:
        alloc = self.alloc
        p = alloc.plan()
        i = p.buffer_index
        self.tok_np[i][...] = 0
        self.lane_np[i][...] = 0
        if self.fi is not None:
            self.fi.plan(i, p.tables)
        body(i)
        alloc.mark_submitted(p)

    def capture(self) -> None:
        """Warm up (JIT, Triton compiles, FlashInfer's first plan and its cached buffers) and,
        on CUDA, capture one graph per descriptor buffer. Call before any request."""
        self.phase = "warm-up (first plan() and run(): JIT compile on first use)"
        if not self.graph:
            self._empty_step(self._body)
            return
        torch.cuda.synchronize()  # sync ok: one-time set-up
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2 * len(self.alloc.ring)):
                self._empty_step(self._body)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()  # sync ok: one-time set-up
        self.phase = "CUDA graph capture"
        pool = None
        for i in range(len(self.alloc.ring)):
            g = ga.capture_graph(lambda i=i: self._body(i), pool=pool)
            pool = g.pool()
            self.graphs.append(g)
        torch.cuda.synchronize()  # sync ok: one-time set-up

    # ---- the step loop -----------------------------------------------------------------------
    def run(self) -> dict:
        a, alloc, B = self.args, self.alloc, self.B
        self.capture()
        self.phase = "step loop"
        queue = list(self.requests)
        lanes: dict[int, Request] = {}
        to_release: list[int] = []
        handle = None  # (handle, donor serial) once the donor's prefix is allocated
        donor = self.requests[0] if a.share_tokens else None
        share = a.share_tokens
        host = {"steps": 0, "lane_steps": 0, "evicted": 0, "clipped": 0, "handles_taken": 0,
                "admitted_on_handle": 0, "prefill_chunks": 0, "max_lanes": 0,
                "max_full_pages": 0, "max_swa_pages": 0, "sharing_lane_steps": 0,
                "lanes_longer_than_window": 0}
        plan_us: list[float] = []
        k = 0
        t0 = time.perf_counter()
        bar = progress(None, f"correctness ps={self.ps} steps", not a.no_progress)
        with sync_debug(self.is_cuda and not a.no_sync_debug):
            while queue or lanes or to_release:
                # handles: the donor's prefix once it is allocated; dropped with no sharer left
                if (handle is None and donor is not None and donor.row >= 0
                        and donor.length >= share and not host["handles_taken"]):
                    handle = (alloc.take_handle(donor.row, share), donor.serial)
                    host["handles_taken"] += 1
                if handle is not None and not any(r.share for r in queue):
                    alloc.drop_handle(handle[0])
                    handle = None
                # admissions into free lanes (a sharer: one step on the handle, eager)
                free = [b for b in range(B) if b not in lanes]
                rows_free = self.cfg.max_reqs - alloc.n_live  # released rows: after the step
                while free and queue and rows_free > 0 and self._pages_ok(queue[0], lanes):
                    if queue[0].share and handle is None and not host["handles_taken"]:
                        break  # a sharer waits for the donor's prefix
                    r = queue.pop(0)
                    if r.share and handle is not None:
                        r.row = alloc.admit(handle=handle[0], n_tokens=share)
                        r.donor, r.n_shared, r.length = handle[1], share, share
                        host["admitted_on_handle"] += 1
                    else:
                        r.row = alloc.admit()
                        r.donor = r.serial
                    r.lane = free.pop(0)
                    lanes[r.lane] = r
                    rows_free -= 1
                # the step: releases, window eviction, decodes, prefill chunks
                order = sorted(lanes)
                dec = [lanes[b] for b in order if lanes[b].length >= lanes[b].prompt_len]
                ext, ext_n, budget = [], [], self.T - len(dec)
                for b in order:
                    r = lanes[b]
                    n = min(r.prompt_len - r.length, a.chunk, budget)
                    if r.length < r.prompt_len and n > 0:
                        ext.append(r)
                        ext_n.append(n)
                        budget -= n
                if k >= len(self.stats):
                    raise RuntimeError(f"the workload did not finish in {k} steps")
                th = time.perf_counter()
                p = alloc.plan(release=to_release or None, evict_all=True,
                               decode=[r.row for r in dec] or None,
                               extend=([r.row for r in ext], ext_n) if ext else None)
                i = p.buffer_index
                tok = self.tok_np[i]
                tok[...] = 0
                j = 0
                for r in dec:
                    tok[:, j] = (r.serial, r.length, 1)
                    r.length += 1
                    j += 1
                for r, n in zip(ext, ext_n, strict=True):
                    tok[TOK_SERIAL, j:j + n] = r.serial
                    tok[TOK_POS, j:j + n] = np.arange(r.length, r.length + n)
                    tok[TOK_VALID, j:j + n] = 1
                    r.length += n
                    j += n
                host["prefill_chunks"] += len(ext)
                attending = dec + ext  # the step's batch: table lane k is attending[k]
                t = p.tables
                if t.n_lanes != len(attending):
                    raise RuntimeError(f"the step's tables have {t.n_lanes} lanes, its batch "
                                       f"{len(attending)}")
                front = alloc.frontiers()
                lane = self.lane_np[i]
                lane[...] = 0
                for k, r in enumerate(attending):
                    f = int(front[r.row])
                    lane[:, k] = (r.serial, r.length, r.donor, r.n_shared,
                                  max(r.length - self.W, f, 0), 1)
                    host["clipped"] += f > max(r.length - self.W, 0)
                    host["sharing_lane_steps"] += r.n_shared > 0
                    host["lanes_longer_than_window"] += r.length > self.W
                if self.fi is not None:
                    self.fi.plan(i, t)
                plan_us.append((time.perf_counter() - th) * 1e6)
                if self.graphs:
                    self.graphs[i].replay()
                else:
                    self._body(i)
                self._check(k)
                alloc.mark_submitted(p)
                host["steps"] += 1
                host["lane_steps"] += len(attending)
                host["evicted"] += p.pages_evicted
                host["max_lanes"] = max(host["max_lanes"], len(attending))
                host["max_full_pages"] = max(host["max_full_pages"], t.n_full_pages)
                host["max_swa_pages"] = max(host["max_swa_pages"], t.n_swa_pages)
                k += 1
                if bar is not None:
                    bar.update(1)
                to_release = []
                for r in attending:
                    if r.length >= r.prompt_len:
                        r.n_gen += 1
                    if r.n_gen >= r.n_out:
                        to_release.append(r.row)
                        del lanes[r.lane]
            if handle is not None:
                alloc.drop_handle(handle[0])
        if bar is not None:
            bar.close()
        if self.is_cuda:
            torch.cuda.synchronize()  # sync ok: after the loop
        wall = time.perf_counter() - t0
        self.phase = "reading the statistics and auditing the allocator"
        stats = self.stats[:k].cpu().numpy()
        alloc.check()
        alloc.check_integrity()
        audit = [str(x) for x in alloc.audit()]
        used = alloc.stats()
        return self._summary(stats, host, audit, used, wall, plan_us)

    def _pages_ok(self, r: Request, lanes: dict) -> bool:
        ps = self.ps
        need = -(-r.prompt_len // ps) + 1 + len(lanes)
        return need <= min(self.alloc.n_free("full"), self.alloc.n_free("swa"))

    def _summary(self, stats, host, audit, used, wall, plan_us) -> dict:
        metrics = {}
        for m, name in enumerate(self.METRICS):
            col = stats[:, m]
            worst = int(np.argmax(col)) if len(col) else -1
            metrics[name] = {"max": float(col.max()) if len(col) else None, "step": worst}
        failures = []
        required = list(self.REQUIRED) + (["triton_vs_twin_full_excess",
                                           "triton_vs_twin_swa_excess"]
                                          if self.with_triton else [])
        for name in required:
            col = stats[:, self.METRICS.index(name)]
            bad = np.flatnonzero(~(col <= 0))
            if len(bad):
                failures.append({"check": name, "steps_failing": int(len(bad)),
                                 "first_step": int(bad[0]), "max_excess": float(col.max())})
        control = stats[:, self.METRICS.index("control_swa_excess")]
        control_steps = int(np.count_nonzero(control > 0))
        if control_steps == 0:
            failures.append({"check": "negative control (window one key short) must differ",
                             "steps_failing": 0})
        if audit:
            failures.append({"check": "alloc.audit() after the run", "findings": audit[:5]})
        if used["full_used_pages"] or used["swa_used_pages"]:
            failures.append({"check": "every page back in its pool after the run",
                             "full_used_pages": used["full_used_pages"],
                             "swa_used_pages": used["swa_used_pages"]})
        for need, what in (("evicted", "SWA pages evicted by the window"),
                           ("prefill_chunks", "prefill extends"),
                           ("lanes_longer_than_window", "lanes longer than the window")):
            if not host[need]:
                failures.append({"check": f"the workload exercised {what}", "count": 0})
        if self.args.share_tokens and not host["admitted_on_handle"]:
            failures.append({"check": "the workload admitted requests on the shared prefix",
                             "count": 0})
        return {
            "ok": not failures, "failures": failures, "attention": self.attention,
            "page_size": self.ps, "max_batch": self.B, "window": self.W,
            "allocator_window": self.cfg.sliding_window, "graph": bool(self.graphs),
            "sync_debug": self.is_cuda and not self.args.no_sync_debug,
            "triton_in_graph": self.with_triton, "dtype": self.args.dtype,
            "heads": {"qo": self.H, "kv": self.Hkv, "head_dim": self.D},
            "tolerance": {"atol": self.args.atol, "rtol": self.args.rtol},
            "requests": len(self.requests), "workload": host,
            "control_steps_detected": control_steps, "metrics": metrics,
            "audit": audit, "wall_s": wall,
            "host_plan_us": timing.summarize(plan_us),
            "graph_nodes": timing.graph_nodes(self.graphs[0]) if self.graphs else None,
        }


# ---- timing --------------------------------------------------------------------------------
class TimingRun:
    """Steady decode of ``B`` lanes: GPU us per step of allocator step + tables + K/V write +
    one FULL and one SWA attention, per attention variant (see the module docstring)."""

    def __init__(self, args, B: int, device: torch.device, flashinfer=None):
        self.phase = "setup"
        self.args, self.B, self.device = args, B, device
        ps, W = args.timing_page_size, args.timing_window
        self.ps, self.W = ps, W
        self.H, self.Hkv, self.D = args.heads, args.kv_heads, args.head_dim
        self.dtype = DTYPES[args.dtype]
        rng = np.random.default_rng([args.seed, B])
        self.lens = rng.integers(args.timing_len[0], args.timing_len[1] + 1, size=B)
        self.variants = ["none", "triton"] + (["flashinfer"] if flashinfer is not None else [])
        n_steps = len(self.variants) * (args.timing_warmup + args.timing_steps) + 8
        max_ctx = -(-(int(self.lens.max()) + n_steps + ps) // ps) * ps
        max_step_tokens = B + max_ctx
        cfg = ga.AllocatorConfig(
            page_size=ps, max_reqs=B, max_context_len=max_ctx,
            num_full_pages=B * (max_ctx // ps) + 8,
            num_swa_pages=B * (-(-W // ps) + 3) + -(-max_step_tokens // ps) + B + 8,
            model_window=W, device=device,
            backend="triton" if device.type == "cuda" else "torch")
        self.cfg = cfg
        self.alloc = ga.HybridAllocator(cfg, page_tables=table_spec(B, W))
        n_ring = len(self.alloc.ring)
        self.tables = self.alloc.tables
        dt = self.dtype
        gen = torch.Generator(device=device).manual_seed(args.seed)
        self.caches = {kind: tuple(torch.randn(n + 1, ps, self.Hkv, self.D, generator=gen,
                                               device=device).to(dt) for _ in range(2))
                       for kind, n in ((FULL, cfg.num_full_pages), (SWA, cfg.num_swa_pages))}
        self.q = torch.randn(B, self.H, self.D, generator=gen, device=device).to(dt)
        self.kv_new = torch.randn(B, self.Hkv, self.D, generator=gen, device=device).to(dt)
        self.outs = {v: {FULL: torch.zeros_like(self.q), SWA: torch.zeros_like(self.q)}
                     for v in self.variants}
        self.fi = None
        if flashinfer is not None:
            self.fi = FlashInferDecode(flashinfer, self.tables, n_ring, num_qo_heads=self.H,
                                       num_kv_heads=self.Hkv, head_dim=self.D, dtype=dt,
                                       window=W, enable_pdl=args.pdl_flag)
        self.graphs: dict[str, list] = {}

    def _body(self, variant: str, i: int) -> None:
        self.alloc.launch(i)  # the step's kernels, then its batch's tables
        st, B = self.alloc.state, self.B
        slots = {FULL: st.out_full_buf[:B].long(), SWA: st.out_swa_buf[:B].long()}
        for kind in (FULL, SWA):
            for cache in self.caches[kind]:
                cache.view(-1, self.Hkv, self.D)[slots[kind]] = self.kv_new
        outs = self.outs[variant]
        if variant == "flashinfer":
            self.fi.run(i, self.q, self.caches, outs)
        elif variant == "triton":
            table_attention(paged_decode_attention, self.tables, self.q, self.caches, outs)

    def _plan(self, variant: str):
        alloc = self.alloc
        p = alloc.plan(evict_all=True, decode=self.rows) if self.rows is not None else \
            alloc.plan()
        if variant == "flashinfer" or (variant == "all" and self.fi is not None):
            self.fi.plan(p.buffer_index, p.tables)
        return p

    def _submit(self, p) -> None:
        self.alloc.mark_submitted(p)

    def capture(self) -> None:
        """Warm-up and capture, on the empty allocator (every slot is the sink then)."""
        self.phase = "warm-up"
        self.rows = None
        torch.cuda.synchronize()  # sync ok: one-time set-up
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2 * len(self.alloc.ring)):
                p = self._plan("all")
                for v in self.variants:
                    self._body(v, p.buffer_index)
                self._submit(p)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()  # sync ok: one-time set-up
        self.phase = "CUDA graph capture"
        pool = None
        for v in self.variants:
            self.graphs[v] = []
            for i in range(len(self.alloc.ring)):
                g = ga.capture_graph(lambda v=v, i=i: self._body(v, i), pool=pool)
                pool = g.pool()
                self.graphs[v].append(g)
        torch.cuda.synchronize()  # sync ok: one-time set-up

    def prefill(self) -> None:
        """Every lane admitted and prefilled to its length, in as few eager steps as the
        frozen step shape allows (not timed; the K/V stays the random initial contents)."""
        self.phase = "prefill"
        alloc, cap = self.alloc, self.cfg.max_step_tokens
        rows = [alloc.admit() for _ in range(self.B)]
        chunk, n = [], 0
        for r, length in zip(rows, self.lens, strict=True):
            if chunk and n + length > cap:
                alloc.step(evict_all=True, extend=([c for c, _ in chunk], [m for _, m in chunk]))
                chunk, n = [], 0
            chunk.append((r, int(length)))
            n += int(length)
        alloc.step(evict_all=True, extend=([c for c, _ in chunk], [m for _, m in chunk]))
        self.rows = np.asarray(rows, dtype=np.int64)

    def _sleep_cycles(self) -> tuple[int, float]:
        """Cycles of ``torch.cuda._sleep`` that keep the GPU busy ``--timing-sleep-us``."""
        cycles = 1_000_000
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(cycles)  # warm
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()  # sync ok: calibration, before the loop
        us_per = start.elapsed_time(end) * 1e3 / cycles
        n = int(self.args.timing_sleep_us / max(us_per, 1e-9))
        return n, n * us_per

    def _launch(self, variant: str, i: int) -> None:
        if self.graphs:
            self.graphs[variant][i].replay()
        else:
            self._body(variant, i)

    def run(self) -> dict:
        """Capture (CUDA), prefill, the alternating timed steps, then one checked step per
        attention variant. On a CPU the same steps run eagerly and nothing is timed (a smoke
        run of the code path)."""
        a, cuda = self.args, self.device.type == "cuda"
        if cuda:
            self.capture()
        self.prefill()
        self.phase = "timed steps"
        cycles, sleep_us = self._sleep_cycles() if cuda else (0, 0.0)
        nv = len(self.variants)
        order = [self.variants[k % nv] for k in range(nv * (a.timing_warmup + a.timing_steps))]
        pairs = {v: [] for v in self.variants}
        host_us = {v: [] for v in self.variants}
        late = {v: 0 for v in self.variants}
        stalls0 = self.alloc.ring.stalls
        bar = progress(len(order), f"timing B={self.B} steps", not a.no_progress)
        with sync_debug(cuda and not a.no_sync_debug):
            for k, v in enumerate(order):
                if bar is not None:
                    bar.update(1)
                if cuda:
                    torch.cuda._sleep(cycles)  # the queue stays full while the host plans
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                th = time.perf_counter()
                p = self._plan(v)
                host_us[v].append((time.perf_counter() - th) * 1e6)
                self._launch(v, p.buffer_index)
                if cuda:
                    # the GPU already past the interval's start: it may hold an idle gap
                    late[v] += bool(start.query())
                    end.record()
                self._submit(p)
                if cuda and k >= nv * a.timing_warmup:
                    pairs[v].append((start, end))
        if bar is not None:
            bar.close()
        if cuda:
            torch.cuda.synchronize()  # sync ok: after the loop
        gpu = {v: timing.summarize([s.elapsed_time(e) * 1e3 for s, e in pairs[v]])
               for v in self.variants}
        self.phase = "post-timing check against the twin"
        checks = {}
        for v in self.variants:
            if v == "none":
                continue
            p = self._plan(v)
            self._launch(v, p.buffer_index)
            self._submit(p)
            twin = {kind: torch.zeros_like(self.q) for kind in (FULL, SWA)}
            table_attention(paged_decode_attention_torch, self.tables, self.q, self.caches,
                            twin)
            valid = torch.ones(self.B, dtype=torch.int64, device=self.device)
            checks[v] = {kind: [float(x) for x in excess(self.outs[v][kind], twin[kind], valid,
                                                         a.atol, a.rtol)]
                         for kind in (FULL, SWA)}
        ok = all(c[kind][1] <= 0 for c in checks.values() for kind in (FULL, SWA))
        base = gpu["none"]["p50"] if gpu["none"] else None
        return {
            "ok": ok, "B": self.B, "page_size": self.ps, "window": self.W,
            "lengths": [int(self.lens.min()), int(self.lens.max())],
            "timed": cuda, "gpu_us_per_step": gpu,
            "attention_us_p50": {v: gpu[v]["p50"] - base for v in self.variants
                                 if v != "none" and base is not None},
            # alloc.plan with its tables (+ FlashInfer's plans), descriptor-ring waits included
            "host_plan_us": {v: timing.summarize(host_us[v]) for v in self.variants},
            "sleep_us": sleep_us,
            "host_plan_max_us": max(max(x) for x in host_us.values()),
            # steps whose replay was enqueued after the GPU reached the interval's start
            # (0: every interval holds queued GPU work only, no idle gap)
            "late_steps": late, "ring_stalls": self.alloc.ring.stalls - stalls0,
            "check_vs_twin": {v: {kind: {"max_abs": c[kind][0], "max_excess": c[kind][1]}
                                  for kind in c} for v, c in checks.items()},
            "graph_nodes": ({v: timing.graph_nodes(self.graphs[v][0]) for v in self.variants}
                            if self.graphs else None),
        }


# ---- the report ----------------------------------------------------------------------------
class Report:
    """Stages with their outcome, written to ``out_dir`` after every stage."""

    def __init__(self, out_dir: str, config: dict):
        self.out_dir = Path(out_dir) if out_dir else None
        self.data = {"ok": False, "config": config, "stages": [], "failures": []}

    @contextlib.contextmanager
    def stage(self, name: str, phase_of=None):
        """Run the block as stage ``name``; an exception is recorded (text, traceback, the
        ``phase`` of ``phase_of()`` if given) and swallowed. Yields the stage's dict: put
        results under ``"result"``, set ``"ok"`` False for a mismatch."""
        rec = {"stage": name, "ok": True}
        print(f"[flashinfer_tables] {name} ...", flush=True)
        t0 = time.perf_counter()
        try:
            yield rec
        except Exception as exc:
            rec["ok"] = False
            rec["error"] = f"{type(exc).__name__}: {exc}"
            rec["traceback"] = traceback.format_exc()
            if phase_of is not None:
                rec["phase"] = phase_of()
        rec["seconds"] = round(time.perf_counter() - t0, 3)
        self.data["stages"].append(rec)
        if not rec["ok"]:
            fail = {k: rec[k] for k in ("stage", "error", "phase") if k in rec}
            if "error" not in rec:
                fail["error"] = "mismatch: " + json.dumps(
                    (rec.get("result") or {}).get("failures"), default=_json_default)[:2000]
            self.data["failures"].append(fail)
        print(f"[flashinfer_tables] {name}: {'ok' if rec['ok'] else 'FAILED'} "
              f"({rec['seconds']:.1f} s)" + (f": {rec['error']}" if "error" in rec else ""),
              flush=True)
        self.write()

    def skip(self, name: str, reason: str) -> None:
        """Record stage ``name`` as skipped on this machine (not a failure), with why."""
        self.data["stages"].append({"stage": name, "ok": True, "skipped": reason})
        print(f"[flashinfer_tables] {name}: skipped ({reason})", flush=True)
        self.write()

    def skipped(self) -> list[str]:
        return [f"{s['stage']} ({s['skipped']})" for s in self.data["stages"] if "skipped" in s]

    def write(self) -> None:
        self.data["ok"] = bool(self.data["stages"]) and all(s["ok"] for s in self.data["stages"])
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        (self.out_dir / "flashinfer_tables.json").write_text(
            json.dumps(self.data, indent=1, default=_json_default))
        (self.out_dir / "flashinfer_tables.md").write_text(markdown(self.data))


def markdown(data: dict) -> str:
    cfg = data["config"]
    lines = [f"# flashinfer_tables: {cfg.get('machine', {}).get('summary', '?')}", "",
             f"FlashInfer: {cfg.get('flashinfer_version') or 'not available'}; "
             f"overall: {'OK' if data['ok'] else 'FAILED'}", "",
             "| stage | ok | s | notes |", "|---|---|---|---|"]
    for s in data["stages"]:
        r = s.get("result") or {}
        note = s.get("error", "")
        if "skipped" in s:
            lines.append(f"| {s['stage']} | skipped | – | {s['skipped']} |")
            continue
        if "metrics" in r:
            m = r["metrics"]
            note = (f"{r['attention']}, ps {r['page_size']}, {r['workload']['steps']} steps, "
                    f"{r['workload']['lane_steps']} lane-steps; max |test - twin| FULL "
                    f"{_num(m['test_vs_twin_full_abs']['max'])} SWA "
                    f"{_num(m['test_vs_twin_swa_abs']['max'])}; control detected on "
                    f"{r['control_steps_detected']} steps; "
                    f"{len(r['failures'])} failed checks")
        elif "check_vs_twin" in r:
            note = "; ".join(f"{v} vs twin max excess FULL {_num(c['full']['max_excess'])} SWA "
                             f"{_num(c['swa']['max_excess'])}"
                             for v, c in r["check_vs_twin"].items())
        elif "seconds_compile" in r:
            note = f"{r['seconds_compile']:.1f} s ({r.get('how')})"
        lines.append(f"| {s['stage']} | {s['ok']} | {s['seconds']:.1f} | {note} |")
    timed = [s["result"] for s in data["stages"] if (s.get("result") or {}).get("timed")]
    if timed:
        lines += ["", "GPU us per step (p50, p20-p80): allocator step + page tables + K/V "
                  "write + one FULL and one SWA decode attention, one graph replay", "",
                  "| B | lengths | window | none | Triton paged | FlashInfer | attention: "
                  "Triton / FlashInfer | late steps |", "|---|---|---|---|---|---|---|---|"]
        for r in timed:
            g, att = r["gpu_us_per_step"], r["attention_us_p50"]
            lines.append(
                f"| {r['B']} | {r['lengths'][0]}-{r['lengths'][1]} | {r['window']} "
                f"| {timing.format_quantiles(g.get('none'), 1)} "
                f"| {timing.format_quantiles(g.get('triton'), 1)} "
                f"| {timing.format_quantiles(g.get('flashinfer'), 1)} "
                f"| {att.get('triton', float('nan')):.1f} / "
                f"{att.get('flashinfer', float('nan')):.1f} | {sum(r['late_steps'].values())} |")
    if data["failures"]:
        lines += ["", "## Failures", ""]
        for f in data["failures"]:
            lines.append(f"* {f['stage']}: {f['error']}" +
                         (f" (phase: {f['phase']})" if "phase" in f else ""))
    return "\n".join(lines) + "\n"


def _num(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _json_default(o):
    if isinstance(o, np.integer | np.floating):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, float) and math.isnan(o):
        return None
    return str(o)


# ---- entry point ---------------------------------------------------------------------------
def import_flashinfer():
    """FlashInfer, imported only here (it is not a dependency of the project)."""
    try:
        return importlib.import_module("flashinfer")
    except ImportError as exc:
        raise ImportError(f"flashinfer not installed (or not importable): "
                          f"{type(exc).__name__}: {exc}") from exc


def prebuild(flashinfer, dtype: torch.dtype, head_dim: int) -> dict:
    """Compile the two decode variants this script uses (no window, window) in one ninja run
    (parallel), before ``plan()`` would compile them one after the other. Internal API:
    any mismatch falls back to the lazy compile in ``plan()``."""
    from flashinfer.jit import gen_batch_decode_module
    from flashinfer.jit.core import build_jit_specs

    specs = [gen_batch_decode_module(dtype, dtype, dtype, torch.int32, head_dim, head_dim,
                                     0, use_window, False) for use_window in (False, True)]
    build_jit_specs(specs, verbose=False)
    return {"how": "flashinfer.jit.core.build_jit_specs (both variants, one ninja run)",
            "modules": [s.name for s in specs]}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--device", default="auto", choices=["auto", "cuda", "cpu"])
    ap.add_argument("--attention", default="auto",
                    choices=["auto", "flashinfer", "triton", "torch"],
                    help="attention under test in the correctness runs (auto: FlashInfer on "
                         "CUDA when it imports, else the Triton kernel; the twin on a CPU)")
    ap.add_argument("--page-sizes", type=int, nargs="+", default=[16, 1])
    ap.add_argument("--max-batch", type=int, default=16, help="attention lanes")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 160], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[8, 64], metavar=("MIN", "MAX"))
    ap.add_argument("--chunk", type=int, default=96, help="prefill tokens per request per step")
    ap.add_argument("--window", type=int, default=32,
                    help="the model's sliding window W (FlashInfer window_left = W - 1)")
    ap.add_argument("--share-tokens", type=int, default=48,
                    help="shared-prefix length (whole pages of every page size; 0: off)")
    ap.add_argument("--share-prob", type=float, default=0.4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    ap.add_argument("--atol", type=float, default=2e-3)
    ap.add_argument("--rtol", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-graph", action="store_true", help="run the step body eagerly")
    ap.add_argument("--no-sync-debug", action="store_true")
    ap.add_argument("--no-triton", action="store_true",
                    help="leave the Triton kernel out of the FlashInfer graphs")
    ap.add_argument("--no-prebuild", action="store_true",
                    help="let plan() JIT-compile each variant on first use")
    ap.add_argument("--pdl", default="auto", choices=["auto", "on", "off"],
                    help="FlashInfer run(enable_pdl=...); auto: FlashInfer's default")
    ap.add_argument("--timing-batches", type=int, nargs="*", default=[1, 64, 256])
    ap.add_argument("--timing-len", type=int, nargs=2, default=[1024, 2048])
    ap.add_argument("--timing-window", type=int, default=512)
    ap.add_argument("--timing-page-size", type=int, default=16)
    ap.add_argument("--timing-steps", type=int, default=60, help="timed steps per variant")
    ap.add_argument("--timing-warmup", type=int, default=10)
    ap.add_argument("--timing-sleep-us", type=float, default=2000.0,
                    help="GPU busy time queued before each timed step (covers host planning)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--out", default=str(RESULTS / "flashinfer-tables"),
                    help="directory for flashinfer_tables.{json,md}; '' writes nothing")
    add_stamp_option(ap)
    args = ap.parse_args(argv)
    args.pdl_flag = {"auto": None, "on": True, "off": False}[args.pdl]
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    stamp_or_exit(args.out, __file__, argv, allow_dirty=args.allow_dirty)
    device = timing.pick_device(args.device)
    cfg = {"args": {k: v for k, v in vars(args).items()}, "device": str(device)}
    report = Report(args.out, cfg)
    with report.stage("environment") as rec:
        cfg["machine"] = timing.machine_info(device)
        rec["result"] = {"device": str(device), "torch": torch.__version__,
                         "cuda": torch.version.cuda}
    fi = None
    is_cuda = device.type == "cuda"
    if is_cuda:  # on a GPU FlashInfer is what this script is for: missing, it fails
        with report.stage("import flashinfer") as rec:
            fi = import_flashinfer()
            cfg["flashinfer_version"] = getattr(fi, "__version__", "unknown")
            rec["result"] = {"version": cfg["flashinfer_version"],
                             "path": getattr(fi, "__file__", None)}
    else:  # FlashInfer runs on CUDA only: its part is skipped here, the rest runs
        report.skip("FlashInfer (GPU-only)", f"the device is {device}: FlashInfer's decode "
                    "runs on CUDA only; the workload and the tables are checked with the "
                    "Torch twin as the attention")
    usable = fi if is_cuda else None
    if usable is not None and not args.no_prebuild:
        with report.stage("JIT compile (decode, window and no window)") as rec:
            t0 = time.perf_counter()
            try:
                info = prebuild(usable, DTYPES[args.dtype], args.head_dim)
            except (ImportError, AttributeError, TypeError) as exc:
                # the internal API moved: plan() compiles lazily instead (a compile error
                # raises anything else and fails this stage)
                info = {"how": f"lazy in plan() (prebuild unavailable: {type(exc).__name__}: "
                               f"{exc})"}
            rec["result"] = {**info, "seconds_compile": time.perf_counter() - t0}
    attention = args.attention
    if attention == "auto":
        attention = "flashinfer" if usable is not None else ("triton" if is_cuda else "torch")
    if attention == "flashinfer" and usable is None:
        with report.stage("correctness with FlashInfer") as rec:
            raise RuntimeError("--attention flashinfer, but FlashInfer is not usable here "
                               "(see the import stage)")
    else:
        for ps in args.page_sizes:
            holder: dict = {}
            with report.stage(f"correctness ps={ps} attention={attention}",
                              phase_of=lambda h=holder: h.get("run", None) and h["run"].phase
                              or "setup") as rec:
                holder["run"] = CorrectnessRun(args, page_size=ps, device=device,
                                               attention=attention, flashinfer=usable)
                result = holder["run"].run()
                rec["result"] = result
                rec["ok"] = result["ok"]
                r = result
                print(f"  ps={ps}: {r['workload']['steps']} steps, {r['workload']['lane_steps']}"
                      f" lane-steps, max |test - twin| FULL "
                      f"{r['metrics']['test_vs_twin_full_abs']['max']:.2e} SWA "
                      f"{r['metrics']['test_vs_twin_swa_abs']['max']:.2e}; control detected on "
                      f"{r['control_steps_detected']} steps; failures: {r['failures']}",
                      flush=True)
            holder.clear()
            if is_cuda:
                torch.cuda.empty_cache()
    if args.timing_batches and not is_cuda:
        report.skip("timing", "GPU time needs CUDA")
    elif args.timing_batches:
        raised = [st["stage"] for st in report.data["stages"]
                  if st["stage"].startswith("correctness") and "error" in st]
        if usable is not None and attention == "flashinfer" and raised:
            print(f"  timing without FlashInfer: {raised} raised", flush=True)
            cfg["timing_without_flashinfer"] = f"FlashInfer raised in {raised}"
            usable = None
        for B in args.timing_batches:
            holder = {}
            with report.stage(f"timing B={B}",
                              phase_of=lambda h=holder: h.get("run", None) and h["run"].phase
                              or "setup") as rec:
                holder["run"] = TimingRun(args, B, device, flashinfer=usable)
                result = holder["run"].run()
                rec["result"] = result
                rec["ok"] = result["ok"]
                print(f"  B={B}: GPU us/step p50 " + ", ".join(
                    f"{v} {s['p50']:.1f}" for v, s in result["gpu_us_per_step"].items()),
                      flush=True)
            holder.clear()
            torch.cuda.empty_cache()
    report.write()
    skipped = report.skipped()
    if not report.data["ok"]:
        print("FAILED: " + "; ".join(f"{f['stage']}: {f['error']}"
                                     for f in report.data["failures"]), flush=True)
    elif skipped:
        print("OK: every stage that runs here passed; skipped on this machine: "
              + "; ".join(skipped), flush=True)
    else:
        print("OK: every stage passed", flush=True)
    return report.data


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
