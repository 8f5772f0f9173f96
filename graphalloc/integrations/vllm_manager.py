"""graphalloc as vLLM's ``KVCacheManager``: vLLM's calls, vLLM's counts, ONE step per schedule().

Contract. :class:`GraphallocKVCacheManager` takes vLLM 0.33's ``KVCacheManager``
constructor arguments and answers every call its v1 ``Scheduler`` makes, with vLLM's
argument names and return shapes (``get_computed_blocks`` -> ``(blocks, n_tokens,
shared_prefix_boundary)``, ``allocate_slots`` -> blocks or ``None``, ...); vLLM's
``Request`` comes in, :class:`~graphalloc.integrations.vllm_blocks.LazyBlocks` go out.
A per-request call only RECORDS (Python ints into lists: about 1-2 us) and answers
feasibility from host counts kept with vLLM's rule: blocks a request needs per group are
``cdiv(tokens, block_size)`` less the blocks it holds (a sliding-window group: less the
blocks below ``computed - W + 1`` too, which vLLM frees first, and capped at admission),
summed over the groups, against ONE budget of ``num_blocks - 1`` blocks shared by the groups
as vLLM's pool is, less ``reserved_blocks`` and the watermark; ``full_sequence_must_fit``
checks the whole prompt first. ``None`` means short, nothing recorded.

The first block id read in an iteration (vLLM reads them after its scheduling loop)
runs :meth:`flush`: the recorded takes, releases, window moves, admits and extends as ONE
``alloc.plan`` + ``alloc.run``; ids then come from the host's page mirror, the pages the
step writes. graphalloc's pools: FULL ``num_blocks - 1`` pages, SWA as many with a
sliding-window group (twice as many, bookkeeping only, without one), so any split of the
shared budget fits both (the budget, not the pools, decides admission). A Mamba group
("none" mode) is budgeted as vLLM does and realised by graphalloc's state slots.

Prefix caching keys graphalloc's :class:`~graphalloc.sharing.prefix_cache.PrefixCache`
with vLLM's own ``request.block_hashes`` (cache salt, LoRA and multimodal extra keys are
in them: tenants never share KV; nothing is hashed again). A request's cached blocks
become its cache entry (a ``take``) in the first step where their pages exist; a hit is
admitted on the entry (``admit_on``). A lookup reaching blocks filled in the current
``schedule()`` plans the iteration and a take step first, so they are hittable in the
step that fills them, as in vLLM (two more steps in that iteration). Budget with caching:
pages held only by the cache count as free (vLLM's evictable blocks); the planner evicts
whole entries when a step is short, where vLLM evicts single blocks (docs/vllm.md).
Not supported (``ConfigError`` at construction): Mamba "align" mode, cross-attention,
chunked local groups, unequal block sizes, DCP/PCP, KV events; KV connectors' async loads
(``delay_cache_blocks``) raise. Cost: see each method; :meth:`flush` is one plan, O(rows).
The step and block ids are :mod:`~graphalloc.integrations.vllm_iteration`, the cache
entries :mod:`~graphalloc.integrations.vllm_cache_entries` (mixins over this state).
"""

from __future__ import annotations

import numpy as np

from ..allocator import HybridAllocator
from ..config import AllocatorConfig
from ..errors import ConfigError, ContractError
from ..plan.accumulator import StepAccumulator
from .vllm_blocks import LazyBlocks
from .vllm_cache_entries import CacheEntries
from .vllm_iteration import IterationPlan

__all__ = ["GraphallocKVCacheManager"]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _CoordinatorView:
    """The two coordinator attributes vLLM's scheduler reads directly."""

    enable_partial_hash_hits = False
    single_type_managers = ()

    def __init__(self, manager):
        self._manager = manager

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks=(),
                                   **_ignored) -> int:
        return self._manager.blocks_to_allocate(request_id, num_tokens)


