"""A continuous-batching decode loop whose every step is ONE captured CUDA graph.

The graph of a step, captured once per descriptor buffer ``i`` of the allocator
(``len(alloc.ring)`` graphs, sharing one memory pool)::

    alloc.launch(i)                        releases, window evictions, decode allocation
    lane_buf <- lane_host_bufs[i]          this step's per-lane inputs (pinned, 7 x B int64)
    full/swa slot of lane b = alloc out_*_buf[lane OUT[b]]   (sink 0 for padded lanes)
    logits = model(tokens_buf, ...)        writes the new K/V, reads K/V through the tables
    tokens_buf <- argmax(logits)           the next step's input, never read by the host
    history_buf[SERIAL, GEN] <- tokens     (and logits_buf): read once, after the loop

Per step the host, from host-side lengths only: ``p = alloc.plan(release=...,
evict_all=True, decode=rows)``, fills ``lane_host_bufs[p.buffer_index]``, replays graph
``p.buffer_index`` and calls ``alloc.mark_submitted(p)``. The event the allocator
records there also guards ``lane_host_bufs[i]``: ``plan()`` hands out buffer ``i``
again only after the replay that read it has finished.

Batch lanes and allocator output lanes. The model runs a fixed batch of
``max_batch`` lanes. A request keeps its lane from admission to finish; a free
lane is padded (VALID 0, writes go to the sink slot 0, the history to a scratch
row). ``plan(decode=rows)`` numbers its output lanes in the order of ``rows``,
which the host passes in increasing batch-lane order, so the k-th occupied
lane's new slots are ``out_full_buf[k]`` / ``out_swa_buf[k]``: the host writes k
into ``OUT[b]``. When requests finish and others are admitted the ranks shift,
and ``OUT`` follows; nothing on the device moves.

Admission (a new request's prefill) runs eagerly between replays: one allocator
step for the prompts (``alloc.step(extend=...)``), then one forward per prompt,
whose argmax is written into ``tokens_buf[lane]`` on the device. Requests stop
at a fixed output length (known on the host); stopping on EOS would need a read
of the sampled tokens each step.

On a CPU (or with ``graph=False``) the same step body runs eagerly.

Attention through the page tables (``attention="tables"``). The allocator is built with
``page_tables=decode_tables_spec(max_batch, W)`` (``forms=("csr",)``, FULL and SWA layers):
every step it plans also writes the CSR page tables of its batch into ``alloc.tables``,
inside the same replay, after its allocations. The batch of a decode step is its decode rows
in the order given -- the occupied model lanes in increasing lane order -- so the k-th
occupied lane is table lane k (as it is output lane k), and the model's ``B`` query lanes
are put in table order by one gather (``PERM``: table lane k <- model lane PERM[k]) and
their outputs back by another (``OUT``). The graph of descriptor buffer ``i`` becomes::

    alloc.launch(i)                        releases, window evictions, decode allocation,
                                           then kv_indptr / kv_indices / kv_last_page_len
                                           of the step's lanes, FULL and SWA
    lane_buf <- lane_host_bufs[i];  new K/V slots as above
    logits = model(tokens_buf, ...)        writes the new K/V by slot, then every attention
                                           layer reads K/V ONLY through the CSR tables of
                                           its kind (TableAttention): FULL layers the pages
                                           of [0, L), SWA layers those of [S, L) with
                                           positions below L - W masked
    tokens_buf <- argmax(logits); history  as above

then ``alloc.mark_submitted(p)``. The attention is the paged Triton kernel on a GPU and its
Torch twin on a CPU (both read only the tables; ``graphalloc.kernels.paged_attention``). W
is the model's window (the spec's ``model_window``): a query at ``L - 1`` reads positions
``>= L - W``, which the allocator (window ``W - 1``, evaluated on the length before the
step) never frees. The prefill still attends by gather (``attention="gather"``: every layer
gathers slots from ``req_to_token`` / ``full_to_swa`` as before); its steps write tables
too (their batch: the prompts), which nothing reads.

FlashInfer (``attention="flashinfer"``, CUDA, float16 or bfloat16: FlashInfer's decode has
no float32 kernels). The same tables and the same graph, with FlashInfer's paged decode as
the attention (:class:`FlashInferAttention`): one FULL and one SWA
``BatchDecodeWithPagedKVCacheWrapper`` per descriptor buffer, built ONCE with
``use_cuda_graph=True`` on ``alloc.tables``' own ``kv_indptr`` / ``kv_indices`` /
``kv_last_page_len`` buffers (``flashinfer_tables.FlashInferDecode``, the GPU-checked
construction). Right after ``alloc.plan(...)`` the host plans pair ``p.buffer_index`` from
the step's pinned host copies ``p.tables`` (FlashInfer's host plan, async copies only, no
sync); the graph runs FULL layers through the FULL wrapper (``window_left=-1``) and SWA
layers through the SWA wrapper (``window_left = W - 1``), every layer over its own NHD cache
view ``[num_pages + 1, ps, Hkv, D]``. Pair i is planned only when the allocator hands out
buffer i again, i.e. after the replay that read its previous plan has finished (the ring's
event), so FlashInfer's one pinned work-partition buffer per wrapper is never rewritten
while its copy is still queued. The warm-up before capture runs a plan and a ``run()`` of
every pair (JIT compile, FlashInfer's cached buffers) outside the captured region.

A shared system prompt (``shared_prefix``, the allocator built with ``prefix_cache=True``):
the first request carrying it prefills it and ``alloc.prefix_cache.insert(row, prefix)``
takes a handle on its whole pages; every later carrier gets ``m = cache.match(prompt)``,
``alloc.admit(handle=m.handle, n_tokens=m.cached_tokens)`` (its ``req_to_token`` prefix
copied on the device) and prefills only positions ``>= m.cached_tokens``: queries over the
new tokens, keys over ``[0, n)`` through ``req_to_token`` / ``full_to_swa``, the cached
positions' K/V read from the shared pages.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import numpy as np
import torch
from hybrid_model import FULL, SLIDING, PagedKV, TinyHybridLM

import graphalloc as ga
from graphalloc.kernels import paged_decode_attention, paged_decode_attention_torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from timing import StepEvents, graph_nodes  # noqa: E402

__all__ = ["Request", "DecodeLoop", "LoopResult", "TableAttention", "FlashInferAttention",
           "FLASHINFER_HEAD_DIMS", "decode_tables_spec", "swa_max_pages"]

# head dims FlashInfer's decode kernels are built for
FLASHINFER_HEAD_DIMS = (64, 128, 256)

# rows of the per-step lane input table [N_LANE_FIELDS, max_batch]; OUT is also the lane's
# table lane, PERM[k] the model lane of table lane k (the tables' batch is the step's)
ROW, POS, VALID, OUT, SERIAL, GEN, PERM = range(7)
N_LANE_FIELDS = 7


def decode_tables_spec(max_batch: int, window: int) -> ga.PageTableSpec:
    """The page tables a :class:`DecodeLoop` with ``attention="tables"`` or ``"flashinfer"``
    reads: FlashInfer's CSR form, FULL and SWA layers, ``max_batch`` lanes, the model's
    window ``window`` (W). Pass it as ``HybridAllocator(cfg, page_tables=...)``."""
    return ga.PageTableSpec(max_batch=max_batch, forms=("csr",), layers=("full", "swa"),
                            model_window=window)


def swa_max_pages(tables) -> int:
    """The most SWA pages a DECODE lane's range holds (``ceil(W / ps) + 1``, at most the
    block width): the Torch twin's fixed grid over the SWA CSR."""
    spec, ps = tables.spec, tables.config.page_size
    return min(spec.max_pages_per_req, -(-spec.model_window // ps) + 1)


@dataclasses.dataclass
class Request:
    serial: int
    prompt: np.ndarray  # int64 token ids
    n_out: int  # tokens to generate (the first one comes from the prefill)


class TableAttention:
    """The decode step's attention through the page tables: stands in for a
    ``hybrid_model.KeyTable`` (``attend``), reading nothing but the CSR buffers of
    ``tables`` (``alloc.tables``; FULL layers: FULL tables, no window; SWA layers: SWA
    tables, window ``tables.spec.model_window``). ``attend_fn``: ``paged_decode_attention``
    (Triton) or its Torch twin; the twin's fixed grid is the most pages a lane can hold per
    kind. ``perm`` / ``out_lane`` (``[B]`` device views, updated in place by the loop): table
    lane k attends for model lane ``perm[k]``; model lane b reads table lane
    ``out_lane[b]``."""

    def __init__(self, tables, attend_fn, perm, out_lane):
        spec = tables.spec
        if not (spec.has("csr", "full") and spec.has("csr", "swa")):
            raise ValueError("TableAttention needs the CSR form for both layer kinds")
        self.tables, self.attend_fn = tables, attend_fn
        self.page_size, self.window = tables.config.page_size, spec.model_window
        self.max_pages = {"full": spec.max_pages_per_req, "swa": swa_max_pages(tables)}
        self.perm, self.out_lane = perm, out_lane

    def attend(self, kind: str, q, cache_k, cache_v, n_kv_heads: int):
        """``q`` ``[B, 1, H, D]`` (the decode token of each model lane) over one layer's
        slot-indexed caches ``[n_slots, Hkv, D]``, viewed as pages: ``[B, 1, H * D]``."""
        t = self.tables
        B, n_q, H, D = q.shape
        if n_q != 1:
            raise ValueError(f"TableAttention is decode attention (one query per lane), got "
                             f"{n_q}")
        ps = self.page_size
        k_pages = cache_k.view(-1, ps, n_kv_heads, D)
        v_pages = cache_v.view(-1, ps, n_kv_heads, D)
        if kind == FULL:
            csr = (t.full_kv_indptr_buf, t.full_kv_indices_buf, t.full_kv_last_page_len_buf)
            window, max_pages = 0, self.max_pages["full"]
        else:
            csr = (t.swa_kv_indptr_buf, t.swa_kv_indices_buf, t.swa_kv_last_page_len_buf)
            window, max_pages = self.window, self.max_pages["swa"]
        out = self.attend_fn(q[:, 0].index_select(0, self.perm), k_pages, v_pages, *csr,
                             sliding_window=window, max_pages=max_pages)
        return out.index_select(0, self.out_lane).reshape(B, 1, H * D)


class FlashInferAttention:
    """The decode step's attention through FlashInfer's paged decode, over the same CSR
    page tables as :class:`TableAttention` (stands in for a ``hybrid_model.KeyTable``).

    ``flashinfer_tables.FlashInferDecode`` holds one FULL + SWA
    ``BatchDecodeWithPagedKVCacheWrapper`` pair per descriptor buffer, built once with
    ``use_cuda_graph=True`` on ``alloc.tables``' own indptr / indices / last-page-length
    buffers and sharing one 128 MiB float workspace. :meth:`plan` (host, per step:
    FlashInfer's C++ plan over the step's pinned host copies, async copies only) plans pair
    ``i``; :meth:`attend` runs pair :attr:`index` (set by the loop before it runs or
    captures the step of descriptor buffer ``index``) on one layer's cache, capture-safe.
    ``flashinfer``: the imported module. SWA window ``tables.spec.model_window``
    (``window_left = W - 1``). ``perm`` / ``out_lane``: as :class:`TableAttention`.
    """

    def __init__(self, flashinfer, tables, n_ring: int, *, num_qo_heads: int,
                 num_kv_heads: int, head_dim: int, dtype: torch.dtype, perm, out_lane):
        from flashinfer_tables import FlashInferDecode
        spec = tables.spec
        if not (spec.has("csr", "full") and spec.has("csr", "swa")):
            raise ValueError("FlashInferAttention needs the CSR form for both layer kinds")
        self.tables, self.page_size = tables, tables.config.page_size
        self.window = spec.model_window
        self.decode = FlashInferDecode(flashinfer, tables, n_ring, num_qo_heads=num_qo_heads,
                                       num_kv_heads=num_kv_heads, head_dim=head_dim,
                                       dtype=dtype)
        self.index = 0
        self.perm, self.out_lane = perm, out_lane
        # one output per layer kind (layers of a kind run one after the other in the stream)
        self.outs = {kind: torch.zeros(spec.max_batch, num_qo_heads, head_dim, dtype=dtype,
                                       device=tables.config.device) for kind in (FULL, SLIDING)}

    def plan(self, i: int, planned) -> None:
        """Plan pair ``i`` for the step whose tables ``planned`` (``p.tables``) describes
        (host only)."""
        self.decode.plan(i, planned)

    def attend(self, kind: str, q, cache_k, cache_v, n_kv_heads: int):
        """``q`` ``[B, 1, H, D]`` over one layer's slot-indexed caches ``[n_slots, Hkv, D]``
        viewed as NHD pages ``[n_slots / ps, ps, Hkv, D]``: ``[B, 1, H * D]``."""
        B, n_q, H, D = q.shape
        if n_q != 1:
            raise ValueError(f"FlashInferAttention is decode attention (one query per lane), "
                             f"got {n_q}")
        ps = self.page_size
        kv = (cache_k.view(-1, ps, n_kv_heads, D), cache_v.view(-1, ps, n_kv_heads, D))
        full, swa = self.decode.pairs[self.index]
        run_kwargs = self.decode.run_kwargs
        q_tab = q[:, 0].index_select(0, self.perm)  # table lane order
        if kind == FULL:
            out = self.outs[FULL]
            full.run(q_tab, kv, out=out, **run_kwargs)
        else:
            out = self.outs[SLIDING]
            swa.run(q_tab, kv, out=out, window_left=self.window - 1, **run_kwargs)
        return out.index_select(0, self.out_lane).reshape(B, 1, H * D)


@dataclasses.dataclass
class LoopResult:
    tokens: dict[int, list[int]]  # serial -> generated tokens
    logits: dict[int, np.ndarray] | None  # serial -> [n_out, vocab]
    steps: list[dict]  # per decode step, host-side numbers
    wall_s: float
    host_step_s: list[float]  # plan (+ FlashInfer's plan) + fill + replay + mark_submitted
    host_launch_s: list[float]  # fill + (eager allocator launch) + replay + mark_submitted
    prefill_s: float
    ring_stalls: int
    graph_nodes: dict | None = None
    gpu_step_us: list[float] = dataclasses.field(default_factory=list)  # time_steps on CUDA
    prefill_pages: dict | None = None  # pages allocated by the prefill steps
    sharing: dict | None = None  # with a shared prefix: what the prefix cache saved


def capture_step_graphs(alloc, body, empty_step) -> list:
    """Warm up on a side stream with ``2 x len(alloc.ring)`` calls of ``empty_step()`` (an
    empty planned step through ``body``: every kernel variant compiled, nothing changed),
    then capture ``body(i)`` as one graph per descriptor buffer ``i``, in one memory pool.
    One-time set-up: it synchronises."""
    torch.cuda.synchronize()  # sync ok: one-time set-up
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2 * len(alloc.ring)):
            empty_step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()  # sync ok: one-time set-up
    graphs, pool = [], None
    for i in range(len(alloc.ring)):
        g = ga.capture_graph(lambda i=i: body(i), pool=pool)
        pool = g.pool()
        graphs.append(g)
    torch.cuda.synchronize()  # sync ok: one-time set-up
    return graphs


class DecodeLoop:
    """Runs ``requests`` through ``model`` with KV paged by ``alloc``.

    Args:
        model: the decoder (its caches are sized from ``alloc.config``).
        alloc: a fresh :class:`graphalloc.HybridAllocator` (no live requests).
        max_batch: decode lanes of the fixed-shape step.
        n_serials: requests over the whole run (rows of the history buffers).
        max_out: most tokens one request generates.
        graph: capture each step into a CUDA graph (needs a CUDA allocator).
        alloc_in_graph: with ``graph``, put the allocator's step inside the model's
            graph (the point of graphalloc); ``False`` launches it eagerly before each
            replay of a model-only graph (the way engines do it today).
        keep_logits: also record every step's logits (for comparison).
        time_steps: record CUDA events around each decode step's launches (the eager
            allocator step, if any, and the replay; not planning or lane filling): GPU time
            per step (``timing.StepEvents``).
        attention: ``"gather"`` (decode attention gathers slots through ``req_to_token`` /
            ``full_to_swa``), ``"tables"`` (through the page tables the allocator writes in
            the step: ``alloc`` built with ``page_tables=decode_tables_spec(max_batch, W)``;
            see the module docstring) or ``"flashinfer"`` (FlashInfer's paged decode over
            the same tables: CUDA, a float16 / bfloat16 model, head dim 64, 128 or 256;
            FlashInfer is imported here, ImportError if it is not installed). The window W
            of the SWA tables and of the attention mask (a query at ``L - 1`` reads
            positions ``>= L - W``) is the spec's ``model_window`` (a smaller one than the
            model's must change tokens).
        attention_backend: with ``"tables"``, ``"triton"`` (the paged kernel), ``"torch"``
            (its twin) or ``"auto"``: Triton on CUDA, the twin on a CPU.
        shared_prefix: token ids of a system prompt served from ``alloc.prefix_cache``
            (the allocator built with ``prefix_cache=True``): the first request whose
            prompt starts with it prefills it and inserts it into the cache; every later
            one is admitted on the cached handle (``admit(handle=, n_tokens=)``) and
            prefills only its positions ``>= cached_tokens``, attending over the shared
            KV through ``req_to_token``. ``None``: no sharing.
        flashinfer: with ``"flashinfer"``, the module whose
            ``BatchDecodeWithPagedKVCacheWrapper`` is used; ``None`` (default) imports
            FlashInfer and requires a CUDA allocator. A stand-in with the same wrapper
            contract may be passed (the CPU tests run this path that way).
    """

    def __init__(self, model: TinyHybridLM, alloc: ga.HybridAllocator, *, max_batch: int,
                 n_serials: int, max_out: int, graph: bool = False, alloc_in_graph: bool = True,
                 keep_logits: bool = True, time_steps: bool = False,
                 attention: str = "gather", attention_backend: str = "auto",
                 shared_prefix=None, flashinfer=None):
        acfg, mcfg = alloc.config, model.cfg
        if shared_prefix is not None and alloc.prefix_cache is None:
            raise ValueError("shared_prefix needs an allocator built with prefix_cache=True")
        self.shared_prefix = (None if shared_prefix is None
                              else np.asarray(shared_prefix, dtype=np.int64))
        self._prefix_inserted = False
        self.sharing = None
        if alloc.n_live > 0:
            raise ValueError("DecodeLoop needs a fresh allocator (no live requests)")
        if graph and acfg.device.type != "cuda":
            raise ValueError("graph=True needs an allocator on a CUDA device")
        if max_batch > acfg.max_alloc_rows or max_batch > acfg.max_step_tokens:
            raise ValueError(f"max_batch {max_batch} exceeds the allocator's frozen "
                             f"max_alloc_rows {acfg.max_alloc_rows} / max_step_tokens "
                             f"{acfg.max_step_tokens}")
        self.model, self.alloc, self.max_batch = model, alloc, max_batch
        self.graph, self.alloc_in_graph = graph, alloc_in_graph
        self.time_steps = time_steps and acfg.device.type == "cuda"
        dev = acfg.device
        self.device = dev
        self.kv = PagedKV(mcfg, acfg.num_full_slots, (acfg.num_swa_pages + 1) * acfg.page_size,
                          dev, dtype=getattr(model, "dtype", torch.float32))
        self.n_serials = n_serials
        # *_buf(s): allocated once, updated in place only (a captured graph holds their addresses)
        self.tokens_buf = torch.zeros(max_batch, dtype=torch.int64, device=dev)
        self.lane_buf = torch.zeros(N_LANE_FIELDS, max_batch, dtype=torch.int64, device=dev)
        pin = dev.type == "cuda"
        self.lane_host_bufs = [  # one per descriptor buffer, guarded by the same event
            torch.zeros(N_LANE_FIELDS, max_batch, dtype=torch.int64, pin_memory=pin)
            for _ in range(len(alloc.ring))]
        self.lane_np = [t.numpy() for t in self.lane_host_bufs]
        self.history_buf = torch.zeros(n_serials + 1, max_out, dtype=torch.int64, device=dev)
        self.logits_buf = (torch.zeros(n_serials + 1, max_out, mcfg.vocab_size, device=dev)
                           if keep_logits else None)
        self.arange_ctx = torch.arange(acfg.max_context_len, device=dev)
        self.graphs: list = []
        if attention not in ("gather", "tables", "flashinfer"):
            raise ValueError(f"attention must be 'gather', 'tables' or 'flashinfer', got "
                             f"{attention!r}")
        if attention == "flashinfer":  # imported only in this mode
            if flashinfer is None:
                from flashinfer_tables import import_flashinfer
                flashinfer = import_flashinfer()
                if dev.type != "cuda":
                    raise ValueError(f"attention='flashinfer' needs a CUDA allocator "
                                     f"(FlashInfer runs on CUDA only), got {dev}")
            mdtype = getattr(model, "dtype", torch.float32)
            if mdtype not in (torch.float16, torch.bfloat16):
                raise ValueError(f"attention='flashinfer' needs a float16 or bfloat16 model "
                                 f"(FlashInfer's decode has no float32 kernels), got {mdtype}")
            if mcfg.head_dim not in FLASHINFER_HEAD_DIMS:
                raise ValueError(f"attention='flashinfer' needs head_dim in "
                                 f"{FLASHINFER_HEAD_DIMS}, got {mcfg.head_dim}")
        if attention_backend not in ("auto", "triton", "torch"):
            raise ValueError(f"attention_backend must be 'auto', 'triton' or 'torch', got "
                             f"{attention_backend!r}")
        self.attention = attention
        self.tables = None  # alloc.tables, read by the attention of the table modes
        self.table_attention: TableAttention | None = None
        self.flashinfer_attention: FlashInferAttention | None = None
        if attention in ("tables", "flashinfer"):
            t = alloc.tables
            if t is None or not (t.spec.has("csr", "full") and t.spec.has("csr", "swa")):
                raise ValueError(f"attention={attention!r} reads the page tables of each step: "
                                 "build the allocator with page_tables=decode_tables_spec("
                                 "max_batch, window) (CSR, FULL and SWA layers)")
            if t.spec.max_batch != max_batch:
                raise ValueError(f"the allocator's page tables have {t.spec.max_batch} lanes, "
                                 f"the loop {max_batch}: build them with "
                                 f"decode_tables_spec({max_batch}, window)")
            self.tables = t
            perm, out_lane = self.lane_buf[PERM], self.lane_buf[OUT]  # views, updated in place
            if attention == "flashinfer":
                attention_backend = "flashinfer"
                self.flashinfer_attention = FlashInferAttention(
                    flashinfer, t, len(alloc.ring), num_qo_heads=mcfg.num_heads,
                    num_kv_heads=mcfg.num_kv_heads, head_dim=mcfg.head_dim,
                    dtype=model.dtype, perm=perm, out_lane=out_lane)
            else:
                if attention_backend == "auto":
                    attention_backend = "triton" if dev.type == "cuda" else "torch"
                fn = (paged_decode_attention if attention_backend == "triton"
                      else paged_decode_attention_torch)
                self.table_attention = TableAttention(t, fn, perm, out_lane)
        self.attention_backend = attention_backend if attention != "gather" else None

    # ---- the step body (captured) -------------------------------------------------------
    def _body(self, i: int) -> None:
        if self.alloc_in_graph:
            self._launch_alloc(i)
        self._model_step(i)

    def _launch_alloc(self, i: int) -> None:
        """The allocator's step (with the page tables of its batch, when it writes them)."""
        self.alloc.launch(i)

    def _model_step(self, i: int) -> None:
        alloc, model = self.alloc, self.model
        self.lane_buf.copy_(self.lane_host_bufs[i], non_blocking=True)
        rows, pos, valid, out = (self.lane_buf[f] for f in (ROW, POS, VALID, OUT))
        serial, gen = self.lane_buf[SERIAL], self.lane_buf[GEN]
        ok = valid != 0
        full_slot = torch.where(ok, alloc.state.out_full_buf[out].long(), 0)
        swa_slot = torch.where(ok, alloc.state.out_swa_buf[out].long(), 0)
        if self.table_attention is not None:
            keys = self.table_attention  # reads only the page tables written in the step
        elif self.flashinfer_attention is not None:
            keys = self.flashinfer_attention  # pair i, planned with this step's tables
            keys.index = i
        else:
            r2t = alloc.req_to_token[rows].long()
            keys = model.key_table(r2t, alloc.full_to_swa.long(), pos[:, None],
                                   alloc.config.max_context_len, swa_window_keys=True)
        logits = model.forward(self.tokens_buf[:, None], pos[:, None], keys, full_slot[:, None],
                               swa_slot[:, None], self.kv)[:, 0]
        nxt = torch.argmax(logits, dim=-1)
        self.tokens_buf.copy_(nxt)
        self.history_buf[serial, gen] = nxt
        if self.logits_buf is not None:
            self.logits_buf[serial, gen] = logits.float()  # exact: every half value is a float32

    def capture(self) -> None:
        """Warm up and capture one graph per descriptor buffer. Call before any request."""
        alloc = self.alloc

        def empty_step() -> None:  # every row and lane padded
            p = alloc.plan()
            self._plan_attention(p)
            self._fill_lanes(p.buffer_index, [], [])
            self._body(p.buffer_index)
            alloc.mark_submitted(p)
        self.graphs.extend(capture_step_graphs(alloc, self._body, empty_step))

    def describe(self) -> dict | None:
        """Node counts of the first step graph (``timing.graph_nodes``); None before capture."""
        return graph_nodes(self.graphs[0]) if self.graphs else None

    # ---- host side ----------------------------------------------------------------------
    def _plan_attention(self, p) -> None:
        """FlashInfer's host plan of pair ``p.buffer_index`` from the step's pinned host
        copies (its last use has run: the allocator handed that buffer out again)."""
        if self.flashinfer_attention is not None:
            self.flashinfer_attention.plan(p.buffer_index, p.tables)

    def _clipped_lanes(self, rows: list[int]) -> int | None:
        """Decode lanes whose SWA range starts at the frontier, past the window
        (``f > L - W``: keys the window wants are gone); None without tables."""
        if self.tables is None or not rows:
            return None if self.tables is None else 0
        r = np.asarray(rows)
        L, f = self.alloc.seq_lens()[r], self.alloc.frontiers()[r]
        return int((f > np.maximum(L - self.tables.spec.model_window, 0)).sum())

    def _fill_lanes(self, i: int, lanes: list[int], reqs: list) -> None:
        """Lane inputs of one step into pinned buffer ``i`` (host memory only)."""
        t = self.lane_np[i]
        t[:] = 0
        t[SERIAL] = self.n_serials  # padded lanes record into the scratch row
        for k, (b, st) in enumerate(zip(lanes, reqs, strict=True)):
            t[ROW, b], t[POS, b], t[VALID, b] = st["row"], st["len"], 1
            t[OUT, b], t[SERIAL, b], t[GEN, b] = k, st["serial"], st["n_gen"]
            t[PERM, k] = b  # table lane k (the k-th decode row) attends for model lane b

    def _admit(self, new: list[tuple[int, Request]], state: dict) -> None:
        """Prefill ``(lane, request)`` pairs eagerly: one allocator step, one forward each.
        The first request carrying the shared prefix ends its chunk (its prefill inserts
        the prefix into the cache, so the requests after it can share it)."""
        cap = self.alloc.config.max_step_tokens
        chunk: list = []
        for lane, req in new:  # as few allocator steps as the frozen step size allows
            if chunk and sum(len(r.prompt) for _, r in chunk) + len(req.prompt) > cap:
                self._prefill(chunk, state)
                chunk = []
            chunk.append((lane, req))
            if not self._prefix_inserted and self._carries_prefix(req):
                self._prefill(chunk, state)
                chunk = []
        if chunk:
            self._prefill(chunk, state)

    def _carries_prefix(self, req: Request) -> bool:
        pre = self.shared_prefix
        return (pre is not None and len(req.prompt) > len(pre)
                and bool((req.prompt[:len(pre)] == pre).all()))

    def _match(self, req: Request) -> tuple[int, int | None]:
        """Tokens of ``req``'s prompt to share from the prefix cache, and the handle (host
        only). At least the last prompt token is always computed (its logits)."""
        if not (self._prefix_inserted and self._carries_prefix(req)):
            return 0, None
        ps = self.alloc.config.page_size
        m = self.alloc.prefix_cache.match(req.prompt)
        c = min(m.cached_tokens, (len(req.prompt) - 1) // ps * ps)
        return (c, m.handle) if c > 0 else (0, None)

    def _prefill(self, new: list[tuple[int, Request]], state: dict) -> None:
        alloc, model = self.alloc, self.model
        rows, cached = [], []
        for _, req in new:  # a hit: admitted on the handle (one step), sharing c tokens
            c, h = self._match(req)
            rows.append(alloc.admit(handle=h, n_tokens=c) if c else alloc.admit())
            cached.append(c)
        p = alloc.plan(extend=(rows, [len(r.prompt) - c
                                      for (_, r), c in zip(new, cached, strict=True)]))
        res = alloc.run(p)
        for k in self.prefill_pages:
            self.prefill_pages[k] += p.pages_allocated[k]
        for k, ((lane, req), row) in enumerate(zip(new, rows, strict=True)):
            n, c = len(req.prompt), cached[k]
            full, swa = res.slots_of(k)  # slots of the new positions [c, n) only
            q_pos = self.arange_ctx[c:n][None]  # queries: the new positions; keys: [0, n)
            keys = model.key_table(alloc.req_to_token[row:row + 1].long(),
                                   alloc.full_to_swa.long(), q_pos, n, swa_window_keys=False)
            logits = model.forward(self.prompts_dev[req.serial:req.serial + 1, c:n], q_pos,
                                   keys, full[None].long(), swa[None].long(), self.kv)[0, -1]
            nxt = torch.argmax(logits)
            self.tokens_buf[lane] = nxt
            self.history_buf[req.serial, 0] = nxt
            if self.logits_buf is not None:
                self.logits_buf[req.serial, 0] = logits.float()
            state[lane] = {"row": row, "len": n, "serial": req.serial, "n_gen": 1,
                           "n_out": req.n_out}
        if self.shared_prefix is None:
            return
        ps, sh = alloc.config.page_size, self.sharing
        for c in cached:
            if c:
                sh["requests_sharing"] += 1
                sh["prefill_tokens_saved"] += c
                for kind in ("full", "swa"):  # pages the sharer did not allocate
                    sh["pages_saved"][kind] += c // ps
        sh["prefill_tokens_computed"] += sum(len(r.prompt) - c
                                             for (_, r), c in zip(new, cached, strict=True))
        for (_, req), row in zip(new, rows, strict=True):
            if not self._prefix_inserted and self._carries_prefix(req):
                # its prompt's whole pages hold the prefix now: a handle on them (one step)
                sh["cached_prefix_tokens"] = alloc.prefix_cache.insert(row, self.shared_prefix)
                self._prefix_inserted = True

    def _free_pages_ok(self, prompts: list[int], n_active: int) -> bool:
        ps, st = self.alloc.config.page_size, self.alloc.stats()
        need = sum(-(-n // ps) + 1 for n in prompts) + n_active
        return need <= min(st["full_free_pages"], st["swa_free_pages"])

    def run(self, requests: list[Request], *, progress=None, sync_debug: bool = False
            ) -> LoopResult:
        """Serve every request to its output length; read tokens back once at the end.

        ``sync_debug``: run the loop under ``torch.cuda.set_sync_debug_mode("error")``,
        so any host/device synchronisation inside it raises (CUDA only).
        """
        max_prompt = max(len(r.prompt) for r in requests)
        prompts = np.zeros((self.n_serials, max_prompt), dtype=np.int64)
        for r in requests:
            prompts[r.serial, :len(r.prompt)] = r.prompt
        self.prompts_dev = torch.from_numpy(prompts).to(self.device)  # before the loop
        stalls0 = self.alloc.ring.stalls
        self.prefill_pages = {"full": 0, "swa": 0}
        if self.shared_prefix is not None:
            self._prefix_inserted = False
            self.sharing = {"prefix_tokens": len(self.shared_prefix), "cached_prefix_tokens": 0,
                            "requests_carrying": sum(self._carries_prefix(r) for r in requests),
                            "requests_sharing": 0, "prefill_tokens_saved": 0,
                            "prefill_tokens_computed": 0,
                            "pages_saved": {"full": 0, "swa": 0}}
        debug = sync_debug and self.device.type == "cuda"
        if debug:
            old_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        t_start = time.perf_counter()
        try:
            steps, host_s, launch_s, prefill_s, events = self._loop(list(requests), progress)
        finally:
            if debug:
                torch.cuda.set_sync_debug_mode(old_mode)
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # sync ok: after the loop
        wall = time.perf_counter() - t_start
        hist = self.history_buf.cpu().numpy()  # the one read of sampled tokens
        tokens = {r.serial: hist[r.serial, :r.n_out].tolist() for r in requests}
        logits = None
        if self.logits_buf is not None:
            lg = self.logits_buf.cpu().numpy()
            logits = {r.serial: lg[r.serial, :r.n_out] for r in requests}
        return LoopResult(tokens, logits, steps, wall, host_s, launch_s, prefill_s,
                          self.alloc.ring.stalls - stalls0, self.describe(), events.us(),
                          dict(self.prefill_pages),
                          None if self.sharing is None else dict(self.sharing))

    def _loop(self, queue: list[Request], progress
              ) -> tuple[list, list, list, float, StepEvents]:
        alloc, B = self.alloc, self.max_batch
        state: dict[int, dict] = {}  # lane -> request state (host)
        to_release: list[int] = []
        steps, host_s, launch_s, prefill_s = [], [], [], 0.0
        events = StepEvents(self.time_steps)
        while queue or state or to_release:
            # 1. lanes of finished requests free up; their rows are released in this step
            for lane in [b for b, st in state.items() if st["n_gen"] >= st["n_out"]]:
                to_release.append(state.pop(lane)["row"])
            # 2. admit into free lanes while rows and pages allow (eager prefill)
            free_lanes = [b for b in range(B) if b not in state]
            n_rows_free = alloc.config.max_reqs - alloc.n_live
            n_new = min(len(free_lanes), len(queue), n_rows_free)
            while n_new and not self._free_pages_ok([len(r.prompt) for r in queue[:n_new]],
                                                     len(state)):
                n_new -= 1
            if n_new:
                t0 = time.perf_counter()
                self._admit(list(zip(free_lanes[:n_new], queue[:n_new], strict=True)), state)
                del queue[:n_new]
                prefill_s += time.perf_counter() - t0
            # 3. one decode step: releases + evictions + decode allocation + forward + argmax
            lanes = sorted(b for b, st in state.items() if st["n_gen"] < st["n_out"])
            reqs = [state[b] for b in lanes]
            rows = [st["row"] for st in reqs]
            t0 = time.perf_counter()
            p = alloc.plan(release=to_release, evict_all=True, decode=rows)
            self._plan_attention(p)
            t1 = time.perf_counter()  # plan() includes any wait for a descriptor buffer
            self._fill_lanes(p.buffer_index, lanes, reqs)
            with events.interval():  # GPU time: the step's launches only
                if self.graphs:
                    if not self.alloc_in_graph:  # eager allocator step (+ tables), then model
                        self._launch_alloc(p.buffer_index)
                    self.graphs[p.buffer_index].replay()
                else:
                    self._body(p.buffer_index)
            alloc.mark_submitted(p)
            t2 = time.perf_counter()
            host_s.append(t2 - t0)
            launch_s.append(t2 - t1)
            st_now = alloc.stats()
            steps.append({
                "decode": len(rows), "released": len(to_release),
                "swa_pages_evicted": p.pages_evicted,
                "pages_freed": dict(p.pages_freed), "pages_allocated": dict(p.pages_allocated),
                "full_used_pages": st_now["full_used_pages"],
                "swa_used_pages": st_now["swa_used_pages"],
                "live_requests": st_now["live_requests"],
                # lanes whose SWA range was clipped at the frontier (f > L - W): keys the
                # window wants are gone (0 unless the allocator's window is too small)
                "swa_clipped_lanes": self._clipped_lanes(rows),
            })
            to_release = []
            for st in reqs:
                st["len"] += 1
                st["n_gen"] += 1
            if progress is not None:
                progress.update(1)
        return steps, host_s, launch_s, prefill_s, events


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run examples/model_loops/decode_loop.py (and "
            "benchmarks/bench_decode_loop.py) instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
