"""vLLM v1's ``KVCacheManager`` calls over graphalloc: ONE Step per ``schedule()``.

Deprecated: the plug-in that runs inside vLLM's real scheduler is
:mod:`graphalloc.integrations.vllm_manager` (docs/vllm.md); this facade takes request ids
and an explicit ``run_step()`` and stays for its tests and examples until it is removed.

Contract. :class:`GraphallocKVCacheManager` answers vLLM's per-request calls and only
RECORDS them: ``allocate_slots(request_id, n, num_lookahead_tokens)`` writes one slot of
preallocated int64 arrays (row, tokens, window floor, trim target; a new request's row is
the iteration's lowest free row, ``pending.free_row``, admitted plain or on its cache hit)
and returns the new block positions, or ``None`` (back-pressure, nothing changed); ``free``
records a release (with caching and token ids, an insert as a ``take`` run before it in
the same step). :meth:`~GraphallocKVCacheManager.run_step`, the line the engine adds after
``schedule()``'s loop, turns the slots into arrays with a few numpy masks, appended to the
iteration's accumulator in one vectorised append per kind, and runs ONE Step (take, release,
trim, advance, admit / admit_on, extend); the cache evicts inside it when pages are short.
Rules (vLLM's): a request holds ``min(computed + n + lookahead, max_model_len)`` positions;
its SWA blocks below ``computed - sliding_window`` are removed (null block 0) first; a
target a whole block below what it holds trims the rest (not below ``frontier + window``);
a second call in one iteration replaces the first; a cache hit is the longest cached
whole-block prefix of ``token_ids[:-1]`` whose window is cached, locked until ``run_step``.
Tenants: a request's ``cache_salt`` (vLLM's) and ``extra_keys`` enter its block keys, so
two salts never share a block; without one, requests share one namespace (docs/sharing.md).
A request's keys are computed once, kept from ``get_computed_blocks`` to ``free``
(or taken from the engine: ``block_hashes=``, vLLM's ``request.block_hashes``).

Unknown ids, one policy with the SGLang seam: ``free`` of an id holding no KV here is a
no-op returning ``False`` (vLLM frees aborted waiting requests so); every other call
naming an unknown id, and any call with an unhashable id, raises
:class:`~graphalloc.errors.UnknownRequestError`. A refused call changes nothing.

Invariants: ``None`` only for lack of pages (counting what the recorded frees and the
cache's unlocked entries give back: the planner's dry runs) or of rows; pages needed are
``ceil((L + n) / bs) - ceil(L / bs)`` per pool. Cost: ``allocate_slots`` / ``free`` O(1)
(a dict lookup, two ledger reads, two array writes; a dry run only when the free pages now
do not cover the recorded allocations); ``run_step`` O(requests) numpy + one plan; no sync.
The engine still writes ``run_step()``, the slot mapping from :meth:`token_slots` (device
views), block tables from ``alloc.tables`` (``page_tables=PageTableSpec(...)``; host ids
via :meth:`get_block_ids` are a device read), ``num_computed_tokens=`` under speculative
decoding, token ids with caching, and ``alloc.check()`` where it synchronises anyway.
Recurrent-state slots (``num_state_slots``): :meth:`~GraphallocKVCacheManager.state_block_id`
is a request's block id in each Mamba group (one state block per request), admitted and
freed with the request, cache hits restored inside the step; the engine zeroes a new
state and runs its layers on it. Speculative states are not driven through the facade.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from ..allocator import AllocResult, HybridAllocator
from ..diagnostics.sync_points import sync_allowed
from ..errors import (
    BatchTooLargeError,
    CapacityError,
    ConfigError,
    ContractError,
    PendingStepError,
    PositionError,
    UnknownRequestError,
)
from ..sharing.page_keys import RequestKeys
from .iteration import IterationStep

__all__ = ["GraphallocKVCacheManager", "GraphallocBlocks", "FULL_GROUP", "SWA_GROUP",
           "NULL_BLOCK_ID"]

FULL_GROUP = 0  # index of the full-attention KV-cache group in block-id tuples
SWA_GROUP = 1  # index of the sliding-window group
NULL_BLOCK_ID = 0  # the null block: graphalloc's sink page 0, never allocated

_RUNNING, _ADMIT, _ADMIT_ON, _DEAD = 0, 1, 2, -1  # slot kinds


def _count(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or (
            value < 0):
        raise ContractError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


def _unhashable(request_id, what: str) -> UnknownRequestError:
    return UnknownRequestError(f"{what}: request id {request_id!r} is not hashable "
                               f"({type(request_id).__name__}); vLLM's ids are strings")


class GraphallocBlocks:
    """``KVCacheBlocks``-shaped answer of ``allocate_slots`` (the request's new blocks) and
    of ``get_computed_blocks`` (its cached blocks, ``handle`` naming the cache entry):
    block indices ``[first_block, first_block + num_blocks)`` of its table, in each group
    (FULL and SWA the same count). Host ints; the ids need a device read."""

    __slots__ = ("request_id", "first_block", "num_blocks", "manager", "handle")

    def __init__(self, request_id, first_block: int, num_blocks: int, manager,
                 handle: int = -1):
        self.request_id, self.first_block, self.num_blocks = request_id, first_block, num_blocks
        self.manager, self.handle = manager, handle

    def __repr__(self) -> str:
        return (f"GraphallocBlocks(request_id={self.request_id!r}, first_block="
                f"{self.first_block}, num_blocks={self.num_blocks}, handle={self.handle})")

    def get_block_ids(self) -> tuple[list[int], list[int]]:
        """The blocks' ids per group, ``(FULL, SWA)``: a DEVICE READ (synchronises), after
        :meth:`GraphallocKVCacheManager.run_step`. For inspection and tests."""
        if not self.num_blocks:
            return [], []
        if self.handle >= 0 and self.request_id not in self.manager:  # a hit not yet admitted
            return self.manager._handle_block_ids(  # noqa: SLF001 (same module)
                self.handle, self.num_blocks)
        full, swa = self.manager.get_block_ids(self.request_id)
        end = self.first_block + self.num_blocks
        return full[self.first_block:end], swa[self.first_block:end]


class GraphallocKVCacheManager:
    """vLLM ``KVCacheManager`` calls over a pool-mode :class:`HybridAllocator` (see the
    module docstring).

    Args:
        alloc: the allocator (pool mode). ``sliding_window`` is the allocator's window,
            ``W_model - 1`` (``AllocatorConfig.for_engine`` converts the model's).
            ``max_reqs`` must cover the running requests plus one iteration's frees.
        enable_caching: prefix caching (needs ``HybridAllocator(cfg, prefix_cache=True)``).
    """

    def __init__(self, alloc: HybridAllocator, *, enable_caching: bool = False):
        self.pending = IterationStep(alloc, "GraphallocKVCacheManager")
        if not isinstance(enable_caching, bool):
            raise ConfigError(f"enable_caching must be a bool, got {enable_caching!r}")
        if enable_caching and alloc.prefix_cache is None:
            raise ConfigError("enable_caching=True needs an allocator with a prefix cache: "
                              "HybridAllocator(cfg, prefix_cache=True) (pool mode, "
                              "max_handles > 0)")
        cfg = alloc.config
        self.alloc, self.ledger, self._pipeline = alloc, alloc.ledger, alloc.pipeline
        self.block_size = cfg.page_size
        self.sliding_window = cfg.sliding_window
        self.max_model_len = cfg.max_context_len
        self.enable_caching = enable_caching
        self.prefix_cache = alloc.prefix_cache if enable_caching else None
        self.steps_last_run = 0
        self._max_row_tokens = cfg.max_tokens_per_alloc_row
        self._states = cfg.num_state_slots > 0  # recurrent-state slots: one per request
        self._max_rows, self._max_tokens = cfg.max_alloc_rows, cfg.max_step_tokens
        n = cfg.max_reqs
        self._rows: dict[Hashable, int] = {}  # id -> row (live, or admitted by the next step)
        self._computed = [0] * n  # per row: computed tokens as last granted
        self._new = [False] * n  # per row: admitted by the next step
        self._reserved: list[int] = []  # rows of this iteration's new requests
        self._hits: dict[Hashable, int] = {}  # id -> locked cache handle, until run_step
        self._keys: dict[Hashable, RequestKeys] = {}  # id -> its block keys, until free()
        self._stats = {"requests": 0, "queries": 0, "hits": 0}
        # this iteration's slots, one per request (a later call replaces its slot)
        self._gen = 1
        self._slot_gen = [0] * n  # per row: the iteration of its slot
        self._slot_idx = [0] * n
        self._n = 0
        # slot fields; defaults (floor, trim -1; kind running; pages 0) are written back at
        # the end of each iteration, so the common call writes only row and tokens
        self._s_row, self._s_n, self._s_kind, self._s_h, self._s_hit, self._s_pages = (
            np.zeros(n, dtype=np.int64) for _ in range(6))
        self._s_floor = np.full(n, -1, dtype=np.int64)
        self._s_trim = np.full(n, -1, dtype=np.int64)
        self._need = 0  # pages per pool the slots allocate
        self._n_rows = 0  # allocation rows (extends and admit_on copies)
        self._n_tokens = 0
        self._slot_frees = 0  # version of the slots' window floors and trims
        self._floor_key = -1
        self._floor = 0  # min over pools of the free pages when the iteration began

    # ---- the scheduler's calls ---------------------------------------------------------
    def get_computed_blocks(self, request_id: Hashable, token_ids=None, *, cache_salt=None,
                            extra_keys=None, block_hashes=None
                            ) -> tuple[GraphallocBlocks, int]:
        """The request's cached blocks and computed tokens, ``(blocks, n_tokens)``.

        With caching and ``token_ids`` (the request's ``all_token_ids``): the longest
        cached whole-block prefix of ``token_ids[:-1]`` whose sliding-window blocks are
        cached too, among the blocks cached under the same ``cache_salt`` / ``extra_keys``
        (:func:`~graphalloc.sharing.page_keys.page_keys`: vLLM's ``request.cache_salt``;
        per-block extra keys, e.g. multimodal hashes); the entry is locked until the next
        :meth:`run_step` (a later call for the same request replaces it). A hit whose
        blocks this iteration's recorded allocations need (they would evict them) is
        reported as a miss. Otherwise ``(no blocks, 0)``, vLLM's answer with caching
        disabled. For a waiting request (new or preempted). The request's block keys are
        kept until :meth:`free` (later calls hash only new blocks); ``block_hashes``: the
        engine's own (bytes, one per block of ``block_size`` tokens, salt included: vLLM's
        ``request.block_hashes``), used as they are, never hashed; an engine that passes
        them passes them to :meth:`free` and :meth:`cache_blocks` too (one key scheme per
        cache). Host only: O(new prompt blocks) hashing."""
        row = self._lookup(request_id, "get_computed_blocks")
        cache = self.prefix_cache
        if cache is None or token_ids is None:
            return GraphallocBlocks(request_id, 0, 0, self), 0
        if row is not None:
            raise ContractError(f"get_computed_blocks({request_id!r}): the request holds KV "
                                "here already; look up waiting requests only")
        tokens = token_ids if type(token_ids) is list else list(token_ids)
        keys = self._request_keys(request_id, cache_salt, extra_keys, block_hashes,
                                  "get_computed_blocks")
        self._drop_hit(request_id)
        hit = self._match(cache, tokens[:max(len(tokens) - 1, 0)], keys)
        n_hit = hit.cached_tokens
        if n_hit:
            cache.lock(hit.handle)
            if not self._fits(self._need):  # this iteration's allocations need its blocks
                cache.unlock(hit.handle)  # (vLLM would have evicted them for them already)
                n_hit = 0
        self._stats["requests"] += 1
        self._stats["queries"] += len(tokens)
        self._stats["hits"] += n_hit
        if not n_hit:
            return GraphallocBlocks(request_id, 0, 0, self), 0
        self._hits[request_id] = hit.handle
        return GraphallocBlocks(request_id, 0, n_hit // self.block_size, self, hit.handle), n_hit

    def allocate_slots(self, request_id: Hashable, num_new_tokens: int,
                       num_lookahead_tokens: int = 0, *, num_computed_tokens: int | None = None,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: GraphallocBlocks | None = None
                       ) -> GraphallocBlocks | None:
        """Make ``request_id`` hold ``computed + num_new_tokens + num_lookahead_tokens``
        positions (at most ``max_model_len``), after removing its blocks below the window
        of ``computed``; recorded for :meth:`run_step`.

        ``num_computed_tokens``: the request's ``num_computed_tokens`` (default: what this
        facade granted so far; 0 for a new request). ``num_new_computed_tokens`` /
        ``new_computed_blocks``: a new request's cache hit as :meth:`get_computed_blocks`
        returned it in this iteration (all of it): the step admits the request on those
        blocks. Returns the new blocks' positions, or ``None`` when either pool (counting
        what recorded frees and the cache's evictable blocks give back) or the request rows
        are short: back-pressure, nothing changed. Raises (nothing changed) on
        ``num_new_tokens < 1`` (as vLLM), a hit that is not this request's from this
        iteration, and a batch over the frozen step shape."""
        try:
            row = self._rows.get(request_id)
        except TypeError:
            raise _unhashable(request_id, "allocate_slots") from None
        n_new, look = num_new_tokens, num_lookahead_tokens
        if type(n_new) is not int or type(look) is not int or n_new < 1 or look < 0:
            n_new = _count(n_new, "num_new_tokens")
            look = _count(look, "num_lookahead_tokens")
            if n_new < 1:
                raise ContractError("num_new_tokens must be greater than 0")
        if (row is None or self._new[row] or num_new_computed_tokens
                or new_computed_blocks is not None):
            return self._allocate_new(request_id, row, n_new, look, num_computed_tokens,
                                      num_new_computed_tokens, new_computed_blocks)
        computed = num_computed_tokens
        if computed is None:
            computed = self._computed[row]
        elif type(computed) is not int or computed < 0:
            computed = _count(computed, "num_computed_tokens")
        led = self.ledger
        length, front = led.seq_len.item(row), led.frontier.item(row)
        # the common call -- a running request's first this iteration, growing, its pages
        # covered by the free pages now -- inline; everything else through _record
        target = computed + n_new + look
        n = target - length
        ps = self.block_size
        first = (length + ps - 1) // ps
        pages = (target + ps - 1) // ps - first
        need, n_tokens, n_rows = self._need + pages, self._n_tokens + n, self._n_rows + 1
        if (self._slot_gen[row] == self._gen or computed > length or n <= 0
                or target > self.max_model_len or n > self._max_row_tokens
                or need > self._floor or self._floor_key != self._pipeline.steps_run
                or n_tokens > self._max_tokens
                or n_rows + self.pending.n_takes > self._max_rows):
            return self._record(request_id, row, _RUNNING, computed, n_new, look, length,
                                front, -1, 0)
        slot = self._n
        self._n = slot + 1
        self._slot_gen[row] = self._gen
        self._slot_idx[row] = slot
        self._s_row[slot] = row
        self._s_n[slot] = n
        if pages:
            self._s_pages[slot] = pages
        floor = (computed - self.sliding_window) // ps * ps
        if floor > front:
            self._s_floor[slot] = floor
            self._slot_frees += 1
        self._need, self._n_tokens, self._n_rows = need, n_tokens, n_rows
        self._computed[row] = computed + n_new
        return GraphallocBlocks(request_id, first, pages, self)

    def _allocate_new(self, request_id, row, n_new, look, num_computed, n_hit_arg, blocks):
        """``allocate_slots`` for a request the next step admits (new now, or again)."""
        n_hit = _count(n_hit_arg, "num_new_computed_tokens")
        if row is not None and not self._new[row] and (n_hit or blocks is not None):
            raise ContractError(f"allocate_slots({request_id!r}): a prefix-cache hit must be "
                                "the one get_computed_blocks() returned for this new request "
                                "in this iteration")
        handle = self._take_hit(request_id, n_hit, blocks)
        computed = _count(0 if num_computed is None else num_computed, "num_computed_tokens")
        if handle >= 0 and computed:
            raise PositionError(f"request {request_id!r}: a new request with a cache hit has "
                                f"no computed tokens of its own, got {computed}")
        if handle < 0 and computed:
            raise PositionError(f"request {request_id!r}: {computed} computed tokens but 0 "
                                "allocated; computed tokens must have slots")
        if row is None:
            if self._states and not self._state_fits():
                return None  # the recurrent-state slots are short
            row = self.pending.free_row(self.ledger.live, self._reserved)
            if row < 0:
                return None  # the request rows are short
            kind_new = True
        else:
            kind_new = False  # a second call this iteration: the same reserved row
        kind = _ADMIT_ON if handle >= 0 else _ADMIT
        out = self._record(request_id, row, kind, n_hit, n_new, look, n_hit, 0, handle, n_hit)
        if out is not None and kind_new:
            self._reserved.append(row)
            self._new[row] = True
            self._rows[request_id] = row
        return out

    def _record(self, request_id, row, kind, computed, n_new, look, length, front, handle,
                n_hit):
        """Write (or replace) ``row``'s slot; ``None`` when the pools are short."""
        ps, window, mml = self.block_size, self.sliding_window, self.max_model_len
        if computed > length:
            raise PositionError(f"request {request_id!r}: {computed} computed tokens but "
                                f"{length} allocated; computed tokens must have slots")
        if computed + n_new > mml:
            raise PositionError(f"request {request_id!r}: {computed} + {n_new} tokens exceed "
                                f"max_model_len {mml}")
        target = computed + n_new + look
        if target > mml:
            target = mml
        floor = (computed - window) // ps * ps if kind == _RUNNING and computed > window else -1
        if floor <= front:
            floor = -1
        n, pages, trim = 0, 0, -1
        if target > length:
            n = target - length
            if n > self._max_row_tokens:
                raise BatchTooLargeError(
                    f"request {request_id!r} would allocate {n} tokens in one step; the frozen "
                    f"max_tokens_per_alloc_row is {self._max_row_tokens}: schedule smaller "
                    "chunks, or size the allocator with AllocatorConfig.for_engine")
            pages = (target + ps - 1) // ps - (length + ps - 1) // ps
        elif ((target + ps - 1) // ps < (length + ps - 1) // ps
              and (front == 0 or target >= front + window)):
            trim = target
        gen = self._gen
        replace = self._slot_gen[row] == gen
        slot = self._slot_idx[row] if replace else self._n
        if replace:
            old_n, old_pages = int(self._s_n[slot]), int(self._s_pages[slot])
            old_frees = self._s_floor[slot] >= 0 or self._s_trim[slot] >= 0
            old_on = self._s_kind[slot] == _ADMIT_ON
        else:
            old_n = old_pages = 0
            old_frees = old_on = False
        n_rows = self._n_rows + (n > 0) - (old_n > 0) + (kind == _ADMIT_ON) - old_on
        n_tokens = self._n_tokens + n - old_n
        cfg = self.alloc.config
        n_rows_all = n_rows + self.pending.n_takes  # (takes: rows too)
        if n_rows_all > cfg.max_alloc_rows or n_tokens > cfg.max_step_tokens:
            raise BatchTooLargeError(
                f"this iteration's step would need {n_rows} allocation rows and {n_tokens} "
                f"tokens, the frozen shape is {cfg.max_alloc_rows} and {cfg.max_step_tokens}: "
                "schedule less per iteration, or size the allocator with "
                "AllocatorConfig.for_engine from the engine's budgets")
        need = self._need + pages - old_pages
        frees = floor >= 0 or trim >= 0
        if need > self._free_floor():
            extra = None
            if frees or old_frees:  # count this call's window floor / trim instead
                extra = self._slot_frees_arrays(skip=slot if replace else -1)
                if floor >= 0:
                    extra["advance"] = _append(extra.get("advance"), row, floor)
                if trim >= 0:
                    extra["trim"] = _append(extra.get("trim"), row, trim)
            if not self._fits(need, extra):
                return None
        if not replace:
            self._slot_gen[row] = gen
            self._slot_idx[row] = slot
            self._n = slot + 1
            self._s_row[slot] = row
        self._s_n[slot] = n
        self._s_floor[slot] = floor
        self._s_trim[slot] = trim
        self._s_kind[slot] = kind
        self._s_h[slot] = handle
        self._s_hit[slot] = n_hit
        self._s_pages[slot] = pages
        self._need, self._n_rows, self._n_tokens = need, n_rows, n_tokens
        if frees or old_frees:
            self._slot_frees += 1
        self._computed[row] = computed + n_new
        first = (length + ps - 1) // ps
        last = (max(target, length) + ps - 1) // ps
        return GraphallocBlocks(request_id, first, last - first, self)

    def free(self, request_id: Hashable, token_ids=None, *, cache_salt=None,
             extra_keys=None, block_hashes=None) -> bool:
        """Free everything the request holds (finished or preempted): recorded for the next
        step, its pages count as free at once. An id holding no KV here is a no-op
        returning ``False`` (the unknown-id policy; vLLM frees aborted waiting requests). A
        request new in this iteration is never admitted (its allocation is dropped).

        With caching and ``token_ids`` (its computed tokens), the request's full blocks of
        them go into the prefix cache in the same step (a ``take`` before the release):
        those stay cached, the rest is freed. Keyed with the request's kept block keys
        (only blocks past them hashed), or made with ``cache_salt`` / ``extra_keys`` when
        :meth:`get_computed_blocks` never saw it; ``block_hashes`` as there. The kept keys
        are dropped."""
        try:
            row = self._rows.get(request_id)
        except TypeError:
            raise _unhashable(request_id, "free") from None
        keys = None
        if token_ids is not None and row is not None and self.prefix_cache is not None:
            keys = self._request_keys(request_id, cache_salt, extra_keys, block_hashes, "free")
        self._rows.pop(request_id, None)
        self._keys.pop(request_id, None)
        self._drop_hit(request_id)
        if row is None:
            return False
        self._kill_slot(row)
        if self._new[row]:  # admitted by the next step: never admitted
            self._new[row] = False
            self._reserved.remove(row)
            return True
        if keys is not None:
            self._insert(row, token_ids, keys)
        self.pending.add_release(row)
        return True

    def cache_blocks(self, request_id: Hashable, token_ids, *, cache_salt=None,
                     extra_keys=None, block_hashes=None) -> int:
        """vLLM's ``cache_blocks``: put the request's full blocks of ``token_ids`` (tokens
        whose KV is computed) into the prefix cache with the next step (a ``take``), while
        the request runs on. Call it where a prefix is worth keeping with its window, e.g.
        when a prompt's prefill completed. Keys as for :meth:`free` (kept for later calls).
        Returns the tokens cached (0 without caching)."""
        row = self._row(request_id, "cache_blocks")
        if self.prefix_cache is None:
            return 0
        keys = self._request_keys(request_id, cache_salt, extra_keys, block_hashes,
                                  "cache_blocks")
        return self._insert(row, token_ids, keys)

    def run_step(self) -> AllocResult | None:
        """Run everything recorded as ONE step (more only when the recorded frees exceed
        the frozen release shape; ``steps_last_run`` says). Call once per ``schedule()``,
        after its loop, before the forward. Returns the new slots (lanes: the requests in
        the order they were allocated; ``None`` when nothing was allocated). Never
        synchronises. A step refused for pages (the accounting was off) raises
        ``CapacityError`` with the records kept."""
        call = self._slot_arrays()
        if not self.pending and not call:
            self.steps_last_run = 0
            self._next_iteration()
            return None
        out = self.pending.run(**call)
        if out is None:
            raise CapacityError("run_step: the recorded step is short of pages or rows that "
                                "allocate_slots counted on; the records are kept")
        result, _, self.steps_last_run = out
        self._next_iteration()
        return result if result.n_step_tokens else None

    # ---- queries -----------------------------------------------------------------------
    def get_block_ids(self, request_id: Hashable) -> tuple[list[int], list[int]]:
        """The request's block ids per group, ``(FULL, SWA)``, ``ceil(L / block_size)``
        each; SWA ids of removed blocks are ``NULL_BLOCK_ID``. A DEVICE READ (one copy per
        group, synchronises): inspection and debugging only. Unknown id:
        ``UnknownRequestError``; recorded work: ``PendingStepError`` (run_step first)."""
        row = self._row(request_id, "get_block_ids")
        if self._slot_gen[row] == self._gen and (self._s_n[self._slot_idx[row]] > 0 or
                                                 self._s_floor[self._slot_idx[row]] >= 0):
            raise PendingStepError(f"get_block_ids({request_id!r}): the request has work "
                                   "recorded for the next step; call run_step() first")
        full, swa = self._block_ids(self.alloc.req_to_token[row],
                                    -(-self.alloc.seq_len(row) // self.block_size))
        removed = self.alloc.frontier(row) // self.block_size  # shared pages may be mapped
        return full, [NULL_BLOCK_ID] * removed + swa[removed:]

    def state_block_id(self, request_id: Hashable) -> int:
        """The request's recurrent-state slot: its block id in a Mamba KV-cache group
        (vLLM's one state block per request and group; every group reads the same slot of
        its own state tensors). Host value, no device read; valid once the step that admits
        the request ran (``run_step``). The device view for the batch is
        ``alloc.req_to_state[rows]`` (rows from :meth:`row_of`). Unknown id:
        ``UnknownRequestError``; without state slots: ``ConfigError``."""
        if not self._states:
            raise ConfigError("state_block_id: the allocator has no recurrent-state slots; "
                              "build its config with num_state_slots > 0")
        return int(self.ledger.state_slot[self._row(request_id, "state_block_id")])

    def _state_fits(self) -> bool:
        """A new request's slot fits: the free slots now, plus what the recorded releases
        and the cache's unlocked snapshots give back, cover the admits reserved. O(1)."""
        back = self.pending.n_releases + (0 if self.prefix_cache is None
                                          else self.prefix_cache.n_unlocked)
        return len(self._reserved) + 1 <= self.alloc.n_free("state") + back

    def _handle_block_ids(self, handle: int, n_blocks: int) -> tuple[list[int], list[int]]:
        """A cache hit's first ``n_blocks`` ids (a device read; the handle's row)."""
        start = self.alloc.handle_info(handle).swa_start // self.block_size
        full, swa = self._block_ids(self.alloc.state.handle_to_token[handle], n_blocks)
        return full, [NULL_BLOCK_ID] * start + swa[start:]

    def _block_ids(self, slots_row, n_blocks: int) -> tuple[list[int], list[int]]:
        ps = self.block_size
        with sync_allowed():  # the documented debug read
            first_slots = slots_row[0:n_blocks * ps:ps]
            full = (first_slots // ps).tolist()  # sync ok: the documented inspection read
            swa_slots = self.alloc.full_to_swa[first_slots]
            swa = (swa_slots // ps).tolist()  # sync ok: the documented inspection read
        return full, swa

    def token_slots(self, request_id: Hashable, start_pos: int, n_tokens: int):
        """``(full_slots, swa_slots)`` of positions ``[start_pos, start_pos + n_tokens)``:
        a view of ``alloc.req_to_token`` and a gather of ``alloc.full_to_swa``, on the
        device, no synchronisation (the model's slot mapping). Positions must be
        allocated by a step that ran."""
        row = self._row(request_id, "token_slots")
        start, n = _count(start_pos, "start_pos"), _count(n_tokens, "n_tokens")
        if start + n > self.alloc.seq_len(row):
            raise PositionError(f"token_slots({request_id!r}): positions [{start}, "
                                f"{start + n}) but {self.alloc.seq_len(row)} are allocated "
                                "by the steps run so far (run_step() first)")
        full = self.alloc.req_to_token[row, start:start + n]
        return full, self.alloc.full_to_swa[full]

    def row_of(self, request_id: Hashable) -> int:
        """The request's row (for ``alloc``'s queries and page tables)."""
        return self._row(request_id, "row_of")

    def num_computed_tokens(self, request_id: Hashable) -> int:
        """Computed tokens as this facade last recorded them."""
        return self._computed[self._known(request_id, "num_computed_tokens")]

    def num_allocated_tokens(self, request_id: Hashable) -> int:
        """Positions the request holds once the recorded step has run."""
        row = self._known(request_id, "num_allocated_tokens")
        if self._slot_gen[row] != self._gen:
            return self.alloc.seq_len(row)
        slot = self._slot_idx[row]
        kind = int(self._s_kind[slot])
        base = (int(self._s_hit[slot]) if kind == _ADMIT_ON else 0 if kind == _ADMIT
                else self.alloc.seq_len(row))
        trim = int(self._s_trim[slot])
        return trim if trim >= 0 else base + int(self._s_n[slot])

    def free_pages(self, pool: str, *, with_cache: bool = False) -> int:
        """Pages of ``pool`` free once the recorded step has run (``with_cache``: the
        cache's evictable blocks counted as free). The planner's dry runs, cached per
        version of the records."""
        extra, key = self._frees_extra()
        return self.pending.free_pages(pool, with_cache=with_cache, extra=extra,
                                       extra_key=key) - self._need

    def get_num_free_blocks(self) -> int:
        """Free blocks in the scarcer group once the recorded step has run, the cache's
        evictable blocks included (with caching)."""
        c = self.prefix_cache is not None
        return min(self.free_pages("full", with_cache=c), self.free_pages("swa", with_cache=c))

    @property
    def usage(self) -> float:
        """KV-cache usage in [0, 1], of the fuller group, counting recorded work (the
        cache's evictable blocks count as free)."""
        cfg, c = self.alloc.config, self.prefix_cache is not None
        return max(1 - self.free_pages("full", with_cache=c) / cfg.num_full_pages,
                   1 - self.free_pages("swa", with_cache=c) / cfg.num_swa_pages)

    @property
    def pending_work(self) -> bool:
        """Whether :meth:`run_step` has anything to run."""
        return bool(self.pending) or bool(self._slot_arrays())

    @property
    def cache_steps(self) -> int:
        """Steps the cache ran outside the iterations' steps (a handle freed for an insert
        when every handle was held)."""
        return self.pending.cache_steps

    def prefix_cache_stats(self) -> dict:
        """``requests`` looked up, ``queries`` (their tokens) and ``hits`` (cached tokens
        found), as vLLM's ``PrefixCacheStats``; ``hit_rate`` = hits / queries."""
        out = dict(self._stats)
        out["hit_rate"] = out["hits"] / out["queries"] if out["queries"] else 0.0
        return out

    def __contains__(self, request_id: Hashable) -> bool:
        return self._lookup(request_id, "contains") is not None

    def __len__(self) -> int:
        return len(self._rows)

    # ---- internals ---------------------------------------------------------------------
    def _request_keys(self, request_id, salt, extra_keys, block_hashes, what: str):
        """The request's kept block keys (made on first use with its namespace), or the
        engine's ``block_hashes`` (a list) when given; a call naming another salt or extra
        keys than the kept keys were made with is refused."""
        if block_hashes is not None:
            if type(block_hashes) is not list:
                raise ContractError(f"{what}({request_id!r}): block_hashes must be the list of "
                                    f"the request's block hashes, got "
                                    f"{type(block_hashes).__name__}")
            return block_hashes
        keys = self._keys.get(request_id)
        if keys is None:
            keys = self._keys[request_id] = RequestKeys(self.block_size, salt=salt,
                                                        extra_keys=extra_keys,
                                                        key_hash=self.prefix_cache.key_hash)
        elif not keys.same_namespace(salt, extra_keys):
            raise ContractError(f"{what}({request_id!r}): cache_salt / extra_keys differ from "
                                "the ones the request's block keys were made with; a request "
                                "keeps its salt for life")
        return keys

    def _match(self, cache, tokens: list, keys):
        if type(keys) is list:  # the engine's hashes: the blocks of tokens, as they are
            return cache.match(keys=keys[:len(tokens) // self.block_size])
        return cache.match(tokens, keys=keys.keys, salt=keys.salt, extra_keys=keys.extra_keys)

    def _insert(self, row: int, token_ids, keys) -> int:
        tokens = token_ids if type(token_ids) is list else list(token_ids)
        if type(keys) is list:
            return self.pending.insert(row, keys=keys[:len(tokens) // self.block_size])
        return self.pending.insert(row, tokens, keys=keys.keys, salt=keys.salt,
                                   extra_keys=keys.extra_keys)

    def _lookup(self, request_id, what: str):
        try:
            return self._rows.get(request_id)
        except TypeError:
            raise _unhashable(request_id, what) from None

    def _known(self, request_id, what: str) -> int:
        row = self._lookup(request_id, what)
        if row is None:
            raise UnknownRequestError(f"{what}({request_id!r}): the request holds no KV cache "
                                      "here (never allocated, or freed)")
        return row

    def _row(self, request_id, what: str) -> int:
        row = self._known(request_id, what)
        if self._new[row]:
            raise PendingStepError(f"{what}({request_id!r}): the request is admitted by the "
                                   "next step; call run_step() first")
        return row

    def _free_floor(self) -> int:
        """min over pools of the free pages now (frees only add: a sufficient bound)."""
        steps = self._pipeline.steps_run
        if self._floor_key != steps:
            led = self.ledger
            self._floor_key = steps
            self._floor = min(led.full.n_free, led.swa.n_free)
        return self._floor

    def _fits(self, need: int, extra=None) -> bool:
        """Whether ``need`` pages per pool fit once the recorded frees (and the slots' own
        window floors and trims, or ``extra`` instead) ran, counting the cache's evictable
        pages. Three tiers, each a sufficient condition for the next (frees only add
        pages): the free pages now; after the recorded frees and the cache (one dry run per
        version of the records); only then with the slots' floors and trims too (a dry run
        per call: the pools are about to be short)."""
        if need <= self._free_floor():
            return True
        c = self.prefix_cache is not None
        pend = self.pending
        if need <= min(pend.free_pages("full", with_cache=c),
                       pend.free_pages("swa", with_cache=c)):
            return True
        if extra is None:
            extra, key = self._frees_extra()
        else:
            key = ("call", self._slot_frees, object())  # a one-off: never cached
        return need <= min(pend.free_pages("full", with_cache=c, extra=extra, extra_key=key),
                           pend.free_pages("swa", with_cache=c, extra=extra, extra_key=key))

    def _frees_extra(self):
        return self._slot_frees_arrays(), ("slots", self._gen, self._slot_frees)

    def _slot_frees_arrays(self, skip: int = -1) -> dict:
        """The slots' window floors and trims (slot ``skip`` left out), as Step frees."""
        n = self._n
        rows, floor, trim = self._s_row[:n], self._s_floor[:n], self._s_trim[:n]
        out = {}
        for kind, values in (("advance", floor), ("trim", trim)):
            m = values >= 0
            if 0 <= skip < n:
                m[skip] = False
            if np.count_nonzero(m):
                out[kind] = (rows[m], values[m])
        return out

    def _slot_arrays(self) -> dict:
        """This iteration's slots as the Step's arrays (a few numpy masks)."""
        n = self._n
        if not n:
            return {}
        rows, ext, kind = self._s_row[:n], self._s_n[:n], self._s_kind[:n]
        out = self._slot_frees_arrays()
        m = ext > 0
        k = np.count_nonzero(m)
        if k == n:
            out["extend"] = (rows, ext)
        elif k:
            out["extend"] = (rows[m], ext[m])
        if self._reserved:
            m = kind == _ADMIT
            if np.count_nonzero(m):
                out["admit"] = rows[m]
            m = kind == _ADMIT_ON
            if np.count_nonzero(m):
                out["admit_on"] = (rows[m], self._s_h[:n][m], self._s_hit[:n][m])
        return out

    def _kill_slot(self, row: int) -> None:
        if self._slot_gen[row] != self._gen:
            return
        slot = self._slot_idx[row]
        n, kind = int(self._s_n[slot]), int(self._s_kind[slot])
        self._need -= int(self._s_pages[slot])
        self._n_rows -= (n > 0) + (kind == _ADMIT_ON)
        self._n_tokens -= n
        if self._s_floor[slot] >= 0 or self._s_trim[slot] >= 0:
            self._slot_frees += 1
        self._s_n[slot] = self._s_pages[slot] = 0
        self._s_floor[slot] = self._s_trim[slot] = -1
        self._s_kind[slot] = _DEAD
        self._slot_gen[row] = 0

    def _next_iteration(self) -> None:
        for row in self._reserved:
            self._new[row] = False
        self._reserved.clear()
        self._gen += 1
        n, self._n = self._n, 0
        if n:  # the slots' defaults back (see __init__)
            self._s_floor[:n] = -1
            self._s_trim[:n] = -1
            self._s_kind[:n] = _RUNNING
            self._s_pages[:n] = 0
        self._need = self._n_rows = self._n_tokens = 0
        hits, self._hits = self._hits, {}
        for handle in hits.values():  # the hits were admitted on, or abandoned
            self.prefix_cache.unlock(handle)

    def _take_hit(self, request_id, n_hit: int, blocks) -> int:
        """The cache handle of a hit passed to ``allocate_slots`` (-1: no hit)."""
        if not n_hit and (blocks is None or not blocks.num_blocks):
            return -1
        handle = self._hits.get(request_id)
        if (handle is None or not isinstance(blocks, GraphallocBlocks)
                or blocks.handle != handle or blocks.request_id != request_id):
            raise ContractError(
                f"allocate_slots({request_id!r}): a prefix-cache hit must be the one "
                "get_computed_blocks() returned for this new request in this iteration")
        if n_hit != blocks.num_blocks * self.block_size:
            raise ContractError(f"allocate_slots({request_id!r}): num_new_computed_tokens "
                                f"{n_hit} but the hit has {blocks.num_blocks} blocks of "
                                f"{self.block_size}: take the whole hit")
        return handle

    def _drop_hit(self, request_id) -> None:
        handle = self._hits.pop(request_id, None)
        if handle is not None:
            self.prefix_cache.unlock(handle)


def _append(pair, row: int, value: int):
    one = (np.array([row], dtype=np.int64), np.array([value], dtype=np.int64))
    if pair is None:
        return one
    return np.concatenate([pair[0], one[0]]), np.concatenate([pair[1], one[1]])
