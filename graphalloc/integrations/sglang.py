"""SGLang's request-level allocator seam, one graphalloc step per scheduler iteration.

SGLang's scheduler (non-overlap event loop) runs, per iteration: form a batch
(``PrefillAdder`` checks ``available_size()``; a decode batch checks it and may
retract), ``ScheduleBatch.prepare_for_extend()`` / ``prepare_for_decode()`` (request
slots, SWA eviction ``_evict_swa``, ``alloc_paged_token_slots_extend`` /
``_decode``), the forward, then ``process_batch_result`` releasing each finished
request with ``release_kv_cache`` between ``free_group_begin()`` and
``free_group_end()``. :class:`SGLangAllocator` takes the same calls on plain objects
with SGLang's attribute names, records the frees and evictions, and runs each
iteration's frees, evictions and allocation as ONE :meth:`HybridAllocator.step`:
the frees of iteration k's results join the allocation step of iteration k+1.

Objects it reads (host values only; SGLang keeps these on the CPU too):

* a request: ``req_pool_idx`` (``None`` until the seam gives it a row; the seam
  writes it, as SGLang's ``ReqToTokenPool.alloc`` does, and sets it back to ``None``
  on release), and ``finished()`` for :meth:`SGLangAllocator.release_finished`;
* an extend batch: ``reqs``, ``prefix_lens`` and ``extend_lens`` (one int per request:
  tokens already in the KV cache, tokens of this chunk);
* a decode batch: ``reqs`` and ``seq_lens_cpu`` (each request's length before the new
  token, i.e. its KV length; the engine increments it after, as SGLang does).

Launches per decode iteration, B requests of which E evict, one free group of F
finished requests, page_size > 1. Before -- SGLang's ``SWATokenToKVPoolAllocator`` over
two ``PagedTokenToKVPoolAllocator``s, counted by reading its public source (one
version; not measured, versions differ): ``alloc_decode`` is about 7 launches (the
last-location gather and its full-to-SWA translation, one Triton allocation kernel
per pool, the mapping scatter, the ``req_to_token`` write); each of the E
``_evict_swa`` calls is a ``free_swa`` of about 10 launches (page expansion, mapping
gather, a boolean filter, the SWA pool's free, the mapping clear) of which three
(two unique-value ops, boolean masking) have data-dependent shapes and wait for the
device; ``free_group_end`` concatenates and frees both pools, about 13 launches and 4
waits, whatever F. About ``20 + 10 E`` launches and ``4 + 3 E`` host/device waits per
iteration.
After: ONE graphalloc step -- one fused kernel (two when the step's pops do not fit in
what was free before it), or one graph replay under ``executor="graph"`` -- and no
host/device synchronisation; an idle iteration's :meth:`SGLangAllocator.flush` is one
release-only step.

Covers: extend batches (prefill, chunked prefill, mixed chunks: any extend lengths),
decode batches, SWA eviction by SGLang's rule (a request's SWA KV below
``floor_page(pre_len - sliding_window)`` is freed; ``pre_len`` = prefix length at an
extend, KV length at a decode) with an eviction interval at decode, release of
finished or retracted requests, the free-group bracket, ``available_size`` and its
FULL/SWA variants, ``translate_loc_from_full_to_swa``; refusal (``None``, nothing
changed) when a pool or the request rows are short.

Does not cover: the prefix cache (SGLang's radix cache / ``SWARadixCache``: the
release is ChunkCache's, i.e. SGLang with ``--disable-radix-cache``; the hook
:meth:`SGLangAllocator.insert_into_prefix_cache` is NOT wired yet and raises),
the overlap scheduler's deferred eviction (evicting with ``pre_len`` one chunk or one
step behind), speculative decoding's multi-token decode allocation, HiCache
load-back, disaggregation, page_size 1 token-level ``alloc(n)``, ring mode.

What an engine must still write: call the seam where SGLang calls its allocator (the
five methods above, in its order); build ``ForwardBatch.out_cache_loc`` from the
returned views (valid until the next step runs) and its attention metadata (e.g.
:class:`graphalloc.page_tables.PageTables`, or gathers of ``alloc.req_to_token``);
write ``ScheduleBatch`` state (``req_pool_indices``, ``seq_lens`` +1 after a decode);
call :meth:`SGLangAllocator.flush` on an idle iteration (no batch) so recorded frees
do not wait for the next batch; ``alloc.check()`` where it synchronises anyway.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from ..allocator import AllocResult, HybridAllocator
from ..errors import ConfigError, ContractError, NestedGroupError, PositionError, TensorSpecError
from .iteration import IterationStep

__all__ = ["SGLangAllocator", "SGLangBatchAlloc"]


def _host_ints(values, n: int, what: str) -> list[int]:
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        raise TensorSpecError(f"{what} is a tensor on {values.device}: reading it would "
                              "synchronise; pass the host copy (SGLang keeps one on the CPU)")
    host = values.tolist() if hasattr(values, "tolist") else values  # host: off the fast path
    out = [int(v) for v in host]
    if len(out) != n:
        raise ContractError(f"{what} has {len(out)} entries for {n} requests")
    return out


@dataclasses.dataclass(eq=False)
class SGLangBatchAlloc:
    """What ``prepare_for_extend`` / ``prepare_for_decode`` allocated.

    ``out_cache_loc`` / ``swa_out_cache_loc``: ``[n_tokens]`` device views of the full /
    SWA slots of the batch's new tokens, request by request in batch order (SGLang's
    ``out_cache_loc`` and ``translate_loc_from_full_to_swa(out_cache_loc)``); valid
    until the next step runs (a later access raises ``StaleResultError``). ``rows``:
    each request's ``req_pool_idx``. ``n_steps``: graphalloc steps this call ran (1;
    more only when the recorded frees exceeded the frozen release shape).
    """

    result: AllocResult
    rows: np.ndarray
    n_steps: int
    n_evicted_pages: int

    @property
    def out_cache_loc(self):
        return self.result.full_slots

    @property
    def swa_out_cache_loc(self):
        return self.result.swa_slots


class SGLangAllocator:
    """SGLang's allocator calls over a pool-mode :class:`HybridAllocator`.

    Args:
        alloc: the allocator (pool mode; ``AllocatorConfig.for_engine`` sizes it).
            Its ``max_reqs`` must cover the running requests plus the requests
            released in one iteration (a released row is reused after its step).
        swa_eviction_interval: tokens (>= 1). At a decode, a request's window is
            evicted once at least this many positions past its frontier have left
            the window (``pre_len - sliding_window >= frontier + interval``), like
            SGLang's ``SGLANG_SWA_EVICTION_INTERVAL``; 1 evicts as soon as a whole
            page has left it. Extends evict at every chunk, as SGLang's chunk cache.
            A large interval frees more pages per eviction: size ``max_step_pages``
            for it (``for_engine`` assumes eviction every step).
        defer_frees: ``True`` (default): releases are recorded and run with the next
            step (one step per iteration). ``False``: SGLang's timing --
            ``free_group_end()`` runs the group's frees at once through
            ``alloc.free_group()`` (one more step per iteration), a release outside a
            group runs at once (one step per request: the slow path).

    Invariants: a row released here is not used again until its step ran (the seam
    refuses it); ``available_size()`` counts the pages of recorded frees, which the
    next step returns before it allocates. Cost: O(batch) host work per call, one
    step per ``prepare_*``; the queries are O(1), no device read.
    """

    def __init__(self, alloc: HybridAllocator, *, swa_eviction_interval: int = 1,
                 defer_frees: bool = True):
        self.pending = IterationStep(alloc, "SGLangAllocator")
        if isinstance(swa_eviction_interval, bool) or not isinstance(
                swa_eviction_interval, int) or swa_eviction_interval < 1:
            raise ConfigError(f"swa_eviction_interval must be an int >= 1 (tokens), got "
                              f"{swa_eviction_interval!r}")
        if not isinstance(defer_frees, bool):
            raise ConfigError(f"defer_frees must be a bool, got {defer_frees!r}")
        self.alloc = alloc
        self.page_size = alloc.config.page_size
        self.sliding_window_size = alloc.config.sliding_window
        self.swa_eviction_interval = swa_eviction_interval
        self.defer_frees = defer_frees
        self._group: contextlib.ExitStack | None = None
        self._in_group = False

    # ---- allocation (ScheduleBatch.prepare_for_extend / prepare_for_decode) -------------
    def prepare_for_extend(self, batch) -> SGLangBatchAlloc | None:
        """Rows for new requests, SWA eviction below ``floor_page(prefix_len - W)``, and
        ``extend_lens[i]`` slots per request, with the recorded frees: ONE step.

        A new request (``req_pool_idx is None``) must have ``prefix_lens[i] == 0`` (no
        prefix cache yet); a running one (a chunked prefill's next chunk) must have
        ``prefix_lens[i]`` equal to its allocated length. Returns ``None`` when either
        pool or the request rows are short, with nothing changed (no row given, no
        free run)."""
        reqs = list(batch.reqs)
        prefix = _host_ints(batch.prefix_lens, len(reqs), "prefix_lens")
        ext = _host_ints(batch.extend_lens, len(reqs), "extend_lens")
        self._refuse_in_group("prepare_for_extend")
        items = []
        for req, p, n in zip(reqs, prefix, ext, strict=True):
            if n < 1:
                raise PositionError(f"extend_lens: {n} for a request; an extend adds >= 1 "
                                    "token")
            if req.req_pool_idx is None:
                if p:
                    raise ContractError(
                        f"a new request has prefix_len {p}: the prefix cache is not wired "
                        "into this seam yet, so a new request starts at length 0")
                items.append((None, n, None))
                continue
            row = self._running_row(req, p, "prepare_for_extend")
            items.append((row, p + n, self._window_floor(p)))
        return self._allocate(reqs, items)

    def prepare_for_decode(self, batch) -> SGLangBatchAlloc | None:
        """One slot per request, with the SWA eviction of the requests due by the
        interval and the recorded frees: ONE step. ``seq_lens_cpu[i]`` must equal the
        request's allocated length. Returns ``None`` (nothing changed) when short."""
        reqs = list(batch.reqs)
        lens = _host_ints(batch.seq_lens_cpu, len(reqs), "seq_lens_cpu")
        self._refuse_in_group("prepare_for_decode")
        items = []
        for req, length in zip(reqs, lens, strict=True):
            row = self._running_row(req, length, "prepare_for_decode")
            due = length - self.sliding_window_size >= (self.pending.frontier(row)
                                                        + self.swa_eviction_interval)
            items.append((row, length + 1, self._window_floor(length) if due else None))
        return self._allocate(reqs, items)

    # ---- release (release_kv_cache) and the free-group bracket --------------------------
    def release_kv_cache(self, req) -> None:
        """Free everything ``req`` holds and its row (a finished or retracted request);
        sets ``req.req_pool_idx = None``.

        This is SGLang's ``release_kv_cache`` with a ChunkCache (no prefix cache): every
        page is freed, nothing is inserted anywhere. With ``defer_frees`` the release
        runs with the next step and counts in ``available_size()`` at once."""
        row = self.pending.check_row(req.req_pool_idx, "release_kv_cache")
        if self.defer_frees:
            self.pending.release(row)
        else:  # in a group: planned now, run by free_group_end(); else one step now
            self.alloc.release([row])
        req.req_pool_idx = None

    def insert_into_prefix_cache(self, req) -> None:
        """The prefix-cache half of SGLang's ``release_kv_cache`` (``cache_finished_req``
        of a radix cache): NOT wired yet. The prefix cache is being built on the
        allocator's handles (``take_handle`` / ``admit(handle=)`` / ``drop_handle``);
        until this hook calls it, nothing is cached and this raises."""
        raise NotImplementedError(
            "the prefix cache is not wired into graphalloc.integrations.sglang yet: "
            "release_kv_cache frees every page (ChunkCache behaviour)")

    def release_finished(self, reqs) -> int:
        """``process_batch_result``'s frees: in one free group, ``release_kv_cache`` every
        request whose ``finished()`` is true. Returns how many were released."""
        done = [r for r in reqs if r.finished()]
        self.free_group_begin()
        try:
            for req in done:
                self.release_kv_cache(req)
        finally:
            self.free_group_end()
        return len(done)

    def free_group_begin(self) -> None:
        """Open a free group (nesting raises :class:`NestedGroupError`, as SGLang asserts).
        With ``defer_frees=False`` this opens ``alloc.free_group()``."""
        if self._in_group:
            raise NestedGroupError("free_group_begin() inside an open free group; call "
                                   "free_group_end() first")
        if not self.defer_frees:
            stack = contextlib.ExitStack()
            stack.enter_context(self.alloc.free_group())
            self._group = stack
        self._in_group = True

    def free_group_end(self) -> None:
        """Close the free group. ``defer_frees=True``: nothing runs (the group's releases
        join the next step); ``False``: ``alloc.free_group()`` closes, running the
        group's frees as one step (more only if they exceed the frozen shape)."""
        if not self._in_group:
            raise NestedGroupError("free_group_end() without free_group_begin()")
        self._in_group = False
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def flush(self) -> int:
        """Run the recorded frees now (an idle iteration, shutdown); returns the steps run
        (0 when nothing is recorded)."""
        self._refuse_in_group("flush")
        return self.pending.run()[1]

    # ---- queries (BaseTokenToKVPoolAllocator's names; tokens, host only) ----------------
    def full_available_size(self) -> int:
        """Free FULL slots (tokens), counting recorded frees. O(1), no device read."""
        return self.pending.free_pages("full") * self.page_size

    def swa_available_size(self) -> int:
        """Free SWA slots (tokens), counting recorded frees. O(1), no device read."""
        return self.pending.free_pages("swa") * self.page_size

    def available_size(self) -> int:
        """``min(full_available_size(), swa_available_size())``, as SGLang's SWA allocator."""
        return min(self.full_available_size(), self.swa_available_size())

    def translate_loc_from_full_to_swa(self, full_slots):
        """SWA slots of ``full_slots`` (a device tensor of full slots): a gather of
        ``alloc.full_to_swa``, enqueued on the device, no host/device synchronisation.
        0 where a slot has no SWA peer (evicted or free). Unlike SGLang's mapping there
        is no ``-1 -> -1`` entry (graphalloc computes last locations itself)."""
        return self.alloc.full_to_swa[full_slots]

    @property
    def n_recorded_releases(self) -> int:
        """Releases recorded for the next step."""
        return len(self.pending.releases)

    # ---- internals ---------------------------------------------------------------------
    def _allocate(self, reqs, items) -> SGLangBatchAlloc | None:
        if not items:
            raise ContractError("an empty batch allocates nothing; on an idle iteration "
                                "call flush() to run the recorded frees")
        rows = self.pending.reserve(items)
        if rows is None:
            return None
        n_evicted = sum(v[1] for v in self.pending.advances.values())
        for req, row in zip(reqs, rows, strict=True):
            req.req_pool_idx = row
        result, n_steps = self.pending.run()
        return SGLangBatchAlloc(result, np.array(rows, dtype=np.int64), n_steps, n_evicted)

    def _running_row(self, req, length: int, what: str) -> int:
        row = self.pending.check_row(req.req_pool_idx, what)
        have = self.alloc.seq_len(row)
        if length != have:
            raise ContractError(f"{what}: request row {row} has {have} tokens allocated, the "
                                f"batch says {length}; pass the KV length before this step")
        return row

    def _window_floor(self, pre_len: int) -> int:
        return max(pre_len - self.sliding_window_size, 0) // self.page_size * self.page_size

    def _refuse_in_group(self, what: str) -> None:
        if self._in_group:
            raise NestedGroupError(f"{what}() inside an open free group; call "
                                   "free_group_end() first (SGLang allocates after it)")
