"""A vLLM-v1 ``KVCacheManager``-shaped facade, one graphalloc step per ``schedule()``.

vLLM's scheduler, per ``schedule()``: for each running request
``allocate_slots(request, num_new_tokens, num_lookahead_tokens=...)``, and on ``None``
preempts the lowest-priority running request (``free(request)``) and retries; then for
each waiting request ``get_computed_blocks(request)`` (the prefix-cache lookup) and
``allocate_slots(...)``, stopping at the first ``None``. After the forward,
``update_from_output`` frees each finished request with ``free(request)``. With a
hybrid model its KV cache has one group per attention type (here FULL = 0 and
SWA = 1); the sliding-window manager replaces the blocks that fell out of the window
by the null block (id 0) and frees them, before it allocates.

:class:`GraphallocKVCacheManager` answers the same calls, per call and O(1) on the
host (pages accounted as :mod:`.iteration` explains), and records them;
:meth:`GraphallocKVCacheManager.run_step` -- one line the engine adds at the end of
``schedule()`` -- runs everything recorded since the last one (the previous
iteration's frees, this one's preemptions, window removals and allocations) as ONE
:meth:`HybridAllocator.step`.

Request ids are any hashable (dict keys, so ids equal under ``==`` -- ``1``, ``1.0``,
``True`` -- are ONE request); each live id maps to a request row.

Lookahead (speculative tokens): a call makes the request's allocation cover
``min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, max_model_len)``
positions and only allocates what is missing. Slots of rejected speculative tokens
stay with the request and are reused by its next tokens. vLLM's scheduler lowers
``request.num_computed_tokens`` by the rejected tokens: pass it as
``num_computed_tokens=`` (without it the facade assumes every scheduled token was
computed). When the new target is a whole page or more below what the request holds
(fewer lookahead tokens, a smaller chunk, rejected tokens), the pages wholly past the
target are given back in the step (the allocator's ``trim``: the request is cut to the
target, a partial page stays); a trim the frontier forbids (below ``frontier +
sliding_window``) is skipped and the slots stay.

Block ids: graphalloc's page ids live in device tables (its public host queries give
counts and positions, not ids), so :meth:`GraphallocKVCacheManager.get_block_ids`
READS THE DEVICE: one device-to-host copy per group, which waits for every queued
step (a synchronisation). It is the inspection and debugging path (a public host
query of a row's page ids would make it sync-free). The hot path never needs
ids on the host: the model writes KV to :meth:`~GraphallocKVCacheManager.token_slots`
(device views) and reads block tables from :class:`graphalloc.attention.page_tables.PageTables`
(``block_table[B, max_pages]`` in vLLM's layout, null block 0 outside the window,
written on the device in the step). ``allocate_slots`` returns block *positions*
(which block indices are new, known on the host); ``GraphallocBlocks.get_block_ids``
reads their ids the same way.

Launches per iteration. vLLM's ``KVCacheManager`` is host Python (block objects and
lists, O(blocks touched) per call); the device work is the worker's upload of the
changed block-table rows (one host-to-device copy per group) and the slot-mapping
computation. Here: ONE graphalloc step writes ``req_to_token``/``full_to_swa`` (one
fused kernel, or one graph replay with ``executor="graph"``), no host/device
synchronisation; page tables add one kernel (or ride in the engine's graph).

Prefix caching (``enable_caching=True``, on an allocator built with
``HybridAllocator(cfg, prefix_cache=True)``), from vLLM's documented semantics:

* ``get_computed_blocks(request_id, token_ids)``: the longest cached prefix of whole
  blocks, at most ``len(token_ids) - 1`` tokens (the last prompt token is always
  recomputed, so the forward has a query), for both groups at once: a hit counts only
  where the sliding-window blocks of its last ``sliding_window`` tokens are cached too
  (vLLM's hybrid coordinator: the length every group can serve). Returns the blocks
  ``[0, n)`` (a :class:`GraphallocBlocks` naming the cache entry) and ``n * block_size``
  computed tokens; the entry is locked until the next :meth:`run_step`.
* ``allocate_slots(..., num_new_computed_tokens=, new_computed_blocks=)`` takes that hit
  for a new request: the next step admits it sharing the blocks
  (``admit(handle=, n_tokens=)``, its ``req_to_token`` written on the device) and
  allocates only what follows ``num_new_computed_tokens``.
* ``cache_blocks(request_id, token_ids)`` caches the request's full blocks so far (vLLM
  caches blocks as they fill; here a new entry is a step, so the engine calls it where a
  prefix is worth keeping with its window, e.g. when a prompt's prefill completed).
* ``free(request_id, token_ids)`` puts the request's full blocks of ``token_ids`` (its
  computed tokens: ``all_token_ids[:num_computed_tokens]``) into the cache -- one step
  when the entry is new, at the call -- and then frees the request: blocks the cache
  references stay, the rest (a partial last block, blocks an equal entry holds already)
  are freed with the next step. A preempted request freed this way finds its own blocks
  when it is scheduled again.
* ``get_num_free_blocks()`` / ``usage`` count the cache's evictable blocks as free (as
  vLLM's free-block queue holds its cached blocks); an allocation that needs them evicts
  them itself, inside the step (SWA blocks of cached prefixes first, then whole entries,
  LRU).

Covers: ``allocate_slots`` (chunked prefill, decode, lookahead, sliding-window removal
before allocation, ``None`` = back-pressure with nothing changed), ``free``,
``get_block_ids`` per group, ``get_computed_blocks`` (prefix caching as above, or vLLM's
answer with caching disabled), hashable request ids, free-block and usage queries,
prefix-cache hit statistics.

Does not cover: KV connectors / external computed tokens, encoder (cross-attention)
tokens, ``delay_cache_blocks``, watermarks, cascade attention's common-prefix query, KV
events, more than two groups or per-group block sizes, ring mode; a cache hit's
out-of-window blocks are dropped by the request's next ``allocate_slots`` (not on the
admitting one); blocks are cached at ``cache_blocks`` and ``free``, not as they fill. Unlike
vLLM, a call that returns ``None`` does not free the request's out-of-window blocks
either (nothing changes); the next successful call does.

What an engine must still write: the ``run_step()`` call after the scheduling loop;
the slot mapping and attention metadata from :meth:`token_slots` /
:meth:`row_of` + ``PageTables`` instead of block ids; ``num_computed_tokens=`` under
speculative decoding; with caching, the token ids for ``get_computed_blocks`` and
``free``; ``alloc.check()`` where it synchronises anyway.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable

import numpy as np

from ..allocator import AllocResult, HybridAllocator
from ..diagnostics.sync_points import sync_allowed
from ..errors import ConfigError, ContractError, PendingStepError, PositionError
from .iteration import IterationStep

__all__ = ["GraphallocKVCacheManager", "GraphallocBlocks", "FULL_GROUP", "SWA_GROUP",
           "NULL_BLOCK_ID"]

FULL_GROUP = 0  # index of the full-attention KV-cache group in block-id tuples
SWA_GROUP = 1  # index of the sliding-window group
NULL_BLOCK_ID = 0  # the null block: graphalloc's sink page 0, never allocated


def _count(value, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or (
            value < 0):
        raise ContractError(f"{name} must be an int >= 0, got {value!r}")
    return int(value)


@dataclasses.dataclass(eq=False)
class GraphallocBlocks:
    """``KVCacheBlocks``-shaped answer of ``allocate_slots`` (the request's new blocks) and
    of ``get_computed_blocks`` (its cached blocks, ``handle`` naming the cache entry):
    block indices ``[first_block, first_block + num_blocks)`` of its table, in each group
    (FULL and SWA the same count). Host ints; the ids need a device read
    (:meth:`get_block_ids`)."""

    request_id: Hashable
    first_block: int
    num_blocks: int
    manager: GraphallocKVCacheManager = dataclasses.field(repr=False)
    handle: int = -1  # a prefix-cache hit: the entry's handle (get_computed_blocks)

    def get_block_ids(self) -> tuple[list[int], list[int]]:
        """The new blocks' ids per group, ``(FULL, SWA)``: a DEVICE READ (synchronises),
        after :meth:`GraphallocKVCacheManager.run_step`. For inspection and tests."""
        if not self.num_blocks:
            return [], []
        if self.handle >= 0 and self.request_id not in self.manager:  # a hit not yet admitted
            return self.manager._handle_block_ids(  # noqa: SLF001 (same module)
                self.handle, self.num_blocks)
        full, swa = self.manager.get_block_ids(self.request_id)
        end = self.first_block + self.num_blocks
        return full[self.first_block:end], swa[self.first_block:end]


class GraphallocKVCacheManager:
    """vLLM ``KVCacheManager`` calls over a pool-mode :class:`HybridAllocator`.

    Args:
        alloc: the allocator (pool mode). ``sliding_window`` is the allocator's window,
            ``W_model - 1`` (``AllocatorConfig.for_engine`` converts the model's); the
            blocks wholly below ``num_computed_tokens - sliding_window`` are removed,
            vLLM's ``max(0, num_computed_tokens - W_model + 1)`` skipped tokens.
            ``max_reqs`` must cover the running requests plus one iteration's frees.
        enable_caching: prefix caching (needs ``HybridAllocator(cfg, prefix_cache=True)``;
            see the module docstring).

    Invariants: each live request id owns one row (a request new in this iteration owns
    one once :meth:`run_step` admitted it); recorded work belongs to the next
    :meth:`run_step`; a ``None`` answer changed nothing; a hit stays locked until the
    next :meth:`run_step`. Cost: ``allocate_slots`` and ``free`` are host work only, no
    plan, no device work: O(1) without prefix handles, O(pages the call frees) with them
    (shared pages counted by reference, incrementally; a step that ran or a changed cache
    recounts once). Measured on a CPU, 256 decoding requests, page size 16: about 25 us
    per ``allocate_slots`` and 9 us per ``free`` without handles, 33 us and 41 us with a
    prefix cache. ``free`` with token ids adds the cache insert (a step when the entry is
    new); ``run_step`` is one step.
    """

    def __init__(self, alloc: HybridAllocator, *, enable_caching: bool = False):
        self.pending = IterationStep(alloc, "GraphallocKVCacheManager")
        if not isinstance(enable_caching, bool):
            raise ConfigError(f"enable_caching must be a bool, got {enable_caching!r}")
        if enable_caching and alloc.prefix_cache is None:
            raise ConfigError("enable_caching=True needs an allocator with a prefix cache: "
                              "HybridAllocator(cfg, prefix_cache=True) (pool mode, "
                              "max_handles > 0)")
        self.alloc = alloc
        self.block_size = alloc.config.page_size
        self.sliding_window = alloc.config.sliding_window
        self.max_model_len = alloc.config.max_context_len
        self.enable_caching = enable_caching
        self.prefix_cache = alloc.prefix_cache if enable_caching else None
        self.steps_last_run = 0
        self.cache_steps = 0  # steps the cache ran at free() (new entries' handles)
        self._rows: dict[Hashable, int] = {}  # id -> row (>= 0) or a key (< 0) until admitted
        self._computed: dict[Hashable, int] = {}
        self._hits: dict[Hashable, int] = {}  # id -> locked cache handle, until run_step
        self._stats = {"requests": 0, "queries": 0, "hits": 0}

    # ---- the scheduler's calls ---------------------------------------------------------
    def get_computed_blocks(self, request_id: Hashable, token_ids=None
                            ) -> tuple[GraphallocBlocks, int]:
        """The request's cached blocks and computed tokens, ``(blocks, n_tokens)``.

        With caching and ``token_ids`` (the request's ``all_token_ids``): the longest
        cached whole-block prefix of ``token_ids[:-1]`` (the last token is recomputed)
        whose sliding-window blocks are cached too; the entry is locked until the next
        :meth:`run_step` (a later call for the same request replaces it). A hit whose
        blocks this iteration's recorded allocations need (they would evict them) is
        reported as a miss, as vLLM would have evicted those blocks already. Otherwise
        ``(no blocks, 0)``, vLLM's answer with caching disabled. For a request not yet
        holding KV here (waiting: new or preempted). Host only: O(prompt blocks)
        hashing."""
        cache = self.prefix_cache
        if cache is None or token_ids is None:
            return GraphallocBlocks(request_id, 0, 0, self), 0
        if request_id in self._rows:
            raise ContractError(f"get_computed_blocks({request_id!r}): the request holds KV "
                                "here already; look up waiting requests only")
        tokens = list(token_ids)
        self._drop_hit(request_id)
        hit = cache.match(tokens[:max(len(tokens) - 1, 0)])
        if hit.cached_tokens:
            cache.lock(hit.handle)
            if not self.pending.fits():  # this iteration's allocations need those blocks
                cache.unlock(hit.handle)  # (vLLM would have evicted them for them already)
                hit = dataclasses.replace(hit, cached_tokens=0)
        self._stats["requests"] += 1
        self._stats["queries"] += len(tokens)
        self._stats["hits"] += hit.cached_tokens
        if not hit.cached_tokens:
            return GraphallocBlocks(request_id, 0, 0, self), 0
        self._hits[request_id] = hit.handle
        n_blocks = hit.cached_tokens // self.block_size
        return GraphallocBlocks(request_id, 0, n_blocks, self, hit.handle), hit.cached_tokens

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
        ``new_computed_blocks``: a new request's prefix-cache hit, as
        :meth:`get_computed_blocks` returned it in this iteration (all of it): the step
        admits the request on those blocks and it holds ``num_computed_tokens +
        num_new_computed_tokens + num_new_tokens + num_lookahead_tokens`` positions.
        Returns the new blocks' positions, or ``None`` when either pool or the request rows
        are short (the cache's evictable blocks count as free): back-pressure, nothing
        changed. A second call for the same request in one iteration replaces the first.
        Raises (nothing changed) on ``num_new_tokens < 1`` (as vLLM), on a hit that is not
        this request's from this iteration, and on a batch over the frozen shape.
        """
        n_new = _count(num_new_tokens, "num_new_tokens")
        lookahead = _count(num_lookahead_tokens, "num_lookahead_tokens")
        if n_new < 1:
            raise ContractError("num_new_tokens must be greater than 0")
        n_hit = _count(num_new_computed_tokens, "num_new_computed_tokens")
        row = self._rows.get(request_id)
        handle = self._take_hit(request_id, row, n_hit, new_computed_blocks)
        computed = _count(self._computed.get(request_id, 0) if num_computed_tokens is None
                          else num_computed_tokens, "num_computed_tokens")
        if handle is not None:
            if computed:
                raise PositionError(f"request {request_id!r}: a new request with a cache hit "
                                    f"has no computed tokens of its own, got {computed}")
            computed = n_hit
        length = (n_hit if row is None else self.alloc.seq_len(row) if row >= 0
                  else self.pending.admits[row][1])  # before this iteration's records
        if computed > length:
            raise PositionError(f"request {request_id!r}: {computed} computed tokens but "
                                f"{length} allocated; computed tokens must have slots")
        if computed + n_new > self.max_model_len:
            raise PositionError(f"request {request_id!r}: {computed} + {n_new} tokens exceed "
                                f"max_model_len {self.max_model_len}")
        target = min(computed + n_new + lookahead, self.max_model_len)
        floor = max(computed - self.sliding_window, 0) // self.block_size * self.block_size
        if row is None:
            item = (None, target, None) if handle is None else (None, target, None, handle,
                                                                n_hit)
        else:
            item = (row, target, floor if row >= 0 else None)
        keys = self.pending.reserve([item], trim=True)
        if keys is None:
            return None
        self._rows[request_id] = keys[0]
        self._computed[request_id] = computed + n_new
        ps = self.block_size
        first = -(-length // ps)
        return GraphallocBlocks(request_id, first, -(-max(target, length) // ps) - first, self)

    def free(self, request_id: Hashable, token_ids=None) -> None:
        """Free everything the request holds (finished or preempted); recorded for the
        next step, its pages count as free at once. An unknown id is a no-op (as vLLM).
        A request freed in the same iteration as its ``allocate_slots`` loses that
        allocation (a request new in this iteration is never admitted).

        With caching and ``token_ids`` (its computed tokens,
        ``all_token_ids[:num_computed_tokens]``), the request's full blocks of them are
        put into the prefix cache first (one step when the entry is new, at this call):
        those stay cached, the rest is freed."""
        self._drop_hit(request_id)
        row = self._rows.pop(request_id, None)
        if row is None:
            return
        self._computed.pop(request_id, None)
        if row >= 0 and token_ids is not None and self.prefix_cache is not None:
            before = self.alloc.steps_run
            self.prefix_cache.insert(row, list(token_ids))
            self.cache_steps += self.alloc.steps_run - before
        self.pending.release(row)

    def cache_blocks(self, request_id: Hashable, token_ids) -> int:
        """vLLM's ``cache_blocks``: put the request's full blocks of ``token_ids`` (tokens
        whose KV is computed, ``all_token_ids[:num_computed_tokens]``) into the prefix
        cache now, while the request runs on. vLLM caches blocks as they fill; here a new
        entry is a step of its own (the handle's prefix copy), so call it where a prefix
        is worth keeping with its window -- typically when a prompt's prefill completed
        (a shared system prompt), since blocks that left the window are not cached.
        Returns the tokens cached (0 without caching)."""
        if self.prefix_cache is None:
            return 0
        row = self._row(request_id)
        before = self.alloc.steps_run
        n = self.prefix_cache.insert(row, list(token_ids))
        self.cache_steps += self.alloc.steps_run - before
        return n

    def run_step(self) -> AllocResult | None:
        """Run everything recorded as ONE step (more only when the recorded frees exceed
        the frozen release shape; ``steps_last_run`` says). Call once per ``schedule()``,
        after its loop, before the forward. Returns the new slots (lanes: the requests in
        the order they were allocated; ``None`` when nothing was allocated). Never
        synchronises."""
        result, self.steps_last_run = self.pending.run()
        if self.pending.admitted:
            for rid, key in self._rows.items():
                if key < 0:
                    self._rows[rid] = self.pending.admitted[key]
        hits, self._hits = self._hits, {}
        for handle in hits.values():  # the hits were admitted on, or abandoned
            self.prefix_cache.unlock(handle)
        return result

    # ---- queries -----------------------------------------------------------------------
    def get_block_ids(self, request_id: Hashable) -> tuple[list[int], list[int]]:
        """The request's block ids per group, ``(FULL, SWA)``, ``ceil(L / block_size)``
        each; SWA ids of removed blocks are ``NULL_BLOCK_ID``. A DEVICE READ (one copy per
        group, synchronises): inspection and debugging only. ``([], [])`` for an unknown
        id. Refused while the request has recorded work (call :meth:`run_step`)."""
        row = self._rows.get(request_id)
        if row is None:
            return [], []
        if row < 0 or row in self.pending.extends or row in self.pending.advances:
            raise PendingStepError(f"get_block_ids({request_id!r}): the request has work "
                                   "recorded for the next step; call run_step() first")
        full, swa = self._block_ids(self.alloc.req_to_token[row],
                                    -(-self.alloc.seq_len(row) // self.block_size))
        removed = self.alloc.frontier(row) // self.block_size  # shared pages may be mapped
        return full, [NULL_BLOCK_ID] * removed + swa[removed:]

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
        row = self._row(request_id)
        start, n = _count(start_pos, "start_pos"), _count(n_tokens, "n_tokens")
        if start + n > self.alloc.seq_len(row):
            raise PositionError(f"token_slots({request_id!r}): positions [{start}, "
                                f"{start + n}) but {self.alloc.seq_len(row)} are allocated "
                                "by the steps run so far (run_step() first)")
        full = self.alloc.req_to_token[row, start:start + n]
        return full, self.alloc.full_to_swa[full]

    def row_of(self, request_id: Hashable) -> int:
        """The request's row (for ``PageTables.plan`` and ``alloc``'s queries)."""
        return self._row(request_id)

    def num_computed_tokens(self, request_id: Hashable) -> int:
        """Computed tokens as this facade last recorded them."""
        self._row(request_id)
        return self._computed[request_id]

    def num_allocated_tokens(self, request_id: Hashable) -> int:
        """Positions the request holds once the recorded step has run."""
        if request_id not in self._rows:
            self._row(request_id)  # raises: unknown
        return self.pending.length(self._rows[request_id])

    def get_num_free_blocks(self) -> int:
        """Free blocks in the scarcer group once the recorded step has run, the cache's
        evictable blocks included (with caching). O(1) without prefix handles."""
        c = self.prefix_cache is not None
        return min(self.pending.free_pages("full", with_cache=c),
                   self.pending.free_pages("swa", with_cache=c))

    @property
    def usage(self) -> float:
        """KV-cache usage in [0, 1], of the fuller group, counting recorded work (the
        cache's evictable blocks count as free)."""
        cfg, c = self.alloc.config, self.prefix_cache is not None
        return max(1 - self.pending.free_pages("full", with_cache=c) / cfg.num_full_pages,
                   1 - self.pending.free_pages("swa", with_cache=c) / cfg.num_swa_pages)

    def prefix_cache_stats(self) -> dict:
        """``requests`` looked up, ``queries`` (their tokens) and ``hits`` (cached tokens
        found), as vLLM's ``PrefixCacheStats``; ``hit_rate`` = hits / queries."""
        out = dict(self._stats)
        out["hit_rate"] = out["hits"] / out["queries"] if out["queries"] else 0.0
        return out

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def _row(self, request_id: Hashable) -> int:
        try:
            row = self._rows[request_id]
        except KeyError:
            raise ContractError(f"request {request_id!r} holds no KV cache here (never "
                                "allocated, or freed)") from None
        if row < 0:
            raise PendingStepError(f"request {request_id!r} is admitted by the next step; "
                                   "call run_step() first")
        return row

    def _take_hit(self, request_id, row, n_hit: int, blocks) -> int | None:
        """The cache handle of a hit passed to ``allocate_slots`` (``None``: no hit)."""
        if not n_hit and (blocks is None or not blocks.num_blocks):
            return None
        handle = self._hits.get(request_id)
        if (row is not None or handle is None or blocks is None or blocks.handle != handle
                or blocks.request_id != request_id):
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
