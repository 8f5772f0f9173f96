"""A built-in prefix cache on the allocator's handles, aware of the sliding window.

Keys are page-granular and chained over token ids: the key of page j covers its ``ps``
tokens and the key of page j - 1, so equal keys mean equal whole prefixes (BLAKE2b,
deterministic on every rank and every run). Each cache entry is one handle on a whole
prefix ``[0, n)`` (see :meth:`HybridAllocator.take_handle`); every page key of the
prefix points at the entry, so a lookup finds the longest cached prefix in one pass.

A hit is only as good as its window: an SWA layer at length m reads positions
``[m - W, m)``, so a request admitted on m cached tokens needs the SWA pages of the
window before m. :meth:`PrefixCache.match` returns the longest match whose window is
present (``cached_tokens``), and separately the longest FULL match (``full_tokens``)
with how many tokens would then have to be recomputed (``recompute_tokens``).

Eviction (LRU, leaf first: an entry no other entry extends): under SWA pressure an entry
is first tombstoned (its SWA pages dropped, FULL kept: it can still serve as a
full-attention prefix), under FULL pressure evicted (dropped). An entry frees only the
pages nobody else references. The allocator runs eviction itself when an allocation
would otherwise be refused, inside the same step (the drops and the allocation that
needs them are one replay): build it with ``HybridAllocator(cfg, prefix_cache=True)``.

Cost: ``match`` O(pages of the prompt) hashing on the host; ``insert`` the same plus one
device step (the handle's prefix copy); eviction O(entries) per reclaimed entry.

Ledger of an entry (positions of its prefix, ``[a, b)``)::

    [0, n)            FULL pages referenced by the entry's handle
    [swa_start, n)    SWA pages referenced (swa_start = n after a tombstone)
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from .errors import ContractError

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
    n_children: int = 0
    parent: _Entry | None = None


class PrefixCache:
    """Prefix cache over ``alloc``'s handles (see the module docstring).

    ``hits`` / ``misses`` count :meth:`match` calls; ``hit_tokens`` the tokens reused;
    ``evicted_pages`` / ``tombstoned_pages`` the pages eviction returned (FULL / SWA).
    """

    def __init__(self, alloc):
        self.alloc = alloc
        self.page_size = alloc.config.page_size
        self.window = alloc.config.sliding_window
        self._by_key: dict[bytes, tuple[_Entry, int]] = {}  # page key -> (entry, page index)
        self._by_handle: dict[int, _Entry] = {}
        self._ends: dict[bytes, _Entry] = {}  # an entry's last page key -> the entry
        self._clock = 0
        self.hits = self.misses = self.hit_tokens = 0
        self.evicted_pages = self.tombstoned_pages = 0

    def __len__(self) -> int:
        return len(self._by_handle)

    # ---- lookup ------------------------------------------------------------------------
    def match(self, token_ids) -> CacheMatch:
        """The longest cached prefix of ``token_ids`` (whole pages), see :class:`CacheMatch`.
        Touches the entries it uses (LRU). Host only."""
        ps, best_full, best = self.page_size, None, None
        for j, key in enumerate(page_keys(token_ids, ps)):
            hit = self._by_key.get(key)
            if hit is None:
                break
            entry, _ = hit
            m = (j + 1) * ps
            best_full = (entry, m)
            for cand in (entry, self._ends.get(key)):  # the longest holder, the one ending here
                if cand is not None and self._window_present(cand, m):
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
        start = self.alloc.handle_info(full_entry.handle).swa_start
        ws = max(0, m_full - self.window) // self.page_size * self.page_size
        recompute = max(0, min(start, m_full) - ws)  # window tokens whose SWA KV is gone
        self.hits += 1
        cached = best[1] if best else 0
        self.hit_tokens += cached
        return CacheMatch(cached, best[0].handle if best else -1, m_full, full_entry.handle,
                          recompute)

    def _window_present(self, entry: _Entry, m: int) -> bool:
        """Whether the SWA pages of the window before ``m`` are held by the entry."""
        start = self.alloc.handle_info(entry.handle).swa_start
        return start <= max(0, m - self.window) // self.page_size * self.page_size

    # ---- insertion ---------------------------------------------------------------------
    def insert(self, row, token_ids) -> int:
        """Cache the whole pages of ``token_ids`` that live request ``row`` holds (its first
        ``len(token_ids)`` positions hold these tokens): at a request's end or a
        chunked-prefill boundary. Takes a handle (one step) unless the prefix is cached
        already; when every handle is an entry's, the LRU leaf entry is dropped first (one
        more step); returns the tokens cached (0 when nothing could be)."""
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
            victim = self._lru_leaf()  # every handle is an entry's: give the oldest one up
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
        entry = _Entry(handle, n, keys, self._clock, parent=parent)
        if parent is not None:
            parent.n_children += 1
        self._register(entry)
        self._by_handle[handle] = entry
        self._ends[keys[-1]] = entry
        return n

    def _register(self, entry: _Entry) -> None:
        """Point the entry's page keys at it where it is the longest entry holding them."""
        for j, key in enumerate(entry.keys):
            held = self._by_key.get(key)
            if held is None or held[0].n_tokens < entry.n_tokens:
                self._by_key[key] = (entry, j)

    # ---- eviction ----------------------------------------------------------------------
    def reclaim(self, builder, n_full: int, n_swa: int) -> None:
        """Plan drops into ``builder`` (the allocator's step being planned) until ``n_full``
        FULL and ``n_swa`` SWA more pages are free, or nothing more can be given: SWA first
        by tombstoning, then FULL by evicting; LRU among leaves."""
        led = builder.ledger
        target_full = led.full.n_free + max(n_full, 0)
        target_swa = led.swa.n_free + max(n_swa, 0)
        for tombstone in (True, False):
            while (led.swa.n_free < target_swa) if tombstone else (led.full.n_free < target_full):
                entry = self._victim(builder, tombstone)
                if entry is None:
                    break
                full0, swa0 = led.full.n_free, led.swa.n_free
                builder.drop_handle(entry.handle, swa_only=tombstone)
                self.tombstoned_pages += led.swa.n_free - swa0
                self.evicted_pages += led.full.n_free - full0
                if not tombstone:
                    self._forget(entry)
                led = builder.ledger

    def evict(self, n_full: int = 0, n_swa: int = 0) -> None:
        """Free at least ``n_full`` FULL and ``n_swa`` SWA pages now if the cache can (one
        step; deferred inside ``free_group()``)."""
        self.alloc._cache_reclaim(self, n_full, n_swa)

    def drop_all(self) -> None:
        """Drop every entry (one step)."""
        for entry in list(self._by_handle.values()):
            self.alloc.drop_handle(entry.handle)
            self._forget(entry)

    def _victim(self, builder, tombstone: bool) -> _Entry | None:
        led, best = builder.ledger, None
        pending = builder.pending_handles
        for entry in self._by_handle.values():
            if entry.n_children or not led.h_live[entry.handle] or (
                    pending is not None and pending[entry.handle]):
                continue  # (a handle tombstoned in this step may still be evicted in it)
            h = entry.handle
            if tombstone and led.h_swa_start[h] >= led.h_len[h]:
                continue  # tombstoned already
            if best is None or entry.last_used < best.last_used:
                best = entry
        return best

    def _lru_leaf(self) -> _Entry | None:
        leaves = [e for e in self._by_handle.values() if not e.n_children]
        return min(leaves, key=lambda e: e.last_used) if leaves else None

    def _touch(self, entry: _Entry) -> None:
        while entry is not None:
            entry.last_used = self._clock
            entry = entry.parent

    def _forget(self, entry: _Entry) -> None:
        """Remove an evicted entry; its keys fall back to the other entries holding them."""
        del self._by_handle[entry.handle]
        if self._ends.get(entry.keys[-1]) is entry:
            del self._ends[entry.keys[-1]]
        if entry.parent is not None:
            entry.parent.n_children -= 1
        for other in self._by_handle.values():
            if other.parent is entry:
                other.parent = entry.parent
        for key in entry.keys:
            if self._by_key.get(key, (None,))[0] is entry:
                del self._by_key[key]
        for other in self._by_handle.values():  # O(entries x pages): eviction is rare
            self._register(other)

    def check(self) -> None:
        """Every entry's handle is held (an integrity aid for tests)."""
        for h in self._by_handle:
            if not self.alloc.ledger.h_live[h]:
                raise ContractError(f"prefix cache entry on handle {h}, which is not held")
