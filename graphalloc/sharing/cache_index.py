"""The prefix cache's index: its entries, their page keys, the locks and the reclaim order.

:class:`CacheIndex` is the part of the prefix cache the layers below the allocator see. It
owns the table of entries (each one handle on a whole prefix ``[0, n)``; each page key knows
the entries holding it), answers :meth:`CacheIndex.match` / :meth:`CacheIndex.lookup` from
the host ledger's handle arrays, keeps the locks, and is the pipeline's **reclaim policy**
(:class:`~graphalloc.parts.ReclaimPolicy`): when a step is short of pages or state slots,
:class:`~graphalloc.plan.pipeline.StepPipeline` plans it again with :meth:`CacheIndex.offer`
(unlocked entries, leaves first, least recently used first) and tells
:meth:`CacheIndex.on_reclaimed` what the submitted step dropped. It submits no step itself:
the client that takes and drops handles (:class:`graphalloc.sharing.prefix_cache.PrefixCache`,
on the front-end floor) does. The rules of keys, windows and state snapshots are stated in
:mod:`graphalloc.sharing.prefix_cache`.

Invariants: every entry's handle is live in the ledger with the entry's length once the
step that took it was submitted (:meth:`CacheIndex.check`); an entry is in exactly one of
the locked set, the unlocked leaves, the unlocked inner entries; a page key's holders are
the entries whose prefix contains that page.

Cost: ``match`` O(pages of the prompt) hashing (about 0.1 us a page in C; none for the
pages ``keys=`` covers) and one dict lookup per matched page, then, from the longest match
back, the entries holding a page scanned until one has the window; ``add_entry`` about 70 ns
a page; ``lock`` / ``unlock`` / touching an entry O(1) (ordered dicts); forgetting an entry
O(its pages); ``offer`` O(entries offered). Nothing scans the table.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools

import numpy as np

from ..errors import ContractError, UnknownHandleError
from ..parts import LedgerPart
from .page_keys import check_key_hash, page_keys

__all__ = ["CacheIndex", "CacheMatch"]


@dataclasses.dataclass(frozen=True)
class CacheMatch:
    """``cached_tokens`` usable as they are (window present) with ``handle``;
    ``full_tokens`` the longest FULL match (``full_handle``), of which ``recompute_tokens``
    at the end lack their SWA pages. With recurrent-state slots ``cached_tokens`` ends at an
    entry's end (a snapshot) and ``state_recompute_tokens`` counts the matched tokens past it
    (the recurrent layers recompute them). Handles are ``-1`` when there is no match.
    ``keys``: the request's page keys as the match computed or extended them (pass them to
    :meth:`PrefixCache.insert` as ``keys=``: no page is hashed twice); not compared."""

    cached_tokens: int = 0
    handle: int = -1
    full_tokens: int = 0
    full_handle: int = -1
    recompute_tokens: int = 0
    state_recompute_tokens: int = 0
    keys: list = dataclasses.field(default_factory=list, compare=False, repr=False)


@dataclasses.dataclass(eq=False)
class _Entry:
    handle: int
    n_tokens: int
    keys: list
    parent: _Entry | None = None
    children: dict = dataclasses.field(default_factory=dict)  # handle -> entry extending it
    lock_ref: int = 0


class CacheIndex:
    """The entries of a prefix cache over an allocator's handles (see the module docstring).

    ``config`` / ``ledger``: the allocator's geometry and host ledger (read only: the handle
    arrays say what each entry still holds). ``key_hash``: how page keys are hashed,
    ``"siphash"`` (default: fast, not cryptographic) or ``"blake2b"`` (multi-tenant
    deployments whose users choose tokens); fixed for the cache's life. ``hits`` /
    ``misses`` count :meth:`match` calls; ``hit_tokens`` the tokens reused;
    ``dropped_pages`` / ``tombstoned_pages`` what reclaiming returned (FULL pages of dropped
    entries / SWA pages of tombstoned ones, steps submitted); ``version`` changes whenever
    entries, locks or handles may have changed."""

    def __init__(self, config, ledger: LedgerPart, key_hash: str = "siphash"):
        self.key_hash = check_key_hash(key_hash)
        self.ledger = ledger
        self.page_size = config.page_size
        self.window = config.sliding_window
        self.states = config.num_state_slots > 0  # match only at snapshots
        # a model's further window pools: an entry is usable where each still has its window
        self._extras = tuple(zip(config.pools.extras, ledger.windows, strict=True))
        self._holders: dict[bytes, dict[int, _Entry]] = {}  # page key -> handle -> entry
        self._ends: dict[bytes, _Entry] = {}  # an entry's last page key -> the entry
        self._entries: dict[int, _Entry] = {}  # handle -> entry
        # Unlocked entries in reclaim order, least recently used first: leaves (no entry
        # extends them), then the others. Moving an entry is O(1).
        self._leaves: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self._inner: collections.OrderedDict[int, _Entry] = collections.OrderedDict()
        self.version = 0
        self.hits = self.misses = self.hit_tokens = 0
        self.dropped_pages = self.tombstoned_pages = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, handle) -> bool:
        """Whether ``handle`` is a cache entry's. O(1)."""
        return handle in self._entries

    def stats(self) -> dict:
        return {"cache_entries": len(self), "cache_hits": self.hits,
                "cache_misses": self.misses, "cache_hit_tokens": self.hit_tokens,
                "cache_dropped_pages": self.dropped_pages,
                "cache_evicted_pages": self.dropped_pages,  # deprecated key: dropped_pages
                "cache_tombstoned_pages": self.tombstoned_pages}

    # ---- keys ----------------------------------------------------------------------------
    def keys_of(self, token_ids=None, *, keys: list | None = None, salt=None,
                extra_keys=None) -> list:
        """The page keys of ``token_ids``'s whole pages with this cache's hash:
        :func:`page_keys` extending ``keys`` (the request's, kept) in place; with no
        ``token_ids``, ``keys`` as they are. ``ContractError`` when neither is given.
        O(new pages) hashing."""
        if token_ids is None:
            if keys is None:
                raise ContractError("give token_ids, or keys= (the request's page keys), or "
                                    "both (keys extended to the tokens' pages)")
            if type(keys) is not list or not all(type(k) is bytes for k in keys):
                raise ContractError("keys must be a list of bytes (page keys, or an engine's "
                                    f"block hashes), got {type(keys).__name__}")
            return keys
        return page_keys(token_ids, self.page_size, keys, salt=salt, extra_keys=extra_keys,
                         key_hash=self.key_hash)

    # ---- lookup --------------------------------------------------------------------------
    def match(self, token_ids=None, *, keys: list | None = None, salt=None,
              extra_keys=None) -> CacheMatch:
        """The longest cached prefix of ``token_ids`` (whole pages), see :class:`CacheMatch`.

        ``salt`` / ``extra_keys``: the request's namespace (a tenant, a LoRA adapter,
        multimodal hashes; :func:`page_keys`): a prefix cached under another salt never
        matches. ``keys``: the request's page keys computed before (kept by the caller, or
        an engine's block hashes): extended in place to ``token_ids``' whole pages (only new
        pages hashed; the salt is already in them), or used as they are without
        ``token_ids``. The match covers the first ``len(token_ids) // page_size`` keys (all
        of ``keys`` without ``token_ids``); ``CacheMatch.keys`` is the list. Touches the
        entries it uses (LRU). Host only."""
        ps, led = self.page_size, self.ledger
        keys = self.keys_of(token_ids, keys=keys, salt=salt, extra_keys=extra_keys)
        all_keys = keys
        if token_ids is not None and len(keys) > len(token_ids) // ps:
            keys = keys[:len(token_ids) // ps]
        holders_of = self._holders.get
        n = 0  # pages matched: one dict lookup each
        for key in keys:
            if not holders_of(key):
                break
            n += 1
        if not n:
            self.misses += 1
            return CacheMatch(keys=all_keys)
        m_full = n * ps
        full_entry = next(iter(self._holders[keys[n - 1]].values()))
        best, cached = self._usable(keys, n, led.h_swa_start)
        self._touch(full_entry)
        if best is not None:
            self._touch(best)
        start = int(led.h_swa_start[full_entry.handle])
        ws = max(0, m_full - self.window) // ps * ps
        self.hits += 1
        self.hit_tokens += cached
        return CacheMatch(cached, best.handle if best is not None else -1, m_full,
                          full_entry.handle, max(0, min(start, m_full) - ws),
                          m_full - cached if self.states else 0, all_keys)

    def _usable(self, keys: list, n: int, swa_start) -> tuple:
        """The longest usable match within the first ``n`` matched pages, ``(entry,
        tokens)``: from the longest down, the first page some holder of which keeps the
        window before it (with state slots: an entry ending there does). Usually the first
        page tried; O(pages walked back x their holders)."""
        ps, window = self.page_size, self.window
        for j in range(n - 1, -1, -1):
            m = (j + 1) * ps
            ws = max(0, m - window) // ps * ps
            if self.states:
                end = self._ends.get(keys[j])
                if (end is not None and swa_start[end.handle] <= ws
                        and self._windows_held(end.handle, m)):
                    return end, m
                continue
            for entry in self._holders[keys[j]].values():
                if swa_start[entry.handle] <= ws and self._windows_held(entry.handle, m):
                    return entry, m  # the window before m is held (in every window pool)
        return None, 0

    def _windows_held(self, handle: int, m: int) -> bool:
        """Whether ``handle`` holds, in each further window pool of the model, the window a
        request admitted on its first ``m`` tokens needs. O(further pools)."""
        ps = self.page_size
        return all(pool.present(int(window.h_start[handle]), m, ps)
                   for pool, window in self._extras)

    # ---- locks ---------------------------------------------------------------------------
    def lock(self, handle) -> None:
        """Keep the entry on ``handle`` from being dropped or tombstoned until :meth:`unlock`
        (locks count). O(1). ``UnknownHandleError`` if it is not a cache entry's handle."""
        entry = self._entry(handle, "lock")
        self._unlist(entry)
        entry.lock_ref += 1
        self.version += 1

    def unlock(self, handle) -> None:
        """Undo one :meth:`lock`. O(1)."""
        entry = self._entry(handle, "unlock")
        if entry.lock_ref == 0:
            raise ContractError(f"unlock: the cache entry on handle {entry.handle} is not "
                                "locked")
        entry.lock_ref -= 1
        self._list(entry)
        self.version += 1

    def _unlist(self, entry: _Entry) -> None:
        self._leaves.pop(entry.handle, None)
        self._inner.pop(entry.handle, None)

    def _list(self, entry: _Entry) -> None:
        """Put an unlocked entry at the recent end of its reclaim list."""
        if entry.lock_ref:
            return
        self._unlist(entry)
        (self._inner if entry.children else self._leaves)[entry.handle] = entry

    def is_locked(self, handle) -> bool:
        return self._entry(handle, "is_locked").lock_ref > 0

    def _entry(self, handle, what: str) -> _Entry:
        entry = None
        if not isinstance(handle, (bool, np.bool_)) and isinstance(handle, (int, np.integer)):
            entry = self._entries.get(int(handle))
        if entry is None:
            raise UnknownHandleError(f"{what}: {handle!r} is not the handle of a prefix-cache "
                                     "entry (never cached, or dropped)")
        return entry

    # ---- insertion -----------------------------------------------------------------------
    def lookup(self, keys: list) -> int:
        """The handle of the entry on exactly the prefix whose page keys are ``keys`` (it is
        touched: LRU), or -1 when that prefix is not cached. O(1). An insert recorded into
        a step asks this first (a cached prefix needs no take)."""
        entry = self._ends.get(keys[-1]) if keys else None
        if entry is None:
            return -1
        self._touch(entry)
        return entry.handle

    def add_entry(self, handle: int, keys: list) -> None:
        """Register a handle just taken on the prefix of ``keys`` (its step submitted).
        O(pages)."""
        ps, n = self.page_size, len(keys) * self.page_size
        parent = None
        for j in range(len(keys) - 2, -1, -1):  # the longest cached strict prefix
            cand = self._ends.get(keys[j])
            if cand is not None:
                parent = cand
                break
        entry = _Entry(handle, n, keys, parent)
        if parent is not None:
            parent.children[handle] = entry
            self._list(parent)
        holders = self._holders
        get = holders.get
        for key in keys:  # about 70 ns a page
            held = get(key)
            if held is None:
                holders[key] = {handle: entry}
            else:
                held[handle] = entry
        self._ends[keys[-1]] = entry
        self._entries[handle] = entry
        self._list(entry)
        del ps
        self.version += 1

    # ---- what the cache could give back --------------------------------------------------
    def reclaimable_handles(self) -> list[int]:
        """Handles of the unlocked entries: the ones reclaiming may drop. O(entries)."""
        return [h for h, e in self._entries.items() if not e.lock_ref]

    # ---- reclaiming ----------------------------------------------------------------------
    def offer(self, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` entries the planner may drop, in the order it should: ``(tombstone
        order, drop order)`` -- unlocked entries, leaves first, least recently used first
        (the planner skips tombstoned ones when tombstoning). O(limit)."""
        order = list(itertools.islice(itertools.chain(self._leaves, self._inner), limit))
        arr = np.array(order, dtype=np.int64)
        return arr, arr

    @property
    def n_unlocked(self) -> int:
        """Entries reclaiming may drop. O(1)."""
        return len(self._leaves) + len(self._inner)

    def on_reclaimed(self, reclaimed: list) -> None:
        """A submitted step dropped these ``(handle, tombstone, FULL freed, SWA freed)``
        entries: forget the dropped ones, count the pages. O(pages of the entries)."""
        for handle, tombstone, n_full, n_swa in reclaimed:
            self.dropped_pages += n_full
            self.tombstoned_pages += n_swa
            entry = self._entries.get(handle)
            if entry is not None:
                self._forget(entry, tombstone)

    def plan_reclaim(self, n_full: int, n_swa: int) -> tuple[list[int], list[int]]:
        """``(tombstone, drop)`` handles that free at least ``n_full`` FULL and ``n_swa`` SWA
        pages if the cache can, in reclaim order (unlocked leaves first, least recently
        used first): an entry holding SWA pages is tombstoned while SWA is short, a leaf is
        dropped while FULL is. Changes nothing. O(entries looked at)."""
        led, ps = self.ledger, self.page_size
        tomb, drop, need_swa, need_full = [], [], n_swa, n_full
        for h, e in itertools.chain(list(self._leaves.items()), list(self._inner.items())):
            if need_swa <= 0 and need_full <= 0:
                break
            if need_swa > 0 and led.h_swa_start[h] < led.h_len[h]:
                tomb.append(h)
                need_swa -= (led.h_len[h] - led.h_swa_start[h]) // ps
            elif need_full > 0 and not e.children:
                drop.append(h)
                need_full -= led.h_len[h] // ps
        return [h for h in tomb if h not in drop], drop

    def lru_leaf(self) -> int:
        """The least recently used unlocked leaf's handle (what an insert drops when every
        handle is held), or -1. O(1)."""
        return next(iter(self._leaves), -1)

    def handles(self) -> list[int]:
        """Every entry's handle, locked or not. O(entries)."""
        return list(self._entries)

    def forget(self, handle: int, tombstone: bool = False) -> None:
        """The step dropping ``handle``'s entry (whole; ``tombstone``: only its SWA part) was
        submitted: forget it. O(its pages + children)."""
        entry = self._entries.get(handle)
        if entry is not None:
            self._forget(entry, tombstone)

    def count_reclaimed(self, n_full: int, n_swa: int) -> None:
        """Count pages a client's own drops returned (FULL dropped, SWA tombstoned)."""
        self.dropped_pages += n_full
        self.tombstoned_pages += n_swa

    def _touch(self, entry: _Entry | None) -> None:
        while entry is not None:
            self._list(entry)
            entry = entry.parent

    def _forget(self, entry: _Entry, tombstone: bool) -> None:
        """The step dropping ``entry`` (whole, or only its SWA part) was submitted: forget
        a dropped entry (its children now extend its parent). O(its pages + children)."""
        self.version += 1
        if tombstone or self._entries.get(entry.handle) is not entry:
            return
        del self._entries[entry.handle]
        self._unlist(entry)
        if self._ends.get(entry.keys[-1]) is entry:
            del self._ends[entry.keys[-1]]
        for key in entry.keys:
            holders = self._holders[key]
            holders.pop(entry.handle, None)
            if not holders:
                del self._holders[key]
        parent = entry.parent
        for child in entry.children.values():
            child.parent = parent
            if parent is not None:
                parent.children[child.handle] = child
        if parent is not None:
            parent.children.pop(entry.handle, None)
            self._list(parent)

    def digest_state(self) -> dict:
        """What the replicas' digest covers (:func:`graphalloc.replicas.digest.cache_digest`):
        the entries in handle order, the reclaim order, the counters. O(entries)."""
        return {"entries": [self._entries[h] for h in sorted(self._entries)],
                "order": list(self._leaves) + [-1] + list(self._inner),
                "counters": [self.hits, self.misses, self.hit_tokens, self.dropped_pages,
                             self.tombstoned_pages]}

    def check(self) -> None:
        """Every entry's handle is held with the entry's length (an integrity aid)."""
        led = self.ledger
        for h, entry in self._entries.items():
            if not led.h_live[h] or led.h_len[h] != entry.n_tokens:
                raise ContractError(f"prefix cache entry on handle {h}, which is not held "
                                    f"with its {entry.n_tokens} tokens")
