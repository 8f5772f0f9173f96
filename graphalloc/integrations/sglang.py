"""SGLang's request-level allocator seam, one graphalloc step per scheduler iteration.

SGLang's scheduler (non-overlap event loop) runs, per iteration: form a batch
(``PrefillAdder`` checks ``available_size()``; a decode batch checks it and may
retract), ``ScheduleBatch.prepare_for_extend()`` / ``prepare_for_decode()`` (request
slots, SWA eviction ``_evict_swa``, ``alloc_paged_token_slots_extend`` /
``_decode``), the forward, then ``process_batch_result`` releasing each finished
request with ``release_kv_cache`` between ``free_group_begin()`` and
``free_group_end()``. :class:`SGLangAllocator` takes the same calls on plain objects
with SGLang's attribute names, records the frees and evictions, and runs each
iteration's frees, evictions, admits and allocation as ONE step
(``alloc.scheduler_step()``): the frees of iteration k's results join the allocation
step of iteration k+1.

Objects it reads (host values only; SGLang keeps these on the CPU too):

* a request: ``req_pool_idx`` (``None`` until the seam gives it a row; the seam
  writes it, as SGLang's ``ReqToTokenPool.alloc`` does, and sets it back to ``None``
  on release), and ``finished()`` for :meth:`SGLangAllocator.release_finished`; with
  the prefix cache also ``origin_input_ids`` and ``output_ids`` (token ids, host lists)
  and ``last_node`` (the seam writes it: the matched entry's handle, or ``None``);
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

The prefix cache (SGLang's radix cache; ``SWARadixCache`` for hybrid models): when the
allocator was built with ``HybridAllocator(cfg, prefix_cache=True)`` the seam plays
SGLang's ``tree_cache`` on :class:`graphalloc.sharing.prefix_cache.PrefixCache`; without one it
behaves as SGLang's ChunkCache (``--disable-radix-cache``: a release frees everything).

* :meth:`SGLangAllocator.match_prefix` (``tree_cache.match_prefix`` in
  ``Req.init_next_round_input``): the longest cached whole-page prefix of the request's
  ``origin_input_ids + output_ids`` minus its last token (one token is always computed),
  counting only hits whose SWA window is present; the entry is locked (SGLang's
  ``inc_lock_ref``) until the next step the seam runs. The request's ``last_node``
  names the hit.
* ``prepare_for_extend`` admits a new request with ``prefix_lens[i] > 0`` on that hit
  (``admit(handle=, n_tokens=prefix_len)``: the prefix's pages shared, its
  ``req_to_token`` written on the device in the step) and extends it by
  ``extend_lens[i]``, in the iteration's one step.
* :meth:`SGLangAllocator.release_kv_cache` is ``cache_finished_req``: the request's whole
  pages of KV (``origin_input_ids + output_ids``, up to its allocated length) are
  inserted -- the cache's handle references them, SWA only from the request's frontier
  (what left the window is a tombstone) -- and the request is released: its pages the
  entry does not hold (the partial tail page, pages an equal entry already holds) are
  freed. :meth:`SGLangAllocator.cache_unfinished_req` inserts a chunked prefill's
  prefix. A new entry is one step of its own (the handle's prefix copy), run at the call;
  an already cached prefix costs none.
* ``evictable_size()`` (and the FULL/SWA variants): tokens the cache could give back once
  the recorded frees ran; the allocator evicts by itself inside a step whose allocation
  needs them (SWA tombstoned before FULL is evicted), so a scheduler admits while
  ``available_size() + evictable_size()`` covers the batch, as SGLang's ``PrefillAdder``.

Does not cover: the overlap scheduler's deferred eviction (evicting with ``pre_len`` one
chunk or one step behind), speculative decoding's multi-token decode allocation,
HiCache load-back, disaggregation, page_size 1 token-level ``alloc(n)``, ring mode; FULL
hits whose window is gone (SGLang recomputes the window; here ``match_prefix`` reports
only window-present hits), per-node lock references kept across iterations.

What an engine must still write: call the seam where SGLang calls its allocator and its
tree cache (the methods above, in its order; ``match_prefix`` in the iteration that
prefills the request); build ``ForwardBatch.out_cache_loc`` from the returned views
(valid until the next step runs) and its attention metadata (e.g.
:class:`graphalloc.attention.page_tables.PageTables`, or gathers of ``alloc.req_to_token``);
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
from ..errors import (
    AlignmentError,
    ConfigError,
    ContractError,
    NestedGroupError,
    PositionError,
    TensorSpecError,
)
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

    With a prefix cache (``HybridAllocator(cfg, prefix_cache=True)``) the seam is also
    SGLang's ``tree_cache``: :meth:`match_prefix`, :meth:`cache_unfinished_req`,
    :meth:`cache_finished_req` (what :meth:`release_kv_cache` does then) and
    :meth:`evictable_size`; see the module docstring.

    Invariants: a row released here is not used again until its step ran (the seam
    refuses it); ``available_size()`` counts the pages of recorded frees, which the
    next step returns before it allocates; a matched entry stays locked until the next
    step the seam runs. Cost: O(batch) host work per call, one step per ``prepare_*``
    (plus one per new cache entry); the queries are O(1) (shared pages counted by
    reference as the frees are recorded; recounted once after a step or a cache change);
    no device read.
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
        self.tree_cache = alloc.prefix_cache  # None: SGLang's ChunkCache behaviour
        self.cache_steps = 0  # steps the prefix cache ran (a new entry's handle, LRU drops)
        self._locks: dict[int, tuple[object, int]] = {}  # id(req) -> (req, locked handle)
        self._group: contextlib.ExitStack | None = None
        self._in_group = False

    # ---- allocation (ScheduleBatch.prepare_for_extend / prepare_for_decode) -------------
    def prepare_for_extend(self, batch) -> SGLangBatchAlloc | None:
        """Rows for new requests, SWA eviction below ``floor_page(prefix_len - W)``, and
        ``extend_lens[i]`` slots per request, with the recorded frees: ONE step.

        A new request (``req_pool_idx is None``) starts at length 0, or, with
        ``prefix_lens[i] > 0``, on the cached prefix :meth:`match_prefix` found for it
        since the last step (``req.last_node``; whole pages, at most the hit): the step
        admits it sharing those pages and allocates only ``extend_lens[i]``. A running
        one (a chunked prefill's next chunk) must have ``prefix_lens[i]`` equal to its
        allocated length. Returns ``None`` when either pool or the request rows are short
        (the cache's reclaimable pages count as free: the step evicts them), with nothing
        changed (no row given, no free run)."""
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
                items.append((None, n, None) if not p else
                             (None, p + n, None, self._matched_handle(req, p), p))
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
    def release_kv_cache(self, req, is_insert: bool = True) -> None:
        """Free everything ``req`` holds and its row (a finished or retracted request);
        sets ``req.req_pool_idx = None``.

        Without a prefix cache this is SGLang's ``release_kv_cache`` with a ChunkCache:
        every page is freed. With one (and ``is_insert``) it is ``cache_finished_req``:
        the request's whole pages are inserted first (:meth:`insert_into_prefix_cache`),
        then released, so the pages the entry references stay. With ``defer_frees`` the
        release runs with the next step and counts in ``available_size()`` at once."""
        row = self.pending.check_row(req.req_pool_idx, "release_kv_cache")
        if is_insert and self.tree_cache is not None:
            self.insert_into_prefix_cache(req)
        if self.defer_frees:
            self.pending.release(row)
        else:  # in a group: planned now, run by free_group_end(); else one step now
            self.alloc.release([row])
        req.req_pool_idx = None

    def cache_finished_req(self, req) -> None:
        """SGLang's ``tree_cache.cache_finished_req``: insert, then release
        (:meth:`release_kv_cache` with the cache)."""
        self._need_cache("cache_finished_req")
        self.release_kv_cache(req)

    def insert_into_prefix_cache(self, req) -> int:
        """The prefix-cache half of ``cache_finished_req``: cache the whole pages of the
        request's KV -- ``origin_input_ids + output_ids`` up to its allocated length (the
        positions whose KV the forward wrote) -- on a handle: FULL pages of the prefix,
        SWA pages from the request's frontier on (what already left the window is a
        tombstone). One step when the entry is new (none when an equal prefix is cached:
        this request's copies are then freed with it); returns the tokens cached."""
        self._need_cache("insert_into_prefix_cache")
        row = self.pending.check_row(req.req_pool_idx, "insert_into_prefix_cache")
        return self._insert(row, self._token_ids(req, "insert_into_prefix_cache"))

    def cache_unfinished_req(self, req) -> int:
        """SGLang's ``tree_cache.cache_unfinished_req`` (after a chunked prefill's chunk):
        cache the request's whole pages so far; it keeps running on its own pages. One
        step when the entry is new; returns the tokens cached."""
        return self.insert_into_prefix_cache(req)

    def match_prefix(self, req) -> int:
        """SGLang's ``tree_cache.match_prefix`` for a new request: the longest cached
        prefix (whole pages) of ``origin_input_ids + output_ids`` without its last token,
        counting only hits whose SWA window is present. Locks the entry until the next
        step the seam runs (a later match of the same request replaces it) and names it
        in ``req.last_node``; returns the prefix length in tokens (0: a miss, ``last_node
        = None``). Pass it as the request's ``prefix_lens`` entry in the same iteration's
        ``prepare_for_extend``. Host only: O(prompt pages) hashing."""
        cache = self._need_cache("match_prefix")
        if req.req_pool_idx is not None:
            raise ContractError("match_prefix: the request already has a row; match new "
                                "(waiting) requests")
        self._unlock(req)
        tokens = self._token_ids(req, "match_prefix")
        hit = cache.match(tokens[:max(len(tokens) - 1, 0)])
        req.last_node = None
        if not hit.cached_tokens:
            return 0
        cache.lock(hit.handle)
        if not self.pending.fits():  # recorded work needs the entry's pages: not a hit
            cache.unlock(hit.handle)
            return 0
        self._locks[id(req)] = (req, hit.handle)
        req.last_node = hit.handle
        return hit.cached_tokens
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
        n = self.pending.run()[1]
        if n:
            self._unlock_all()
        return n

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

    def full_evictable_size(self) -> int:
        """FULL slots (tokens) the prefix cache could give back once the recorded frees
        ran (0 without a cache): SGLang's ``tree_cache.full_evictable_size()``."""
        return self.pending.reclaimable_pages("full") * self.page_size

    def swa_evictable_size(self) -> int:
        """SWA slots (tokens) the prefix cache could give back (``swa_evictable_size``)."""
        return self.pending.reclaimable_pages("swa") * self.page_size

    def evictable_size(self) -> int:
        """``min`` of the two: add it to ``available_size()`` to budget a batch, as
        SGLang's ``PrefillAdder`` does with ``tree_cache.evictable_size()``."""
        return min(self.full_evictable_size(), self.swa_evictable_size())

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
        keys = self.pending.reserve(items)
        if keys is None:
            return None
        n_evicted = sum(v[1] for v in self.pending.advances.values())
        result, n_steps = self.pending.run()
        rows = [self.pending.admitted.get(key, key) for key in keys]
        for req, row in zip(reqs, rows, strict=True):
            req.req_pool_idx = row
        self._unlock_all()
        return SGLangBatchAlloc(result, np.array(rows, dtype=np.int64), n_steps, n_evicted)

    def _need_cache(self, what: str):
        if self.tree_cache is None:
            raise ConfigError(f"{what}: the allocator has no prefix cache (SGLang's ChunkCache "
                              "behaviour); build it with HybridAllocator(cfg, prefix_cache="
                              "True) for the radix-cache calls")
        return self.tree_cache

    @staticmethod
    def _token_ids(req, what: str) -> list:
        ids = getattr(req, "origin_input_ids", None)
        if ids is None:
            raise ContractError(f"{what}: the request has no origin_input_ids (token ids); "
                                "the prefix cache keys pages by their tokens")
        return list(ids) + list(getattr(req, "output_ids", None) or ())

    def _insert(self, row: int, tokens: list) -> int:
        before = self.alloc.steps_run
        n = self.tree_cache.insert(row, tokens)
        self.cache_steps += self.alloc.steps_run - before
        return n

    def _matched_handle(self, req, prefix_len: int) -> int:
        lock = self._locks.get(id(req))
        if self.tree_cache is None or lock is None or lock[0] is not req:
            raise ContractError(
                f"a new request has prefix_len {prefix_len} but no prefix-cache hit of its "
                "own since the last step: call match_prefix(req) in the iteration that "
                "prefills it and pass what it returned")
        if prefix_len % self.page_size:
            raise AlignmentError(f"prefix_len {prefix_len} is not whole pages (page_size "
                                 f"{self.page_size}); match_prefix returns whole pages")
        return lock[1]

    def _unlock(self, req) -> None:
        lock = self._locks.pop(id(req), None)
        if lock is not None:
            self.tree_cache.unlock(lock[1])

    def _unlock_all(self) -> None:
        locks, self._locks = self._locks, {}
        for _, handle in locks.values():
            self.tree_cache.unlock(handle)

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
