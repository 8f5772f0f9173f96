"""A built-in prefix cache on the allocator's handles, aware of the sliding window: the client.

The cache is two parts. Its index (:class:`~graphalloc.sharing.cache_index.CacheIndex`: the
entries, page keys, locks, reclaim order) sits below the allocator and is the pipeline's
reclaim policy; :class:`PrefixCache`, here, is its client on the front-end floor: it answers
the same queries through the index and submits the Steps that take and drop handles
(``insert``, ``reclaim``, ``drop_all``) through the allocator's public operations.

Keys are :func:`~graphalloc.sharing.page_keys.page_keys` (chained, salted: a tenant's
salt or extra keys give its pages keys no other tenant's prompt has), with the cache's
``key_hash``; each entry is one handle on a whole prefix ``[0, n)`` (``take_handle``); each
page key knows the entries holding it. A request's keys are computed once: :meth:`match`
returns them (``CacheMatch.keys``) and :meth:`insert` takes them back (``keys=``), hashing
only the pages the request added since; an engine's own block hashes may be passed instead.

A hit is only as good as its window: an SWA layer at length m reads positions ``[m - W,
m)``, so a request admitted on m cached tokens needs the SWA pages of that window (in a
model with several window pools, each pool's window: :meth:`ExtraWindowPool.present
<graphalloc.pools.extra_window.ExtraWindowPool.present>`).
:meth:`PrefixCache.match` returns the longest match whose window some entry holding it
still has (``cached_tokens``), and the longest FULL match (``full_tokens``) with how many
tokens would then have to be recomputed (``recompute_tokens``).

With recurrent-state slots (``num_state_slots > 0``) a prefix is usable only where a state
snapshot exists, at an entry's end: ``cached_tokens`` is then the longest entry end (with its
window) along the prompt, and ``state_recompute_tokens`` the matched tokens past it that the
recurrent layers must recompute. :meth:`insert` caches a request at its committed length only
(where its state is), when that is page-aligned (vLLM's "align" mode: chunk boundaries on
pages); otherwise it caches nothing. Reclaiming under slot pressure drops whole entries
(their snapshots come back), inside the step, like pages.

Reclaiming (what engines call evicting a cache entry; graphalloc keeps "evict" for the
window, ``docs/glossary.md``), LRU, leaf first (an entry no other entry extends): when an
allocation would be refused, the pipeline plans the step again with the index's
:meth:`~graphalloc.sharing.cache_index.CacheIndex.offer` -- the unlocked entries in reclaim
order -- and the planner reclaims as many as the step needs,
inside the same step: SWA by tombstoning first (FULL kept: it still serves as a
full-attention prefix), then FULL by dropping the entry. An entry frees only the pages
nobody else references. The cache forgets
an entry once the step that dropped its handle was submitted (``on_reclaimed``); a
refused, dry-run or cancelled step keeps it. Locks (SGLang's ``inc_lock_ref``) keep an
entry from both until :meth:`unlock`.

Cost: ``match`` O(pages of the prompt) hashing (about 0.1 us a page in C; none for the
pages ``keys=`` covers) and one dict lookup per matched page, then, from the longest match back, the
entries holding a page scanned until one has the window (the first, unless the window was
tombstoned); ``add_entry`` about 70 ns a page; ``insert`` O(pages of the prefix) plus
one step (the handle's prefix copy); ``lock`` / ``unlock`` / touching an entry O(1)
(ordered dicts); forgetting an entry O(its pages); ``offer`` O(entries offered). Nothing
scans the table.

Ledger of an entry (positions of its prefix)::

    [0, n)            FULL pages referenced by the entry's handle
    [swa_start, n)    SWA pages referenced (swa_start = n after a tombstone)
"""

from __future__ import annotations

import weakref

from ..deprecations import warn_renamed
from .cache_index import CacheIndex, CacheMatch
from .page_keys import page_keys

__all__ = ["PrefixCache", "CacheIndex", "CacheMatch", "page_keys"]


class _IndexCounter:
    """A counter of the cache's index, read and written through the client."""

    def __init__(self, name: str):
        self.name = name

    def __get__(self, cache, owner=None):
        return self if cache is None else getattr(cache.index, self.name)

    def __set__(self, cache, value) -> None:
        setattr(cache.index, self.name, value)


