"""A built-in prefix cache on the allocator's handles, aware of the sliding window.

Keys are page-granular and chained over token ids: the key of page j covers its ``ps``
tokens and the key of page j - 1, so equal keys mean equal whole prefixes (BLAKE2b,
deterministic on every rank and every run). Each cache entry is one handle on a whole
prefix ``[0, n)`` (see :meth:`HybridAllocator.take_handle`); every page key of the
prefix points at the entry, so a lookup finds the longest cached prefix in one pass.

A hit is only as good as its window: an SWA layer at length m reads positions
``[m - W, m)``, so a request admitted on m cached tokens needs the SWA pages of the
window before m. :meth:`PrefixCache.match` returns the longest match whose window is
present in some entry holding that prefix (``cached_tokens``), and separately the
longest FULL match (``full_tokens``) with how many tokens would then have to be
recomputed (``recompute_tokens``).

Eviction (LRU, leaf first: an entry no other entry extends): under SWA pressure an entry
is first tombstoned (its SWA pages dropped, FULL kept: it can still serve as a
full-attention prefix), under FULL pressure evicted (dropped). An entry frees only the
pages nobody else references. The allocator runs eviction itself when an allocation
would otherwise be refused, inside the same step (the drops and the allocation that
needs them are one replay): build it with ``HybridAllocator(cfg, prefix_cache=True)``.

Locks (SGLang's ``inc_lock_ref`` / ``dec_lock_ref``): :meth:`PrefixCache.lock` keeps an
entry from eviction and from tombstoning until :meth:`PrefixCache.unlock`: a scheduler
locks a hit from the lookup until the request admitted on it has run its step.

Eviction is transactional: the drops a step plans are the step's (a refused step, or a
dry run like ``alloc.fits()``, keeps every entry); the cache forgets an evicted entry once
its handle is gone (at its next operation), so its entries always match the handles held.

Cost: ``match`` O(pages of the prompt) hashing on the host, plus O(entries holding each
page) window checks; ``insert`` the same plus one
device step (the handle's prefix copy); eviction O(entries) per reclaimed entry; ``lock`` /
``unlock`` O(1).

Ledger of an entry (positions of its prefix, ``[a, b)``)::

    [0, n)            FULL pages referenced by the entry's handle
    [swa_start, n)    SWA pages referenced (swa_start = n after a tombstone)

The cache's handles are dropped only through the cache (``evict``, ``drop_all``, or the
allocator's reclaim); an engine's own handles may live beside them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref

import numpy as np

from .errors import ContractError, NestedGroupError, UnknownHandleError

__all__ = ["PrefixCache", "CacheMatch", "page_keys"]


def page_keys(token_ids, page_size: int) -> list[bytes]:
    """The chained key of every whole page of ``token_ids`` (a partial last page has none)."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    keys, prev = [], b""
    for j in range(len(tokens) // page_size):
        h = hashlib.blake2b(prev, digest_size=16)
        h.update(tokens[j * page_size:(j + 1) * page_size].tobytes())
        prev = h.digest()
        keys.append(prev)
    return keys


@dataclasses.dataclass(frozen=True)
class CacheMatch:
    """``cached_tokens`` usable as they are (window present) with ``handle``;
    ``full_tokens`` the longest FULL match (``full_handle``), of which ``recompute_tokens``
    at the end lack their SWA pages. Handles are ``-1`` when there is no match."""

    cached_tokens: int = 0
    handle: int = -1
    full_tokens: int = 0
    full_handle: int = -1
    recompute_tokens: int = 0


@dataclasses.dataclass(eq=False)
class _Entry:
    handle: int
    n_tokens: int
    keys: list
    last_used: int
    first_page: int  # the handle's FULL page 0 (a re-taken handle id holds other pages)
    parent: _Entry | None = None
    lock_ref: int = 0


@dataclasses.dataclass(eq=False)
class _Drop:
    """A drop a step planned: the entry, the planner (weakly), tombstone or eviction, and
    the pages it freed in that plan (counted once the step is known to have run)."""

    entry: _Entry
    builder: weakref.ref
    tombstone: bool
    n_full: int
    n_swa: int


class PrefixCache:
    """Prefix cache over ``alloc``'s handles (see the module docstring).

    ``hits`` / ``misses`` count :meth:`match` calls; ``hit_tokens`` the tokens reused;
    ``evicted_pages`` / ``tombstoned_pages`` the pages eviction returned (FULL / SWA);
    ``version`` changes whenever the entries, their locks or their handles may have
    changed (for callers that cache :meth:`reclaimable_pages`).
    """

    def __init__(self, alloc):
        self.alloc = alloc
        self.page_size = alloc.config.page_size
        self.window = alloc.config.sliding_window
        self._by_key: dict[bytes, tuple[_Entry, int]] = {}  # page key -> (longest, index)
        self._holders: dict[bytes, list[_Entry]] = {}  # page key -> every entry holding it
        self._by_handle: dict[int, _Entry] = {}
        self._ends: dict[bytes, _Entry] = {}  # an entry's last page key -> the entry
        self._dropping: list[_Drop] = []  # drops planned by steps not yet known to have run
        self._clock = 0
        self._version = 0
        self.hits = self.misses = self.hit_tokens = 0
        self._evicted_pages = self._tombstoned_pages = 0

    def __len__(self) -> int:
        self._reconcile()
        return len(self._by_handle)

    @property
    def version(self) -> int:
        self._reconcile()
        return self._version

    @property
    def evicted_pages(self) -> int:
        """FULL pages eviction returned (steps that ran)."""
        self._reconcile()
        return self._evicted_pages

    @property
    def tombstoned_pages(self) -> int:
        """SWA pages tombstoning (and eviction) returned (steps that ran)."""
        self._reconcile()
        return self._tombstoned_pages

    # ---- lookup ------------------------------------------------------------------------
    def match(self, token_ids) -> CacheMatch:
        """The longest cached prefix of ``token_ids`` (whole pages), see :class:`CacheMatch`.
        Touches the entries it uses (LRU). Host only."""
        self._reconcile()
        ps, best_full, best = self.page_size, None, None
        starts: dict[int, int] = {}  # handle -> SWA start, read once per match
        for j, key in enumerate(page_keys(token_ids, ps)):
            hit = self._by_key.get(key)
            if hit is None:
                break
            m = (j + 1) * ps
            best_full = (hit[0], m)
            for cand in self._holders[key]:  # any entry holding this page and its window
                if self._window_present(cand, m, starts):
                    best = (cand, m)
                    break
        if best_full is None:
            self.misses += 1
            return CacheMatch()
        self._clock += 1
        for found in (best_full, best):
            if found is not None:
                self._touch(found[0])
        full_entry, m_full = best_full
        start = self._swa_start(full_entry, starts)
        ws = max(0, m_full - self.window) // self.page_size * self.page_size
        recompute = max(0, min(start, m_full) - ws)  # window tokens whose SWA KV is gone
        self.hits += 1
        cached = best[1] if best else 0
        self.hit_tokens += cached
        return CacheMatch(cached, best[0].handle if best else -1, m_full, full_entry.handle,
                          recompute)

    def _swa_start(self, entry: _Entry, starts: dict) -> int:
        h = entry.handle
        if h not in starts:
            starts[h] = self.alloc.handle_info(h).swa_start
        return starts[h]

    def _window_present(self, entry: _Entry, m: int, starts: dict) -> bool:
        """Whether the SWA pages of the window before ``m`` are held by the entry."""
        start = self._swa_start(entry, starts)
        return start <= max(0, m - self.window) // self.page_size * self.page_size

    # ---- locks -------------------------------------------------------------------------
    def lock(self, handle) -> None:
        """Keep the entry on ``handle`` (a :meth:`match` hit) from eviction and tombstoning
        until :meth:`unlock` (locks count: SGLang's ``inc_lock_ref``). O(1).
        ``UnknownHandleError`` if ``handle`` is not a cache entry's."""
        self._entry(handle, "lock").lock_ref += 1
        self._version += 1

    def unlock(self, handle) -> None:
        """Undo one :meth:`lock` (SGLang's ``dec_lock_ref``). O(1)."""
        entry = self._entry(handle, "unlock")
        if entry.lock_ref == 0:
            raise ContractError(f"unlock: the cache entry on handle {entry.handle} is not "
                                "locked")
        entry.lock_ref -= 1
        self._version += 1

    def is_locked(self, handle) -> bool:
        """Whether the entry on ``handle`` is locked. O(1)."""
        return self._entry(handle, "is_locked").lock_ref > 0

    def _entry(self, handle, what: str) -> _Entry:
        self._reconcile()
        entry = None
        if not isinstance(handle, (bool, np.bool_)) and isinstance(handle, (int, np.integer)):
            entry = self._by_handle.get(int(handle))
        if entry is None:
            raise UnknownHandleError(f"{what}: {handle!r} is not the handle of a prefix-cache "
                                     "entry (never cached, or evicted)")
        return entry

    # ---- insertion ---------------------------------------------------------------------
    def insert(self, row, token_ids) -> int:
        """Cache the whole pages of ``token_ids`` that live request ``row`` holds (its first
        ``len(token_ids)`` positions hold these tokens): at a request's end or a
        chunked-prefill boundary. Takes a handle (one step) unless the prefix is cached
        already; when every handle is held, the LRU unlocked leaf entry is dropped first
        (one more step); returns the tokens cached (0 when nothing could be)."""
        self._reconcile()
        ps = self.page_size
        keys = page_keys(token_ids, ps)
        n = min(len(keys), self.alloc.seq_len(row) // ps) * ps
        if n == 0:
            return 0
        keys = keys[:n // ps]
        existing = self._ends.get(keys[-1])
        if existing is not None:  # this prefix is cached already
            self._clock += 1
            self._touch(existing)
            return n
        if len(self.alloc.live_handles()) >= self.alloc.ledger.n_handles:
            victim = self._lru_leaf()  # every handle is held: give the oldest entry up
            if victim is None:
                return 0
            self.alloc.drop_handle(victim.handle)
            self._forget(victim)
        handle = self.alloc.take_handle(row, n)
        self._clock += 1
        parent = None
        for j in range(len(keys) - 1, -1, -1):  # the longest cached strict prefix
            hit = self._by_key.get(keys[j])
            if hit is not None and hit[0].n_tokens == (j + 1) * ps and (j + 1) * ps < n:
                parent = hit[0]
                break
        first = int(self.alloc.ledger.refs.page_of[self.alloc.config.max_reqs + handle, 0])
        entry = _Entry(handle, n, keys, self._clock, first, parent=parent)
        self._register(entry)
        self._by_handle[handle] = entry
        self._ends[keys[-1]] = entry
        self._version += 1
        return n

    def _register(self, entry: _Entry) -> None:
        """Point the entry's page keys at it where it is the longest entry holding them."""
        for j, key in enumerate(entry.keys):
            held = self._by_key.get(key)
            if held is None or held[0].n_tokens < entry.n_tokens:
                self._by_key[key] = (entry, j)
            holders = self._holders.setdefault(key, [])
            if entry not in holders:
                holders.append(entry)

    # ---- what the cache could give back ------------------------------------------------
    def reclaimable_handles(self) -> list[int]:
        """Handles of the unlocked entries: the ones eviction may drop. O(entries)."""
        self._reconcile()
        return [h for h, e in self._by_handle.items() if not e.lock_ref]

    def reclaimable_pages(self) -> tuple[int, int]:
        """``(FULL, SWA)`` pages evicting every unlocked entry would free now (pages that
        only unlocked entries reference; SGLang's ``evictable_size`` in pages). Host only;
        cost: :meth:`HybridAllocator.pages_released` over their handles."""
        return self.alloc.pages_released(handles=self.reclaimable_handles())

    # ---- eviction ----------------------------------------------------------------------
    def reclaim(self, builder, n_full: int, n_swa: int) -> None:
        """Plan drops into ``builder`` (the allocator's step being planned) until ``n_full``
        FULL and ``n_swa`` SWA more pages are free, or nothing more can be given: SWA first
        by tombstoning, then FULL by evicting; unlocked entries only, LRU, leaves first
        (an entry no live entry extends). The drops are the step's: the cache forgets an
        evicted entry once the step has run (a refused step keeps it)."""
        self._reconcile(current=builder)
        led = builder.ledger
        target_full = led.full.n_free + max(n_full, 0)
        target_swa = led.swa.n_free + max(n_swa, 0)
        ref = weakref.ref(builder)
        for tombstone in (True, False):
            while (led.swa.n_free < target_swa) if tombstone else (led.full.n_free < target_full):
                entry = self._victim(builder, tombstone)
                if entry is None:
                    break
                full0, swa0 = led.full.n_free, led.swa.n_free
                builder.drop_handle(entry.handle, swa_only=tombstone)
                led = builder.ledger
                self._dropping.append(_Drop(entry, ref, tombstone, led.full.n_free - full0,
                                            led.swa.n_free - swa0))
                self._version += 1

    def evict(self, n_full: int = 0, n_swa: int = 0) -> None:
        """Free at least ``n_full`` FULL and ``n_swa`` SWA pages now if the cache can (one
        step; deferred inside ``free_group()``)."""
        self._reconcile()
        self.alloc._cache_reclaim(self, n_full, n_swa)
        self._reconcile()

    def drop_all(self) -> None:
        """Drop every entry, locked or not (one step; deferred into an open
        ``free_group()``)."""
        self._reconcile()
        entries = list(self._by_handle.values())
        if not entries:
            return
        group = self.alloc.free_group()
        try:
            group.__enter__()
        except NestedGroupError:  # a block is open: the drops join it
            group = None
        try:
            for entry in entries:
                self.alloc.drop_handle(entry.handle)
                self._forget(entry)
        finally:
            if group is not None:
                group.__exit__(None, None, None)

    def _victim(self, builder, tombstone: bool) -> _Entry | None:
        """The LRU unlocked entry to tombstone (not tombstoned yet) or evict, among entries
        no live (for a tombstone: untombstoned) entry extends first, then among the rest
        (an entry extended by a locked one can still give its own pages back)."""
        led, pending = builder.ledger, builder.pending_handles

        def alive(e: _Entry) -> bool:  # (a handle tombstoned in this step may be evicted in it)
            h = e.handle
            return bool(led.h_live[h]) and not (pending is not None and pending[h])

        def untombstoned(e: _Entry) -> bool:
            return bool(led.h_swa_start[e.handle] < led.h_len[e.handle])

        entries = [e for e in self._by_handle.values() if alive(e)]
        extended = {id(e.parent) for e in entries if e.parent is not None
                    and (untombstoned(e) or not tombstone)}
        best, best_key = None, None
        for e in entries:
            if e.lock_ref or (tombstone and not untombstoned(e)):
                continue
            key = (id(e) in extended, e.last_used)
            if best is None or key < best_key:
                best, best_key = e, key
        return best

    def _lru_leaf(self) -> _Entry | None:
        """The LRU unlocked entry no other entry extends (for insert's handle slot)."""
        entries = list(self._by_handle.values())
        extended = {id(e.parent) for e in entries if e.parent is not None}
        leaves = [e for e in entries if id(e) not in extended and not e.lock_ref]
        return min(leaves, key=lambda e: e.last_used) if leaves else None

    def _touch(self, entry: _Entry) -> None:
        while entry is not None:
            entry.last_used = self._clock
            entry = entry.parent

    def _forget(self, entry: _Entry) -> None:
        """Remove an evicted entry; its keys fall back to the other entries holding them."""
        if self._by_handle.get(entry.handle) is not entry:
            return
        del self._by_handle[entry.handle]
        self._version += 1
        if self._ends.get(entry.keys[-1]) is entry:
            del self._ends[entry.keys[-1]]
        for other in self._by_handle.values():
            if other.parent is entry:
                other.parent = entry.parent
        for key in entry.keys:
            if self._by_key.get(key, (None,))[0] is entry:
                del self._by_key[key]
            holders = self._holders[key]
            holders.remove(entry)
            if not holders:
                del self._holders[key]
        for other in self._by_handle.values():  # O(entries x pages): eviction is rare
            self._register(other)

    # ---- transactions ------------------------------------------------------------------
    def _held(self, entry: _Entry):
        """The entry's handle as the allocator sees it now (an open free group included):
        ``None`` when it is gone (dropped, or the id re-taken on other pages)."""
        try:
            info = self.alloc.handle_info(entry.handle)
        except UnknownHandleError:
            return None
        page = int(self.alloc.ledger.refs.page_of[self.alloc.config.max_reqs + entry.handle, 0])
        if info.n_tokens != entry.n_tokens or page != entry.first_page:
            return None
        return info

    def _reconcile(self, current=None) -> None:
        """Settle the drops of steps that are no longer being planned (every drop but
        ``current``'s): forget the entries whose handle is gone and count the pages; a
        refused or dry-run step left its entries held, and they stay. O(drops)."""
        if not self._dropping:
            return
        keep = []
        for drop in self._dropping:
            if current is not None and drop.builder() is current:
                keep.append(drop)
                continue
            info = self._held(drop.entry)
            if drop.tombstone:
                if info is None or info.swa_start >= info.n_tokens:
                    self._tombstoned_pages += drop.n_swa
            elif info is None:
                self._evicted_pages += drop.n_full
                self._tombstoned_pages += drop.n_swa
                self._forget(drop.entry)
        self._dropping = keep
        self._version += 1

    def check(self) -> None:
        """Every entry's handle is held (an integrity aid for tests)."""
        self._reconcile()
        for h, entry in self._by_handle.items():
            if self._held(entry) is None:
                raise ContractError(f"prefix cache entry on handle {h}, which is not held")
