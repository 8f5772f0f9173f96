"""The vLLM plug-in's prefix-cache entries: vLLM's block hashes as graphalloc page keys.

Contract. A mixin of :class:`~graphalloc.integrations.vllm_manager.GraphallocKVCacheManager`
(its state is the manager's). The blocks vLLM caches for a request (``allocate_slots`` and
``cache_blocks`` name how many tokens) become ONE cache entry of graphalloc's
:class:`~graphalloc.sharing.prefix_cache.PrefixCache` per request: a ``take`` of the row's
whole blocks keyed by ``request.block_hashes`` (salt and extra keys included), in the first
step at which their pages exist; the request's previous entry, a prefix of the new one, is
dropped in that step (its pages stay: the new entry holds them). Blocks noted but not yet in
an entry are ``_filling`` (hash -> row): a lookup that reaches them plans the iteration and
a take step first (vLLM's in-step hits). ``_row_refs`` counts the live rows holding each
FULL page, so a hit's evictable blocks (vLLM takes them from the free count) are those no
live row holds.

Invariants: a handle is taken at most once per step; an entry is only registered after the
step that took it ran; a locked entry is never dropped. Cost: O(new blocks) per noted call;
the takes O(due rows) + O(handles) numpy per step.
"""

from __future__ import annotations

import numpy as np

from ..plan.accumulator import FIELD

__all__ = ["CacheEntries"]

_TAKE_H, _TAKE_ROW, _TAKE_N = FIELD["take_handle"], FIELD["take_row"], FIELD["take_tokens"]
_DROP = FIELD["drop"]


class CacheEntries:
    """The cache-entry half of the plug-in (see the module docstring)."""

    def _cacheable(self, row: int, request, n_tokens: int) -> None:
        """vLLM caches the request's whole blocks of ``n_tokens``: note the new ones
        (their hashes) for the next entry. O(new blocks)."""
        old = max(self._cache_to[row] // self.block_size, self._cached[row])
        self._cache_to[row] = n_tokens
        if n_tokens // self.block_size > self._cached[row]:
            self._due.add(row)
        hashes = request.block_hashes
        for j in range(old, min(n_tokens // self.block_size, len(hashes))):
            self._filling[hashes[j]] = row

    def _evictable(self, handle: int, n_blocks: int) -> int:
        """Blocks of a hit that no live request holds (vLLM's evictable blocks: admitting
        on them takes them from the free count), all groups. O(hit blocks) numpy."""
        pages = self._refs.page_of[self._handle_base + handle, :n_blocks]
        return int(np.count_nonzero(self._row_refs[pages] == 0)) * self.num_kv_cache_groups

    def _evictable_row(self, row: int) -> int:
        """Hit blocks of a row admitted by the recorded step that no live row held."""
        for r, handle, n in self._on:
            if r == row:
                return self._evictable(handle, n // self.block_size) // \
                    self.num_kv_cache_groups
        return 0

    def _flush_takes(self) -> bool:
        """A step of the cache entries due alone (their pages exist); whether it ran."""
        from ..plan.step import Step

        inserts = self._takes()
        if not inserts:
            return False
        self.alloc.run(self.alloc.plan(Step(**self._take_kw(inserts))))
        self.steps += 1
        self._register(inserts)
        return True

    def _take_kw(self, inserts) -> dict:
        """The takes of ``inserts`` and the drops of the entries they supersede, as Step
        keywords recorded in the takes' accumulator (views valid until its next use)."""
        acc = self._take_acc
        acc.clear()
        for h, r, n, _, o in inserts:
            acc.put_one(_TAKE_H, h)
            acc.put_one(_TAKE_ROW, r)
            acc.put_one(_TAKE_N, n)
            if o >= 0:
                acc.put_one(_DROP, o)
        return acc.to_kinds(("take", "drop"))

    def _register(self, inserts) -> None:
        """The step ran: superseded entries forgotten, the new ones registered."""
        cache, filling = self.cache, self._filling
        old = [(o, False, 0, 0) for *_, o in inserts if o >= 0]
        if old:
            cache.on_reclaimed(old)
        for handle, row, n, keys, _ in inserts:
            cache.add_entry(handle, keys)
            self._cached[row] = n // self.block_size
            self._entry_of[row] = handle
            for key in keys:
                filling.pop(key, None)

    def _takes(self) -> list:
        """``(handle, row, tokens, keys, superseded handle)`` of the cache entries due: a
        row's blocks cached since its newest entry, whose pages exist (rows released by
        the step too: takes run first). The row's previous entry, a prefix of the new one,
        is dropped in the same step when nothing locks it (its pages stay: the new entry
        holds them), so a request keeps one entry. O(due rows) + O(handles) numpy."""
        due = self._due
        if not due:
            return []
        led, cache, bs = self.alloc.ledger, self.cache, self.block_size
        reserve = self._take_acc  # the lowest free handle, not reserved by an earlier take
        reserve.clear()
        out = []
        for row in list(due):
            if row in self._new_rows:
                continue
            due.discard(row)
            n_blocks = min(self._cache_to[row], int(led.seq_len[row])) // bs
            if n_blocks < self._cache_to[row] // bs:  # the rest after this step's extend
                due.add(row)
            if n_blocks <= self._cached[row]:
                continue
            keys = list(self._req[row].block_hashes[:n_blocks])
            if len(keys) < n_blocks:
                continue
            if cache.lookup(keys) >= 0:
                self._cached[row] = n_blocks
                continue
            handle = reserve.free_handle(led.h_live)
            if handle < 0:
                due.add(row)
                break
            reserve.put_one(_TAKE_H, handle)
            old = self._entry_of[row]
            if old >= 0 and (cache.is_locked(old) if old in cache else True):
                old = -1
            out.append((handle, row, n_blocks * bs, keys, old))
        return out