class GraphallocKVCacheManager(IterationPlan, CacheEntries):
    """vLLM's ``KVCacheManager`` over a pool-mode :class:`HybridAllocator` (see module).

    Beyond vLLM's constructor arguments: ``max_num_seqs`` (request rows: twice it, so an
    iteration's new requests never wait on its releases), ``max_num_batched_tokens`` and
    ``num_lookahead_tokens`` (the step shape). ``alloc`` is the allocator built here."""

    def __init__(self, kv_cache_config, max_model_len: int, scheduler_block_size: int,
                 hash_block_size: int, max_in_flight_tokens: int | None = None,
                 enable_caching: bool = True, use_eagle: bool = False,
                 num_hash_lookahead_tokens: int = 0, num_prefill_lookahead: int = 0,
                 log_stats: bool = False, enable_kv_cache_events: bool = False,
                 dcp_world_size: int = 1, pcp_world_size: int = 1, metrics_collector=None,
                 watermark: float = 0.0, enable_mamba_shared_prefix_checkpoint: bool = False,
                 *, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 num_lookahead_tokens: int = 0):
        from vllm.v1.request import RequestStatus  # vLLM is there when vLLM builds us

        groups = kv_cache_config.kv_cache_groups
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        for group, kind in zip(groups, kinds, strict=True):
            spec = group.kv_cache_spec
            if kind not in ("FullAttentionSpec", "SlidingWindowSpec", "MambaSpec"):
                raise ConfigError(f"GraphallocKVCacheManager: KV-cache group of {kind} is not "
                                  "supported (full attention, sliding window, Mamba are)")
            if spec.block_size != scheduler_block_size:
                raise ConfigError("GraphallocKVCacheManager: every group's block_size must "
                                  f"be the scheduler's {scheduler_block_size}")
            if kind == "MambaSpec" and (spec.mamba_cache_mode != "none"
                                        or spec.num_speculative_blocks):
                raise ConfigError("GraphallocKVCacheManager: a Mamba group needs "
                                  "mamba_cache_mode='none' and no speculative blocks")
        if kinds[0] != "FullAttentionSpec" or len(kinds) > 2 or (
                len(kinds) == 2 and kinds[1] == "FullAttentionSpec"):
            raise ConfigError("GraphallocKVCacheManager: groups must be [full], [full, sliding "
                              f"window] or [full, Mamba], got {kinds}")
        # The second group frees its blocks below ``computed - W + 1``: a sliding window W,
        # or Mamba, which keeps only the last token's state (vLLM skips computed - 1: W = 2)
        second = kinds[1] if len(kinds) == 2 else None
        swa = [groups[1].kv_cache_spec.sliding_window] if second == "SlidingWindowSpec" else []
        self.mamba = second == "MambaSpec"
        if dcp_world_size != 1 or pcp_world_size != 1 or enable_kv_cache_events:
            raise ConfigError("GraphallocKVCacheManager: DCP/PCP and KV events are not "
                              "supported")
        if hash_block_size != scheduler_block_size:
            raise ConfigError("GraphallocKVCacheManager: hash_block_size must equal the "
                              "block size")
        self.kv_cache_config = kv_cache_config
        self.num_kv_cache_groups = len(groups)
        self.swa_group = 1 if second else -1  # the windowed group (its blocks go null)
        self.window = swa[0] if swa else (2 if self.mamba else 0)
        bs = self.block_size = scheduler_block_size
        self.max_model_len = max_model_len
        self.enable_caching, self.log_stats = enable_caching, log_stats
        self.enable_kv_cache_events = False
        self.use_eagle = use_eagle
        self.mamba_shared_prefix_checkpoint = False
        self.coordinator = _CoordinatorView(self)
        self.block_pool = None  # vLLM's pool: connectors' deferred frees only (unsupported)
        self._waiting = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        n_blocks = kv_cache_config.num_blocks - 1  # block 0 is vLLM's null block
        self.total_blocks = n_blocks
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        in_flight = max_in_flight_tokens if max_in_flight_tokens is not None else max_model_len
        self._swa_cap = None
        if swa:  # vLLM caps only recycling attention groups at admission, not Mamba
            self._swa_cap = groups[1].kv_cache_spec.max_admission_blocks_per_request(
                in_flight, max_model_len)
        rows = 2 * max_num_seqs
        step_tokens = max(max_num_batched_tokens + rows * (num_lookahead_tokens + bs),
                          max_model_len)
        # Without a sliding-window group graphalloc's SWA pool is bookkeeping only (no layer
        # reads it): twice the FULL pool, so it is never the short one and a short step
        # evicts cache entries whole instead of tombstoning their SWA pages first.
        n_swa = n_blocks if swa else 2 * n_blocks
        cfg = AllocatorConfig(
            page_size=bs, num_full_pages=n_blocks, num_swa_pages=n_swa, max_reqs=rows,
            max_context_len=max_model_len, model_window=swa[0] if swa else max_model_len,
            num_state_slots=rows if self.mamba else 0,
            max_handles=(4 * rows if enable_caching else 0), max_alloc_rows=2 * rows,
            max_tokens_per_alloc_row=max_model_len, max_step_tokens=step_tokens)
        self.alloc = HybridAllocator(cfg, prefix_cache=enable_caching)
        self.cache = self.alloc.prefix_cache
        self._refs = self.alloc.ledger.refs
        self._handle_base = cfg.max_reqs
        self.empty_kv_cache_blocks = LazyBlocks(self, None, 0, 0)
        self._no_blocks = self.empty_kv_cache_blocks  # a running request's "no new blocks"
        self._plain = self.num_kv_cache_groups == 1  # full attention only: the inline path
        self._acc = StepAccumulator(cfg)  # the step's records at flush; the free rows
        self._take_acc = StepAccumulator(cfg)  # cache-entry takes: their handles reserved
        self._row: dict[str, int] = {}  # request id -> row (live or admitted by the step)
        self._req: list = [None] * rows  # row -> the vLLM Request (caching: its hashes)
        self._len = [0] * rows  # tokens allocated once the recorded step ran
        self._skip = [0] * rows  # SWA blocks below the window (vLLM's null blocks)
        self._shared = [0] * rows  # caching: leading blocks shared with a live holder
        self._cache_to = [0] * rows  # caching: tokens vLLM caches (cache_blocks' count)
        self._cached = [0] * rows  # caching: blocks of the row's newest cache entry
        self._entry_of = [-1] * rows  # caching: the row's newest cache entry's handle
        self._due: set[int] = set()  # caching: rows with cacheable blocks not in an entry
        self._used = 0  # blocks held, all groups (vLLM's pool: total - free)
        self._filling: dict = {}  # caching: block hash -> row, cacheable, not an entry yet
        self.extra_steps = 0  # steps run for hits on blocks filled in the same schedule()
        self.takes_dropped = 0  # released rows' entries not made: they pinned needed pages
        self.split_steps = 0  # steps split in two: an admitted-on entry pinned its tail
        self._recs()
        self._row_refs = np.zeros(n_blocks + 1, dtype=np.int32) if enable_caching else None
        self.steps = 0  # graphalloc steps run
        self._stats = None
        if log_stats:
            from vllm.v1.metrics.stats import PrefixCacheStats
            self._stats_cls = PrefixCacheStats
            self._stats = PrefixCacheStats()

    def _recs(self) -> None:
        self._admit, self._on, self._rel = [], [], []
        self._ext: dict[int, int] = {}  # row -> tokens to extend by
        self._adv: dict[int, int] = {}  # row -> new SWA frontier (tokens)
        self._hits: dict[str, int] = {}  # request id -> its looked-up hit's handle
        self._locked: list[int] = []  # handles admitted on by the recorded step
        self._new_rows: set[int] = set()  # rows admitted by the recorded step
        self._dirty = False  # something is recorded: the next id read plans the step

    # ---- counts --------------------------------------------------------------------------
    @property
    def usage(self) -> float:
        """vLLM's usage: blocks in use over ``num_blocks - 1``. O(1)."""
        return self._used / self.total_blocks if self.total_blocks else 0.0

    def get_num_free_blocks(self) -> int:
        return self.total_blocks - self._used

    def blocks_to_allocate(self, request_id, num_tokens: int) -> int:
        """Blocks ``request_id`` needs to hold ``num_tokens`` (all groups). O(1)."""
        row = self._row.get(request_id)
        held = 0 if row is None else _cdiv(self._len[row], self.block_size)
        return max(_cdiv(num_tokens, self.block_size) - held, 0) * self.num_kv_cache_groups

    def _need_new(self, n_tokens: int, n_hit_blocks: int, total: int, cap: bool) -> int:
        """Blocks a request not held here needs for ``n_tokens`` after a hit of
        ``n_hit_blocks`` whole blocks, ``total`` tokens computed (vLLM's rule)."""
        req = _cdiv(n_tokens, self.block_size)
        need = max(req - n_hit_blocks, 0)
        if self.swa_group > 0:
            skipped = max(0, total - self.window + 1) // self.block_size
            r = min(req, self._swa_cap) if cap and self._swa_cap is not None else req
            need += max(r - max(skipped, n_hit_blocks), 0)
        return need

    # ---- the scheduler's calls -------------------------------------------------------------
    def new_step_starts(self) -> None:
        """vLLM calls this at the head of ``schedule()``: nothing to do. O(1)."""

    def prefix_cache_lookup_enabled(self, request) -> bool:
        return self.enable_caching and not request.skip_reading_prefix_cache

    def get_computed_blocks(self, request, max_cache_hit_length: int | None = None):
        """``(blocks, n_hit_tokens, 0)``: the longest cached whole-block prefix of the
        request's ``block_hashes`` (at most ``num_tokens - 1`` tokens) whose window is
        cached; its entry is locked until the step. O(hit blocks) dict lookups."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        if max_cache_hit_length is None:
            max_cache_hit_length = request.num_tokens - 1
        keys = request.block_hashes[:max_cache_hit_length // self.block_size]
        if not keys:
            return self.empty_kv_cache_blocks, 0, 0
        keys = list(keys)
        hit = self.cache.match(keys=keys)
        n = hit.cached_tokens
        if n // self.block_size < len(keys) and keys[n // self.block_size] in self._filling:
            # vLLM: blocks are hittable in the step that fills them. Plan what is recorded
            # (their pages), make them a cache entry, then look again: two more steps.
            self.flush()
            if self._flush_takes():
                self.extra_steps += 1
            hit = self.cache.match(keys=keys)
            n = hit.cached_tokens
        if not n:
            return self.empty_kv_cache_blocks, 0, 0
        rid = request.request_id
        self._hits[rid] = hit.handle  # locked only when admitted on (vLLM: a lookup
        # holds nothing)
        return LazyBlocks(self, rid, 0, n // self.block_size, hit.handle), n, 0

    def get_computed_blocks_for_connector(self, request, max_cache_hit_length=None):
        return (*self.get_computed_blocks(request, max_cache_hit_length), False)

    def allocate_slots(self, request, num_new_tokens: int, num_new_computed_tokens: int = 0,
                       new_computed_blocks=None, num_lookahead_tokens: int = 0,
                       num_external_computed_tokens: int = 0, delay_cache_blocks: bool = False,
                       num_encoder_tokens: int = 0, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0, has_scheduled_reqs: bool = True,
                       skip_zeroing_group_ids=()):
        """Record that ``request`` holds ``min(computed + new + lookahead,
        max_model_len)`` tokens after a hit of ``num_new_computed_tokens`` (vLLM's
        arguments and rule); the new blocks, or ``None`` when the shared budget (less
        ``reserved_blocks`` and, for a waiting request, the watermark) is short. O(1)
        for a running request; a new one also takes a row."""
        rid = request.request_id
        row = self._row.get(rid)
        if row is not None and self._plain and num_new_tokens and not (
                num_new_computed_tokens or num_external_computed_tokens or delay_cache_blocks
                or num_encoder_tokens or self.watermark_blocks):
            # the common call -- a running request, full attention only -- inline
            done = request.num_computed_tokens + num_new_tokens
            target = done + num_lookahead_tokens
            if target > self.max_model_len:
                target = self.max_model_len
            old = self._len[row]
            if self.enable_caching:
                n_cache = request.num_tokens
                if done < n_cache:
                    n_cache = done
                if n_cache // self.block_size > self._cache_to[row] // self.block_size:
                    self._cacheable(row, request, n_cache)
                else:
                    self._cache_to[row] = n_cache
            if target <= old:
                return self._no_blocks
            bs = self.block_size
            first, end = (old + bs - 1) // bs, (target + bs - 1) // bs
            if end > first and end - first > self.total_blocks - self._used - reserved_blocks:
                return None
            self._used += end - first
            ext = self._ext
            ext[row] = ext.get(row, 0) + target - old
            self._len[row] = target
            self._dirty = True
            return LazyBlocks(self, rid, first, end) if end > first else self._no_blocks
        bs = self.block_size
        if num_new_tokens == 0 and not num_external_computed_tokens and \
                not num_new_computed_tokens:
            raise ValueError("num_new_tokens must be greater than 0 when there are no "
                             "computed tokens to adopt")
        if delay_cache_blocks or num_encoder_tokens:
            raise ContractError("GraphallocKVCacheManager: delayed caching (async KV loads) "
                                "and encoder tokens are not supported")
        local = request.num_computed_tokens + num_new_computed_tokens
        total = min(local + num_external_computed_tokens, self.max_model_len)
        free = self.total_blocks - self._used
        wm = self.watermark_blocks if (has_scheduled_reqs and request.status in
                                       self._waiting) else 0
        mml = self.max_model_len
        target = min(total + num_new_tokens + num_lookahead_tokens, mml)
        if row is not None:  # running: vLLM's fast path
            old = self._len[row]
            need = 0
            if target > old:
                need = (_cdiv(target, bs) - _cdiv(old, bs)) * self.num_kv_cache_groups
            if self.swa_group > 0:  # vLLM frees the window's skipped blocks first
                skip = min(max(0, total - request.num_in_flight_tokens - self.window + 1)
                           // bs, _cdiv(old, bs))
                if skip > self._skip[row]:
                    self._used -= skip - self._skip[row]
                    free += skip - self._skip[row]
                    self._skip[row] = skip
                    if not self.mamba:  # graphalloc's SWA pool: move the row's frontier
                        self._adv[row] = skip * bs
                    self._dirty = True
            if need + wm > free - reserved_blocks:
                return None
            if target > old:
                self._ext[row] = self._ext.get(row, 0) + target - old
                self._len[row] = target
                self._used += need
                self._dirty = True
            if self.enable_caching:
                self._cacheable(row, request, min(total + num_new_tokens, request.num_tokens))
            return LazyBlocks(self, rid, _cdiv(old, bs), _cdiv(max(target, old), bs))
        n_hit = num_new_computed_tokens // bs
        handle = -1
        if num_new_computed_tokens:
            handle = self._hits.get(rid, -1)
            if handle < 0 or new_computed_blocks is None or \
                    getattr(new_computed_blocks, "handle", -2) != handle:
                raise ContractError(f"allocate_slots({rid!r}): a hit must be the one "
                                    "get_computed_blocks() returned in this iteration")
        evictable = self._evictable(handle, n_hit) if handle >= 0 else 0
        if full_sequence_must_fit:
            whole = min(request.num_tokens, mml)
            if self._need_new(whole, n_hit, total, True) + evictable + wm > free:
                return None
        need = self._need_new(target, n_hit, total, False) + evictable
        if need + wm > free - reserved_blocks:
            return None
        row = self._acc.free_row(self.alloc.ledger.live,  # (not live, not admitted by the
                                 np.fromiter(self._new_rows, np.int64, len(self._new_rows)))
        if row < 0:  # recorded step: the lowest free row)
            return None
        self._row[rid] = row
        self._req[row] = request
        self._new_rows.add(row)
        self._dirty = True
        if handle >= 0:
            self._on.append((row, handle, n_hit * bs))
            self.cache.lock(handle)  # kept from eviction until the step admits on it
            self._locked.append(handle)
            del self._hits[rid]
        else:
            self._admit.append(row)
        base = n_hit * bs
        if target > base:
            self._ext[row] = target - base
        self._len[row] = max(target, base)
        self._used += need
        skip = 0
        if self.swa_group > 0:
            skip = min(max(0, total - self.window + 1) // bs, _cdiv(self._len[row], bs))
            if skip:
                if not self.mamba:  # graphalloc's SWA pool: move the row's frontier
                    self._adv[row] = skip * bs
        self._skip[row] = skip
        self._cached[row] = n_hit
        self._shared[row] = n_hit
        self._cache_to[row] = 0
        if self.enable_caching:
            self._cacheable(row, request, min(total + num_new_tokens, request.num_tokens))
        return LazyBlocks(self, rid, 0, _cdiv(self._len[row], bs))

    def free(self, request) -> None:
        """Free everything ``request`` holds (finished, aborted or preempted): recorded
        for the next step; its blocks count as free at once (those only the cache keeps
        too: vLLM's evictable blocks). Unknown ids: nothing. O(1) (caching: O(blocks))."""
        rid = request.request_id
        self._hits.pop(rid, None)
        row = self._row.pop(rid, None)
        if row is None:
            return
        n_blocks = _cdiv(self._len[row], self.block_size)
        held = n_blocks * self.num_kv_cache_groups - (self._skip[row] if self.swa_group > 0
                                                      else 0)
        if self.enable_caching and row not in self._new_rows:  # blocks others hold too
            n_done = _cdiv(int(self.alloc.ledger.seq_len[row]), self.block_size)
            pages = self._refs.page_of[row, :n_done]
            held -= int(np.count_nonzero(self._row_refs[pages] > 1)) * \
                self.num_kv_cache_groups
            np.subtract.at(self._row_refs, pages, 1)  # at once: later hits see it free
        elif self.enable_caching:
            held -= (self._shared[row] - self._evictable_row(row)) * self.num_kv_cache_groups
        self._used -= held
        self._dirty = True
        if row in self._new_rows:  # admitted by the recorded step: undo the admission
            self._drop_new(row)
        else:
            self._ext.pop(row, None)
            self._adv.pop(row, None)
            self._rel.append(row)

    def _drop_new(self, row: int) -> None:
        self._new_rows.discard(row)
        self._admit = [r for r in self._admit if r != row]
        for r, handle, _ in self._on:
            if r == row:
                self.cache.unlock(handle)
                self._locked.remove(handle)
        self._on = [t for t in self._on if t[0] != row]
        self._ext.pop(row, None)
        self._adv.pop(row, None)
        self._req[row] = None
        self._cached[row] = self._cache_to[row] = 0
        self._entry_of[row] = -1
        self._due.discard(row)
        if self._filling:
            self._filling = {k: r for k, r in self._filling.items() if r != row}

    def remove_skipped_blocks(self, request_id, processed_computed_tokens: int,
                              num_prompt_tokens=None) -> None:
        """Free the request's sliding-window blocks below ``computed - W + 1``. O(1)."""
        row = self._row.get(request_id)
        if row is None or self.swa_group < 0:
            return
        bs = self.block_size
        skip = min(max(0, processed_computed_tokens - self.window + 1) // bs,
                   _cdiv(self._len[row], bs))
        if skip > self._skip[row]:
            self._used -= skip - self._skip[row]
            self._skip[row] = skip
            if not self.mamba:  # graphalloc's SWA pool: move the row's frontier
                self._adv[row] = skip * bs
            self._dirty = True

    def cache_blocks(self, request, num_computed_tokens: int) -> None:
        """The request's first ``num_computed_tokens`` are cacheable (their whole blocks
        become a cache entry in the next step). O(1)."""
        row = self._row.get(request.request_id)
        if row is not None and self.enable_caching:
            n = min(num_computed_tokens, request.num_tokens)
            if n > self._cache_to[row]:
                self._cacheable(row, request, n)

    # ---- stats, resets and the rest of vLLM's surface ------------------------------------------
    def make_prefix_cache_stats(self):
        if not self.log_stats:
            return None
        stats, self._stats = self._stats, self._stats_cls()
        return stats

    def record_prefix_cache_stats(self, request, num_hits: int) -> None:
        if self.log_stats and self.prefix_cache_lookup_enabled(request):
            self._stats.record(num_tokens=request.num_tokens, num_hits=num_hits,
                               preempted=request.num_preemptions > 0)

    def estimate_cached_tokens(self, request) -> int:
        row = self._row.get(request.request_id)
        if row is None or not self.enable_caching:
            return 0
        return self._cache_to[row] // self.block_size * self.block_size

    def reset_prefix_cache(self) -> bool:
        """Drop every cache entry; ``False`` (nothing changed) while requests hold
        blocks, as vLLM."""
        if self._row:
            return False
        if self._pending():  # the recorded releases (and takes) first
            self.flush()
        self._filling.clear()
        self._due.clear()
        self._entry_of = [-1] * len(self._entry_of)
        if self.cache is not None:
            self.cache.drop_all()
            if self._row_refs is not None:
                self._row_refs[:] = 0
        if self.log_stats:
            self._stats.reset = True
        return True

    def take_events(self) -> list:
        return []

    def take_new_block_ids(self) -> list[int]:
        return []

    def take_kv_cache_block_copies(self):
        """``(copies, retained blocks)``: no copy-on-write here, both empty."""
        return [], []

    def take_boundary_state_offloads(self):
        """Mamba "align" boundary states: none (no Mamba groups)."""
        return {}

    def record_blocks_for_zeroing(self, request_id, start_token: int) -> None:
        return None

    def get_num_common_prefix_blocks(self, running_request_id) -> list[int]:
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks):
        return blocks

    def truncate_computed_blocks(self, blocks, num_computed_tokens: int):
        return LazyBlocks(self, blocks.request_id, 0, num_computed_tokens // self.block_size,
                          blocks.handle)

    def get_block_ids_for_computed_tokens(self, request_id, num_computed_tokens: int):
        ids = self.get_block_ids(request_id)
        n = _cdiv(num_computed_tokens, self.block_size)
        return tuple(group[:n] for group in ids)

    def pop_blocks_for_free(self, request):
        raise ContractError("GraphallocKVCacheManager: deferred frees (KV connectors) are "
                            "not supported")

    def evict_blocks(self, block_ids) -> None:
        raise ContractError("GraphallocKVCacheManager: evicting blocks by id (KV connector "
                            "load failures) is not supported")

    def finalize_partial_tail_offloads(self, request):
        return []