class PrefixCache:
    """Prefix cache over ``alloc``'s handles (see the module docstring): the client that
    submits Steps, over its :class:`~graphalloc.sharing.cache_index.CacheIndex`
    (``index``, built here on the allocator's config and ledger; the allocator gives the
    index, not this client, to its pipeline as the reclaim policy).

    The index's queries are this object's own attributes (bound once, so a call costs what
    it did on one object): ``match``, ``lookup``, ``add_entry``, ``keys_of``, ``lock``,
    ``unlock``, ``is_locked``, ``offer``, ``on_reclaimed``, ``reclaimable_handles``,
    ``digest_state``, ``check``, ``stats``; the counters (``hits``, ``misses``,
    ``hit_tokens``, ``dropped_pages``, ``tombstoned_pages``, ``version``) read the index's.
    ``key_hash``: how page keys are hashed, ``"siphash"`` (default: fast, not
    cryptographic) or ``"blake2b"`` (multi-tenant deployments whose users choose tokens);
    fixed for the cache's life (``HybridAllocator(cfg, prefix_cache="blake2b")``).
    ``evicted_pages`` is the deprecated name of ``dropped_pages``."""

    def __init__(self, alloc, key_hash: str = "siphash"):
        index = self.index = CacheIndex(alloc.config, alloc.ledger, key_hash)
        self._alloc = weakref.ref(alloc)  # the allocator holds its cache: no cycle
        self.key_hash, self.page_size = index.key_hash, index.page_size
        self.window, self.states = index.window, index.states
        self.match, self.lookup, self.add_entry = index.match, index.lookup, index.add_entry
        self.keys_of, self.lock, self.unlock = index.keys_of, index.lock, index.unlock
        self.is_locked, self.offer = index.is_locked, index.offer
        self.on_reclaimed = index.on_reclaimed
        self.reclaimable_handles = index.reclaimable_handles
        self.digest_state, self.check, self.stats = (index.digest_state, index.check,
                                                     index.stats)

    @property
    def alloc(self):
        """The allocator whose handles the cache holds (``None`` once it is gone)."""
        return self._alloc()

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, handle) -> bool:
        """Whether ``handle`` is a cache entry's. O(1)."""
        return handle in self.index

    # ---- the index's counters -------------------------------------------------------------
    @property
    def n_unlocked(self) -> int:
        """Entries reclaiming may drop. O(1)."""
        return self.index.n_unlocked

    hits = _IndexCounter("hits")
    misses = _IndexCounter("misses")
    hit_tokens = _IndexCounter("hit_tokens")
    dropped_pages = _IndexCounter("dropped_pages")
    tombstoned_pages = _IndexCounter("tombstoned_pages")
    version = _IndexCounter("version")

    @property
    def evicted_pages(self) -> int:
        """Deprecated name of :attr:`dropped_pages` (warns)."""
        warn_renamed("PrefixCache.evicted_pages is deprecated: read dropped_pages (graphalloc's "
                     "'evict' is the window's; a cache entry is dropped or tombstoned)")
        return self.index.dropped_pages

    # ---- Steps: taking and dropping handles ------------------------------------------------
    def insert(self, row, token_ids=None, *, keys: list | None = None, salt=None,
               extra_keys=None) -> int:
        """Cache the whole pages of ``token_ids`` that live request ``row`` holds (its first
        positions hold these tokens): at a request's end or a chunked-prefill boundary. With
        recurrent-state slots only at the committed length, page-aligned (else 0).
        ``keys`` / ``salt`` / ``extra_keys`` as for :meth:`match` (pass the match's
        ``CacheMatch.keys``: only the pages added since are hashed). Takes a handle (one
        step) unless the prefix is cached already; when every handle is held, the LRU
        unlocked leaf is dropped first (one more step). Returns the tokens cached (0 when
        nothing could be). Cost: O(new pages) hashing + O(pages) + the step(s)."""
        index, alloc, ps = self.index, self._alloc(), self.page_size
        keys = index.keys_of(token_ids, keys=keys, salt=salt, extra_keys=extra_keys)
        if token_ids is not None:
            keys = keys[:len(token_ids) // ps]
        committed = alloc.committed_len(row)
        n = min(len(keys), committed // ps) * ps
        if self.states and n != committed:  # a snapshot is the state at the committed length
            return 0
        if n == 0:
            return 0
        keys = keys[:n // ps]
        if index.lookup(keys) >= 0:  # this prefix is cached already
            return n
        if not (~alloc.ledger.h_live).any():
            victim = index.lru_leaf()
            if victim < 0:
                return 0
            alloc.drop_handle(victim)
            index.forget(victim)
        handle = alloc.take_handle(row, n)
        index.add_entry(handle, keys)
        return n

    def reclaimable_pages(self) -> tuple[int, int]:
        """``(FULL, SWA)`` pages dropping every unlocked entry would free now (SGLang's
        ``evictable_size`` in pages): a dry run of those drops. Cost: one plan."""
        return self._alloc().pages_released(handles=self.index.reclaimable_handles())

    def evict(self, n_full: int = 0, n_swa: int = 0) -> None:
        """Deprecated name of :meth:`reclaim` (warns)."""
        warn_renamed("PrefixCache.evict(n_full, n_swa) is deprecated: call reclaim(n_full, "
                     "n_swa) (graphalloc's 'evict' is the window's)")
        self.reclaim(n_full, n_swa)

    def reclaim(self, n_full: int = 0, n_swa: int = 0) -> None:
        """Free at least ``n_full`` FULL and ``n_swa`` SWA pages now if the cache can: one
        step of drops in reclaim order (tombstones first;
        :meth:`~graphalloc.sharing.cache_index.CacheIndex.plan_reclaim`). Cost: O(entries
        looked at) and one step."""
        index, alloc = self.index, self._alloc()
        tomb, drop = index.plan_reclaim(n_full, n_swa)
        if tomb or drop:
            led = alloc.ledger
            full0, swa0 = led.full.n_free, led.swa.n_free
            with alloc.free_group():
                for h in drop:
                    alloc.drop_handle(h)
                for h in tomb:
                    alloc.drop_handle_swa(h)
            index.count_reclaimed(led.full.n_free - full0, led.swa.n_free - swa0)
            for h in drop:
                index.forget(h)

    def drop_all(self) -> None:
        """Drop every entry, locked or not (one step; joins an open ``free_group()``)."""
        index, alloc = self.index, self._alloc()
        handles = index.handles()
        if not handles:
            return
        if alloc.group is not None:
            for h in handles:
                alloc.drop_handle(h)
        else:
            with alloc.free_group():
                for h in handles:
                    alloc.drop_handle(h)
        for h in handles:
            index.forget(h)
