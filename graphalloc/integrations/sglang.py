"""SGLang's request-level allocator seam: each ``prepare_for_*`` is ONE graphalloc Step.

Contract. :class:`SGLangAllocator` takes the calls SGLang's scheduler makes on its
allocator and tree cache, on plain objects with SGLang's attribute names. Frees only
RECORD into :class:`~.iteration.IterationStep` (``release_kv_cache`` / ``release_finished``
a release; with a cache, ``cache_finished_req`` / ``cache_unfinished_req`` a ``take`` that
inserts the request's whole pages); ``prepare_for_extend`` / ``prepare_for_decode`` read
the batch as arrays once -- ``req_pool_idx`` of each request, ``prefix_lens``,
``extend_lens`` / ``seq_lens_cpu`` (host values) -- and run records plus batch as ONE Step:
take, release, advance (SWA eviction), admit / admit_on (a hit shares its pages), extend /
decode; the cache evicts inside it when pages are short. SWA eviction is SGLang's rule,
vectorised: the SWA KV below ``floor_page(pre_len - keep)`` goes, ``pre_len`` the prefix at
an extend, the KV length at a decode (there once ``swa_eviction_interval`` tokens past);
``keep`` is W, or ``max(W, page_size)`` in whole pages with a prefix cache (SGLang's
boundary: a cached prefix keeps a full window of live SWA).

Unknown ids, one policy with the vLLM seam: releasing a request that holds no KV here
(``req_pool_idx is None``) is a no-op returning ``False``; any other call naming a request
the seam does not hold raises :class:`~graphalloc.errors.UnknownRequestError`. Malformed
objects raise a typed error naming the field (``ContractError``: a missing or non-list
batch field; ``UnknownRequestError``: ``req_pool_idx``; ``PositionError``: lengths, slots).
A refused call (typed error, or ``None`` for lack of pages or rows) changes nothing.

Invariants: ``available_size()`` is what the next step leaves free before it allocates,
``n_free`` + the planner's dry run of the records (cached per version); a matched entry is
locked until the next step. Cost: per ``prepare_*`` a few numpy calls over the batch and
one plan; ``finished()`` per request in ``release_finished``; the queries one dry run per
version, then O(1); no device read. The engine still writes ``ForwardBatch.out_cache_loc``
(:attr:`SGLangBatchAlloc.out_cache_loc`), attention metadata (``alloc.tables`` with
``page_tables=PageTableSpec(...)``, or gathers of ``alloc.req_to_token``), ``seq_lens`` +1
after a decode, :meth:`SGLangAllocator.flush` on an idle iteration, ``alloc.check()``
where it synchronises. Recurrent-state slots (a config with ``num_state_slots``): the
Mamba pool's mapping is :attr:`SGLangAllocator.req_index_to_mamba_index_mapping`, its
alloc / free ride in the admits and releases, snapshot copies in the steps; the engine
still zeroes a new request's state before its prefill and runs its layers on the slot.
A request's page keys are computed once and kept on it (``req.graphalloc_page_keys``),
extended as it grows.
Not covered: the overlap scheduler's deferred eviction,
speculative multi-token decode, HiCache, page_size-1 ``alloc(n)``, ring mode. Tenant
isolation: a request's ``extra_key`` and ``cache_salt`` are its page keys' salt
(:func:`cache_salt`), so two tenants' identical tokens share no page; a request with
neither is keyed in the default namespace (SGLang's default).
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
    UnknownRequestError,
)
from ..inputs import as_int64
from ..plan.step import EMPTY
from ..sharing.page_keys import RequestKeys
from .iteration import IterationStep

__all__ = ["SGLangAllocator", "SGLangBatchAlloc", "cache_salt"]

_MISSING = object()


def cache_salt(req) -> bytes | None:
    """What isolates ``req``'s cached KV from other tenants': SGLang's ``extra_key`` (a LoRA
    id, a multimodal hash, a client's key) and ``cache_salt``, or ``None`` when it sends
    neither (then every request with the same tokens shares them, SGLang's default)."""
    extra, salt = getattr(req, "extra_key", None), getattr(req, "cache_salt", None)
    if extra is None and salt is None:
        return None
    return repr((extra, salt)).encode()


def batch_field(batch, name: str, n: int) -> np.ndarray:
    """``batch.<name>``: one int per request, as int64 (a CPU tensor, an array or a list);
    a typed error naming the field for anything else. No copy for a CPU int64 tensor or
    array; one ``np.array`` for a list."""
    values = getattr(batch, name, _MISSING)
    kind = type(values)
    arr = None
    if kind is torch.Tensor:
        if values.device.type != "cpu":
            raise TensorSpecError(f"{name} is a tensor on {values.device}: reading it would "
                                  "synchronise; pass the host copy (SGLang keeps one on the "
                                  "CPU)")
        if values.dtype == torch.int64 and values.dim() == 1:
            arr = values.numpy()
    elif kind is np.ndarray:
        if values.dtype == np.int64 and values.ndim == 1:
            arr = values
    elif kind is list and values:
        arr = np.array(values)
        if arr.dtype != np.int64 or arr.ndim != 1:
            arr = None
    if arr is None:
        if values is _MISSING or values is None:
            raise ContractError(f"the batch has no {name}: SGLang's ScheduleBatch carries it "
                                "(one int per request)")
        if not isinstance(values, (list, tuple, np.ndarray, torch.Tensor)):
            raise ContractError(f"{name} must hold one int per request (a list, an array or "
                                f"a CPU tensor), got {type(values).__name__} {values!r}")
        arr = as_int64(values, name, PositionError)  # the typed error for a bad entry
    if len(arr) != n:
        raise ContractError(f"{name} has {len(arr)} entries for {n} requests")
    return arr


def batch_reqs(batch) -> list:
    reqs = getattr(batch, "reqs", _MISSING)
    if reqs is _MISSING or not isinstance(reqs, (list, tuple)):
        raise ContractError(f"the batch's reqs must be a list of requests, got "
                            f"{'nothing' if reqs is _MISSING else type(reqs).__name__}")
    return reqs


def pool_indices(reqs, allow_new: bool, n_rows: int) -> np.ndarray:
    """Every request's ``req_pool_idx`` as int64 (``None`` -> -1 when ``allow_new``), each
    in ``[0, n_rows)``; ``UnknownRequestError`` naming the field otherwise. One attribute
    read per request, one ``np.array``, one range check."""
    try:
        idx = [r.req_pool_idx for r in reqs]
    except AttributeError:
        raise UnknownRequestError("a request has no req_pool_idx attribute (SGLang's Req "
                                  "carries it: None until the allocator gives it a row)"
                                  ) from None
    arr = np.array(idx) if idx else EMPTY
    if arr.dtype == np.int64:
        if len(idx) <= 64:  # a few ints: Python's min / max beat a numpy reduction
            out = len(idx) and (min(idx) < 0 or max(idx) >= n_rows)
        else:
            out = int(arr.view(np.uint64).max()) >= n_rows  # (a negative is huge)
        if out:
            bad = int(arr[(arr < 0) | (arr >= n_rows)][0])
            raise UnknownRequestError(f"req_pool_idx {bad} is outside [0, {n_rows}): not a "
                                      "row this seam gave out")
        return arr
    out = np.empty(len(idx), dtype=np.int64)  # None, a bool, a float, a huge int: find it
    for i, v in enumerate(idx):
        if v is None and allow_new:
            out[i] = -1
        elif v is None:
            raise UnknownRequestError(f"req_pool_idx of request {i} in the batch is None: it "
                                      "holds no KV here (not admitted, or released)")
        elif isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
            raise UnknownRequestError(f"req_pool_idx must be an int row (None for a new "
                                      f"request), got {v!r} ({type(v).__name__})")
        elif not 0 <= v < n_rows:
            raise UnknownRequestError(f"req_pool_idx {v} is outside [0, {n_rows})")
        else:
            out[i] = v
    return out


def batch_rows(batch, reqs, n_rows: int) -> np.ndarray:
    """The decode batch's rows: SGLang's ``ScheduleBatch.req_pool_indices_cpu`` (a host
    int64 tensor, one per request) when the batch carries it -- no per-request Python,
    one range check -- else every request's ``req_pool_idx`` (:func:`pool_indices`)."""
    host = getattr(batch, "req_pool_indices_cpu", None)
    if type(host) is not torch.Tensor or host.dtype != torch.int64 or host.dim() != 1 \
            or host.device.type != "cpu" or len(host) != len(reqs):
        return pool_indices(reqs, False, n_rows)
    rows = host.numpy()
    if len(rows) and int(rows.view(np.uint64).max()) >= n_rows:  # (a negative is huge)
        bad = int(rows[(rows < 0) | (rows >= n_rows)][0])
        raise UnknownRequestError(f"req_pool_indices_cpu holds {bad}, outside [0, "
                                  f"{n_rows}): not a row this seam gave out")
    return rows


@dataclasses.dataclass(eq=False)
class SGLangBatchAlloc:
    """What ``prepare_for_extend`` / ``prepare_for_decode`` allocated.

    ``out_cache_loc`` / ``swa_out_cache_loc``: ``[n_tokens]`` device views of the full /
    SWA slots of the batch's new tokens, request by request in batch order (SGLang's
    ``out_cache_loc`` and ``translate_loc_from_full_to_swa(out_cache_loc)``); valid
    until the next step runs (a later access raises ``StaleResultError``). ``rows``:
    each request's ``req_pool_idx``. ``n_steps``: graphalloc steps this call ran (1;
    more only when the recorded frees exceeded the frozen release shape).
    ``n_evicted_pages``: SWA pages the window moves freed (the planner's count).
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
    """SGLang's allocator (and, with a prefix cache, tree-cache) calls over a pool-mode
    :class:`HybridAllocator`; see the module docstring for the contract.

    Args:
        alloc: the allocator (pool mode; ``AllocatorConfig.for_engine`` sizes it). Its
            ``max_reqs`` must cover the running requests plus the requests released in one
            iteration (a released row is reused after its step). With
            ``HybridAllocator(cfg, prefix_cache=True)`` the seam is also SGLang's radix
            cache (:meth:`match_prefix`, :meth:`cache_unfinished_req`,
            :meth:`cache_finished_req`, :meth:`evictable_size`); without, a ChunkCache.
        swa_eviction_interval: tokens (>= 1); at a decode a request's window is evicted once
            ``pre_len - sliding_window >= frontier + interval`` (SGLang's
            ``SGLANG_SWA_EVICTION_INTERVAL``). Extends evict at every chunk.
        defer_frees: ``True`` (default): releases and inserts join the next step.
            ``False``: SGLang's timing -- ``free_group_end()`` runs the group's releases at
            once through ``alloc.free_group()`` (one more step per iteration), an insert is
            a step of its own, a release outside a group runs at once.
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
        self.ledger = alloc.ledger
        self.page_size = alloc.config.page_size
        self.sliding_window_size = alloc.config.sliding_window
        self.swa_eviction_interval = swa_eviction_interval
        self._max_reqs = alloc.config.max_reqs
        ps = self.page_size  # floor_page as one bitwise and when the page size is 2^k
        self._page_mask = -ps if ps & (ps - 1) == 0 else 0
        self.defer_frees = defer_frees
        self.tree_cache = alloc.prefix_cache  # None: SGLang's ChunkCache behaviour
        # SGLang's eviction boundary: with a prefix cache the window keeps max(W, ps) tokens
        # rounded up to whole pages (a cached key ending at floor_page(len) keeps a full
        # window of live SWA); without one, W tokens. Due once pre_len - W >= frontier +
        # interval, and the target floor_page(pre_len - keep) is past the frontier once
        # pre_len - keep >= frontier + ps: one threshold past the frontier
        w = self.sliding_window_size
        self._keep = -(-max(w, ps) // ps) * ps if self.tree_cache is not None else w
        self._due = max(w + swa_eviction_interval, self._keep + ps)
        self._immediate_cache_steps = 0  # inserts run at once (defer_frees=False)
        self._locks: dict[int, tuple] = {}  # id(req) -> (req, locked handle, hit tokens)
        self._group: contextlib.ExitStack | None = None
        self._in_group = False

    @property
    def cache_steps(self) -> int:
        """Steps the prefix cache ran outside the iterations' steps (a handle freed for an
        insert when every handle was held; with ``defer_frees=False``, every new entry)."""
        return self.pending.cache_steps + self._immediate_cache_steps

    # ---- allocation (ScheduleBatch.prepare_for_extend / prepare_for_decode) -------------
    def prepare_for_extend(self, batch) -> SGLangBatchAlloc | None:
        """Rows for new requests, SWA eviction below ``floor_page(prefix_len - W)``, and
        ``extend_lens[i]`` slots per request, with the recorded frees: ONE step.

        A new request (``req_pool_idx is None``) starts empty, or, with ``prefix_lens[i] >
        0``, on the prefix :meth:`match_prefix` locked for it since the last step (whole
        pages, at most the hit): ``admit_on`` shares those pages, only ``extend_lens[i]``
        are allocated. A running one (a chunked prefill's next chunk) must have
        ``prefix_lens[i]`` equal to its allocated length. Returns ``None`` when a pool or
        the request rows are short (the cache's reclaimable pages count: the step evicts
        them), with nothing changed."""
        if self._in_group:
            self._refuse_in_group("prepare_for_extend")
        reqs = batch_reqs(batch)
        n = len(reqs)
        if not n:
            self._nonempty(n)
        prefix = batch_field(batch, "prefix_lens", n)
        ext = batch_field(batch, "extend_lens", n)
        if np.count_nonzero((ext < 1) | (prefix < 0)):
            if (ext < 1).any():
                raise PositionError(f"extend_lens: {int(ext.min())} for a request; an extend "
                                    "adds >= 1 token")
            raise PositionError(f"prefix_lens: {int(prefix.min())}; a prefix is >= 0 tokens")
        rows = pool_indices(reqs, True, self._max_reqs)
        new = np.flatnonzero(rows < 0).tolist()
        ps = self.page_size
        advance = None
        if len(new) < n:  # running requests: a chunked prefill's next chunk
            run = rows >= 0
            run_rows, run_pre = rows[run], prefix[run]
            if np.count_nonzero(self.ledger.seq_len[run_rows] != run_pre):
                self._check_running(run_rows, run_pre, "prepare_for_extend")
            moved = run_pre >= self.ledger.frontier[run_rows] + (self._keep + ps)
            if np.count_nonzero(moved):
                advance = (run_rows[moved], self._floor(run_pre[moved]))
        admit = admit_on = None
        if new:
            rows = rows.copy()
            plain, on_rows, on_h, on_n = [], [], [], []
            for i in new:
                p = int(prefix[i])
                handle = self._matched_handle(reqs[i], p) if p else -1
                row = self.pending.free_row(self.ledger.live, plain + on_rows)
                if row < 0:
                    return None  # the request rows are short: nothing changed
                rows[i] = row
                if p:
                    on_rows.append(row)
                    on_h.append(handle)
                    on_n.append(p)
                else:
                    plain.append(row)
            if plain:
                admit = np.array(plain, dtype=np.int64)
            if on_rows:
                admit_on = (np.array(on_rows, dtype=np.int64), np.array(on_h, dtype=np.int64),
                            np.array(on_n, dtype=np.int64))
        out = self.pending.run(advance=advance, admit=admit, admit_on=admit_on,
                               extend=(rows, ext))
        if out is None:
            return None
        for i in new:
            reqs[i].req_pool_idx = int(rows[i])
        if self._locks:
            self._unlock_all()
        return SGLangBatchAlloc(out[0], rows, out[2], out[1])

    def prepare_for_decode(self, batch) -> SGLangBatchAlloc | None:
        """One slot per request, with the SWA eviction of the requests due by the interval
        and the recorded frees: ONE step. ``seq_lens_cpu[i]`` must equal the request's
        allocated length. The rows come from ``batch.req_pool_indices_cpu`` when the batch
        carries it (SGLang's ScheduleBatch does), else from each request's
        ``req_pool_idx``. Returns ``None`` (nothing changed) when short."""
        if self._in_group:
            self._refuse_in_group("prepare_for_decode")
        reqs = batch_reqs(batch)
        n = len(reqs)
        if not n:
            self._nonempty(n)
        lens = batch_field(batch, "seq_lens_cpu", n)
        rows = batch_rows(batch, reqs, self._max_reqs)
        led = self.ledger
        if np.count_nonzero(led.seq_len[rows] != lens):
            self._check_running(rows, lens, "prepare_for_decode")
        # SGLang's rule, to floor_page(pre_len - keep): one threshold past the frontier
        moved = lens >= led.frontier[rows] + self._due
        advance = None
        if np.count_nonzero(moved):
            advance = (rows[moved], self._floor(lens[moved]))
        out = self.pending.run(advance=advance, decode=rows)
        if out is None:
            return None
        if self._locks:
            self._unlock_all()
        return SGLangBatchAlloc(out[0], rows, out[2], out[1])

    # ---- release (release_kv_cache) and the free-group bracket --------------------------
    def release_kv_cache(self, req, is_insert: bool = True) -> bool:
        """Free everything ``req`` holds and its row (a finished or retracted request); sets
        ``req.req_pool_idx = None``. Returns ``False`` (a no-op) for a request holding no KV
        here (``req_pool_idx is None``: the unknown-id policy).

        Without a prefix cache this is SGLang's ``release_kv_cache`` with a ChunkCache:
        every page is freed. With one (and ``is_insert``) it is ``cache_finished_req``:
        the request's whole pages are inserted (a ``take`` of the same step, run before the
        release), so the pages the entry references stay. With ``defer_frees`` both run
        with the next step and count in ``available_size()`` at once."""
        row = self._row_of(req, "release_kv_cache", allow_none=True)
        if row is None:
            return False
        if is_insert and self.tree_cache is not None:
            self._insert(row, self._token_ids(req, "release_kv_cache"),
                         self._request_keys(req))
        if self.defer_frees:
            self.pending.add_release(row)
        else:  # in a group: run by free_group_end(); else one step now
            self.alloc.release([row])
        req.req_pool_idx = None
        return True

    def cache_finished_req(self, req) -> bool:
        """SGLang's ``tree_cache.cache_finished_req``: insert, then release
        (:meth:`release_kv_cache` with the cache)."""
        self._need_cache("cache_finished_req")
        return self.release_kv_cache(req)

    def insert_into_prefix_cache(self, req) -> int:
        """The prefix-cache half of ``cache_finished_req``: cache the whole pages of the
        request's KV (``origin_input_ids + output_ids`` up to its allocated length) on a
        handle: FULL pages of the prefix, SWA pages from its frontier (what left the window
        is a tombstone). Recorded as a ``take`` of the next step (``defer_frees=False``: a
        step now); none when an equal prefix is cached. Returns the tokens cached."""
        self._need_cache("insert_into_prefix_cache")
        row = self._row_of(req, "insert_into_prefix_cache", allow_none=False)
        tokens = self._token_ids(req, "insert_into_prefix_cache")
        return self._insert(row, tokens, self._request_keys(req))

    def cache_unfinished_req(self, req) -> int:
        """SGLang's ``tree_cache.cache_unfinished_req`` (after a chunked prefill's chunk):
        cache the request's whole pages so far, in the next step (before its next chunk);
        it keeps running on its own pages. Returns the tokens cached."""
        return self.insert_into_prefix_cache(req)

    def match_prefix(self, req) -> int:
        """SGLang's ``tree_cache.match_prefix`` for a new request: the longest cached
        prefix (whole pages) of ``origin_input_ids + output_ids`` without its last token,
        counting only hits whose SWA window is present, among the pages cached under the
        request's ``extra_key`` (none: the default namespace). Locks the entry until the
        next step the seam runs (a later match of the same request replaces it) and names
        it in ``req.last_node``; returns the prefix length (0: a miss, ``last_node =
        None``). Host only: O(new prompt pages) hashing (the request's keys are kept)."""
        cache = self._need_cache("match_prefix")
        if getattr(req, "req_pool_idx", None) is not None:
            raise ContractError("match_prefix: the request already has a row; match new "
                                "(waiting) requests")
        tokens = self._token_ids(req, "match_prefix")
        keys = self._request_keys(req)
        self._unlock(req)
        hit = cache.match(tokens[:max(len(tokens) - 1, 0)], keys=keys.keys, salt=keys.salt)
        req.last_node = None
        if not hit.cached_tokens:
            return 0
        cache.lock(hit.handle)
        self._locks[id(req)] = (req, hit.handle, hit.cached_tokens)
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
        """Close the free group. ``defer_frees=True``: nothing runs (the group's records
        join the next step); ``False``: ``alloc.free_group()`` closes, running the group's
        releases as one step (more only if they exceed the frozen shape)."""
        if not self._in_group:
            raise NestedGroupError("free_group_end() without free_group_begin()")
        self._in_group = False
        group, self._group = self._group, None
        if group is not None:
            group.close()

    def flush(self) -> int:
        """Run the recorded frees and inserts now (an idle iteration, shutdown); returns the
        steps run (0 when nothing is recorded)."""
        self._refuse_in_group("flush")
        if not self.pending:
            return 0
        n = self.pending.run()[2]
        self._unlock_all()
        return n

    # ---- queries (BaseTokenToKVPoolAllocator's names; tokens, host only) ----------------
    def full_available_size(self) -> int:
        """Free FULL slots (tokens) once the recorded frees ran: a dry run of the planner
        the first time per version of the records, O(1) after."""
        return self.pending.free_pages("full") * self.page_size

    def swa_available_size(self) -> int:
        """Free SWA slots (tokens) once the recorded frees ran (as FULL)."""
        return self.pending.free_pages("swa") * self.page_size

    def available_size(self) -> int:
        """``min(full_available_size(), swa_available_size())``, as SGLang's SWA allocator."""
        return min(self.full_available_size(), self.swa_available_size())

    def full_evictable_size(self) -> int:
        """FULL slots (tokens) the prefix cache could give back once the recorded frees
        ran (0 without a cache): SGLang's ``tree_cache.full_evictable_size()``."""
        return self.pending.pages_reclaimable()[0] * self.page_size

    def swa_evictable_size(self) -> int:
        """SWA slots (tokens) the prefix cache could give back (``swa_evictable_size``)."""
        return self.pending.pages_reclaimable()[1] * self.page_size

    def evictable_size(self) -> int:
        """``min`` of the two: add it to ``available_size()`` to budget a batch, as
        SGLang's ``PrefillAdder`` does with ``tree_cache.evictable_size()``."""
        return min(self.full_evictable_size(), self.swa_evictable_size())

    def translate_loc_from_full_to_swa(self, full_slots):
        """SWA slots of ``full_slots`` (full slots: a device tensor, or host ints): a gather
        of ``alloc.full_to_swa``, no host/device synchronisation; 0 where a slot has no SWA
        peer. Host values outside the pool raise ``PositionError``; a device tensor cannot
        be read without a sync, so its out-of-range entries translate to 0 (no device
        assert). Unlike SGLang's mapping there is no ``-1 -> -1`` entry."""
        table = self.alloc.full_to_swa
        n = table.shape[0]
        if not isinstance(full_slots, torch.Tensor) or full_slots.device.type == "cpu":
            host = as_int64(full_slots, "full_slots", PositionError)
            if len(host) and (host.min() < 0 or host.max() >= n):
                bad = int(host[(host < 0) | (host >= n)][0])
                raise PositionError(f"translate_loc_from_full_to_swa: full slot {bad} is "
                                    f"outside the FULL pool [0, {n})")
            if isinstance(full_slots, torch.Tensor) and table.device.type == "cpu":
                return table[full_slots]
            return table[torch.as_tensor(host, device=table.device)]
        if full_slots.dtype in (torch.bool, torch.float16, torch.bfloat16, torch.float32,
                                torch.float64) or full_slots.is_complex():
            raise TensorSpecError(f"full_slots must be an integer tensor, got "
                                  f"{full_slots.dtype}")
        inside = (full_slots >= 0) & (full_slots < n)
        return torch.where(inside, table[full_slots.clamp(0, n - 1)], 0)

    # ---- recurrent-state slots: what SGLang's Mamba pool offers ----------------------------
    @property
    def req_index_to_mamba_index_mapping(self) -> torch.Tensor:
        """``[max_reqs]`` device tensor: each ``req_pool_idx``'s recurrent-state slot (SGLang's
        ``HybridReqToTokenPool.req_index_to_mamba_index_mapping``; slot 0: none). Written
        inside each step: a request gets its slot when ``prepare_for_extend`` admits it and
        gives it back at its release, as SGLang's ``alloc`` / ``free`` of the pool do. The
        engine's Mamba layers read and update the state there; a cache hit's state is
        copied into it inside the step (``state_tensors=`` given to the allocator). O(1)."""
        self._need_states("req_index_to_mamba_index_mapping")
        return self.alloc.req_to_state

    def get_mamba_indices(self, req_pool_indices) -> torch.Tensor:
        """The slots of ``req_pool_indices`` (a device tensor, or host ints): one gather of
        :attr:`req_index_to_mamba_index_mapping`, no sync. Host values outside the request
        rows raise ``UnknownRequestError``."""
        table = self._need_states("get_mamba_indices")
        if isinstance(req_pool_indices, torch.Tensor) and req_pool_indices.device == \
                table.device and req_pool_indices.device.type != "cpu":
            return table[req_pool_indices]
        rows = as_int64(req_pool_indices, "req_pool_indices", UnknownRequestError)
        if len(rows) and (rows.min() < 0 or rows.max() >= table.shape[0]):
            raise UnknownRequestError(f"get_mamba_indices: a req_pool_idx outside [0, "
                                      f"{table.shape[0]})")
        return table[torch.as_tensor(rows, device=table.device)]

    def mamba_available_size(self) -> int:
        """Free recurrent-state slots now (SGLang's ``mamba_pool.available_size()``). O(1)."""
        self._need_states("mamba_available_size")
        return self.alloc.n_free("state")

    def _need_states(self, what: str) -> torch.Tensor:
        if not self.alloc.config.num_state_slots:
            raise ConfigError(f"{what}: the allocator has no recurrent-state slots; build its "
                              "config with num_state_slots > 0")
        return self.alloc.req_to_state

    @property
    def n_recorded_releases(self) -> int:
        """Releases recorded for the next step."""
        return self.pending.n_releases

    # ---- internals ---------------------------------------------------------------------
    def _nonempty(self, n: int) -> None:
        if not n:
            raise ContractError("an empty batch allocates nothing; on an idle iteration "
                                "call flush() to run the recorded frees")

    def _check_running(self, rows: np.ndarray, lens: np.ndarray, what: str) -> None:
        """Running rows are live, not released in this iteration, at the batch's length
        (the typed error of the first that is not)."""
        led = self.ledger
        bad = ~led.live[rows] | self.pending.released[rows]
        if bad.any():
            r = int(rows[np.flatnonzero(bad)[0]])
            state = "released in this iteration" if led.live[r] else "not a live request row"
            raise UnknownRequestError(f"{what}: req_pool_idx {r} is {state}")
        off = led.seq_len[rows] != lens
        if off.any():
            i = int(np.flatnonzero(off)[0])
            raise ContractError(f"{what}: request row {int(rows[i])} has "
                                f"{int(led.seq_len[rows[i]])} tokens allocated, the batch "
                                f"says {int(lens[i])}; pass the KV length before this step")

    def _floor(self, pre_len: np.ndarray) -> np.ndarray:
        """floor_page(pre_len - keep); keep is W, or max(W, page_size) in whole pages with a
        prefix cache (callers pass pre_len >= keep + page_size)."""
        past = pre_len - self._keep
        return past & self._page_mask if self._page_mask else past // self.page_size * \
            self.page_size

    def _row_of(self, req, what: str, allow_none: bool):
        row = getattr(req, "req_pool_idx", _MISSING)
        if row is _MISSING:
            raise UnknownRequestError(f"{what}: the request has no req_pool_idx attribute")
        if row is None:
            if allow_none:
                return None
            raise UnknownRequestError(f"{what}: the request holds no KV here (req_pool_idx "
                                      "is None)")
        if isinstance(row, (bool, np.bool_)) or not isinstance(row, (int, np.integer)):
            raise UnknownRequestError(f"{what}: req_pool_idx must be an int row, got {row!r}")
        r = int(row)
        if not 0 <= r < self.alloc.config.max_reqs or not self.ledger.live[r]:
            raise UnknownRequestError(f"{what}: req_pool_idx {r} is not a live request row")
        if self.pending.released[r]:
            raise UnknownRequestError(f"{what}: req_pool_idx {r} was released in this "
                                      "iteration; its release runs with the next step")
        return r

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

    def _request_keys(self, req) -> RequestKeys:
        """The request's page keys, kept on it (``req.graphalloc_page_keys``), made on first
        use with its ``extra_key`` as the salt; made anew when the request's ``extra_key``
        is not the one they were made with. O(1)."""
        salt = cache_salt(req)
        keys = getattr(req, "graphalloc_page_keys", None)
        if type(keys) is RequestKeys and keys.same_namespace(salt, None):
            return keys
        keys = RequestKeys(self.page_size, salt=salt, key_hash=self.tree_cache.key_hash)
        with contextlib.suppress(AttributeError):  # a request that takes no attribute:
            req.graphalloc_page_keys = keys  # its keys are made again next time
        return keys

    def _insert(self, row: int, tokens: list, keys: RequestKeys) -> int:
        if self.defer_frees:
            return self.pending.insert(row, tokens, keys=keys.keys, salt=keys.salt)
        before = self.alloc.steps_run
        n = self.tree_cache.insert(row, tokens, keys=keys.keys, salt=keys.salt)
        self._immediate_cache_steps += self.alloc.steps_run - before
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
        if prefix_len > lock[2]:
            raise AlignmentError(f"prefix_len {prefix_len} exceeds the {lock[2]} tokens of "
                                 "the request's cache hit")
        return lock[1]

    def _unlock(self, req) -> None:
        lock = self._locks.pop(id(req), None)
        if lock is not None:
            self.tree_cache.unlock(lock[1])

    def _unlock_all(self) -> None:
        if self._locks:
            locks, self._locks = self._locks, {}
            for _, handle, _ in locks.values():
                self.tree_cache.unlock(handle)

    def _refuse_in_group(self, what: str) -> None:
        if self._in_group:
            raise NestedGroupError(f"{what}() inside an open free group; call "
                                   "free_group_end() first (SGLang allocates after it)")
