"""The SGLang-style baseline with its radix cache on (SGLang's default), for prefix workloads.

:class:`SGLangRadixStyle` is :class:`sched_sglang_style.SGLangStyle` (same device tables,
rings, fused lookup-and-clear, allocation kernels) plus an SWA radix tree
(``sched_sglang_radix.SWARadixTree``), driven per iteration as SGLang's scheduler drives
its ``SWARadixCache``::

    free group       per released request cache_finished_req: its whole pages [0, L)
                     inserted (the part whose SWA it evicted a tombstone), the partial
                     last page freed, its lock released; per evicting request the window
                     rule frees only SWA pages outside the tree ([max(evicted, protected),
                     new)): the tree's pages are the tree's
    admission        match_prefix on the prompt less its last token, page aligned;
                     inc_lock_ref on the matched node; req_to_token[row, :h] = the
                     matched slots (one cat, one copy)
    allocation       as SGLangStyle; when a pool is short, evict(FULL, SWA tokens) first
    after the chunk  cache_unfinished_req for every request that extended: insert its
                     whole computed pages, match again, rewrite req_to_token from the
                     protected length, move its lock to the new node (skipped when the
                     chunk completed no new page)

Request ledger (positions ``[a, b)``)::

    [0, protected)                 the tree's pages (FULL locked by this request; SWA
                                   locked over the window before its last node)
    [protected, L)                 FULL pages the request owns
    [max(evicted, protected), L)   SWA pages the request owns

The trace gives every admission's expected hit; the tree must not hit more (the trace's
cache never evicts); a shorter hit (a pool small enough to evict) is recomputed, its
tokens joining the admission's chunk (``hit_tokens``, ``recomputed_tokens``).

``last_counts`` = (FULL allocated, SWA allocated, FULL freed, SWA freed), freed = pages
pushed back to a ring (content dropped: partial pages, duplicates, SWA pages a request
evicted outside the tree, tree evictions). ``state()`` = (free, used, cached) per pool:
ring, locked tree pages + the requests' own, unlocked tree pages.
"""

from __future__ import annotations

import numpy as np
import torch
from sched_baseline_kernels import NULL_CLOCK, _ceil_div
from sched_sglang_radix import SWARadixTree
from sched_sglang_style import SGLangStyle

__all__ = ["SGLangRadixStyle"]


class SGLangRadixStyle(SGLangStyle):
    """SGLangStyle with the SWA radix cache (module docstring). Cost per step: as
    SGLangStyle, plus per admission O(prompt) host matching, one cat and one copy; per
    extending request O(prompt) host insert + match, one clone, one cat, one copy; per
    release one clone and two launches for the partial page; eviction O(tree nodes)."""

    prefix_cache = True

    def __init__(self, *, tokens, prompt_lens, **kw):
        super().__init__(**kw)
        if tokens is None or prompt_lens is None:
            raise ValueError("the radix cache needs the requests' tokens and prompt_lens "
                             "(Trace.tokens, Trace.fill): a trace with a prefix workload")
        n = kw["n_requests"]
        self.tokens, self.prompt_lens = tokens, prompt_lens
        self.tree = SWARadixTree(self, self.ps, self.window)
        self.protected = np.zeros(n, dtype=np.int64)  # cache_protected_len
        self.evicted = np.zeros(n, dtype=np.int64)  # swa_evicted_seqlen
        self.last_node: dict = {}  # rid -> locked node
        self.lock_uuid: dict = {}
        self.live: dict = {}  # running requests, admission order
        self.hit_tokens = np.full(n, -1, dtype=np.int64)
        self.recomputed_tokens = 0
        self.evicted_pages = [0, 0]  # FULL, SWA pages the tree's evictions freed
        self._parts = {"full": [], "swa": []}
        self._n = {"full": 0, "swa": 0}
        self._freed = {"full": 0, "swa": 0}

    # ---- the tree's owner interface (SGLang's allocator free / free_swa) --------------
    def free(self, value: torch.Tensor, swa_from: int) -> None:
        ps = self.ps
        starts = value[::ps]
        n_pages = len(starts)
        if n_pages == 0:
            return
        self._parts["full"].append(starts // ps)
        self._n["full"] += n_pages
        k = swa_from // ps
        if k < n_pages:
            swa_pages, _ = self.fused(starts[k:], self.full_to_swa, ps)
            self._parts["swa"].append(swa_pages)
            self._n["swa"] += n_pages - k

    def free_swa(self, value: torch.Tensor) -> None:
        starts = value[::self.ps]
        if len(starts):
            swa_pages, _ = self.fused(starts, self.full_to_swa, self.ps)
            self._parts["swa"].append(swa_pages)
            self._n["swa"] += len(starts)

    def remap(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        f2s = self.full_to_swa
        f2s[dst] = f2s[src]
        f2s[src] = 0

    def _flush(self) -> None:
        """Close the free group: one cat + ring write per pool."""
        for pool in ("full", "swa"):
            self._push(pool, self._parts[pool], self._n[pool])
            self._freed[pool] += self._n[pool]
            self._parts[pool], self._n[pool] = [], 0

    def _make_room(self, n_pages: int) -> None:
        short_full = n_pages - self.count["full"]
        short_swa = n_pages - self.count["swa"]
        if short_full > 0 or short_swa > 0:
            ps = self.ps
            full, swa = self.tree.evict(max(0, short_full) * ps, max(0, short_swa) * ps)
            self.evicted_pages[0] += full // ps
            self.evicted_pages[1] += swa // ps
            self._flush()

    # ---- one scheduler iteration -----------------------------------------------------
    def step(self, st, clock=NULL_CLOCK) -> None:
        clock.device_begin()
        self._freed = {"full": 0, "swa": 0}
        for rid in st.release.tolist():
            self._cache_finished(rid)
        for rid in st.evict.tolist():
            self._evict_swa(rid)
        self._flush()  # free_group_end
        ext_n = st.extend_n
        extra = 0
        if len(st.admit):
            extra = np.array([self._admit(rid, h) for rid, h in zip(
                st.admit.tolist(), st.hit.tolist(), strict=True)], dtype=np.int64)
            if extra.any():  # recomputed tokens join the admission's chunk
                ext_n = ext_n.copy()
                ext_n[len(ext_n) - len(extra):] += extra
        n_new = 0
        if len(st.extend_ids):
            n_new += self._allocate(st.extend_ids, ext_n)
        if len(st.decode):
            n_new += self._allocate(st.decode, None)
        for rid in st.extend_ids.tolist():  # after the forward: the chunk is computed
            self._cache_unfinished(rid)
        self._flush()
        clock.device_end()
        self.last_counts = (n_new, n_new, self._freed["full"], self._freed["swa"])

    def _admit(self, rid: int, expected_hit: int) -> int:
        """A new request: row, match, lock, prefix slots; returns tokens to recompute."""
        ps = self.ps
        row = self.row_of[rid] = self.free_rows.pop()
        key = self.tokens[rid][:int(self.prompt_lens[rid]) - 1]
        values, node, hit = self.tree.match_prefix(key[:len(key) // ps * ps])
        if hit > expected_hit:
            raise RuntimeError(f"sglang baseline: request {rid} hits {hit} tokens, the "
                               f"trace {expected_hit}: the trace's cache model misses an "
                               "entry")
        self.lock_uuid[rid] = self.tree.inc_lock_ref(node)
        self.last_node[rid] = node
        if hit:
            self.req_to_token[row, :hit].copy_(values[0] if len(values) == 1
                                               else torch.cat(values))
        self.length[rid] = self.protected[rid] = hit
        self.evicted[rid] = 0
        self.live[rid] = None
        self.hit_tokens[rid] = hit
        self.recomputed_tokens += expected_hit - hit
        return expected_hit - hit

    def _evict_swa(self, rid: int) -> None:
        """The window rule on the request's own SWA pages only (module docstring)."""
        ps = self.ps
        a = max(int(self.evicted[rid]), int(self.protected[rid]))
        new = max(a, max(int(self.length[rid]) - self.window, 0) // ps * ps)
        if new > a:
            row = int(self.row_of[rid])
            swa_pages, _ = self.fused(self.req_to_token[row, a:new:ps], self.full_to_swa, ps)
            self._parts["swa"].append(swa_pages)
            self._n["swa"] += (new - a) // ps
        self.evicted[rid] = new

    def _cache_unfinished(self, rid: int) -> None:
        ps, tree = self.ps, self.tree
        aligned = int(self.length[rid]) // ps * ps
        protected = int(self.protected[rid])
        if aligned <= protected:
            return
        row = int(self.row_of[rid])
        key = self.tokens[rid][:aligned]
        tree.insert(key, self.req_to_token[row, :aligned].clone(), protected)
        values, node, n = tree.match_prefix(key)
        if n != aligned:
            raise RuntimeError(f"sglang baseline: request {rid} inserted {aligned} tokens "
                               f"but matches {n}")
        self.req_to_token[row, protected:n].copy_(torch.cat(values)[protected:])
        tree.dec_lock_ref(self.last_node[rid], self.lock_uuid[rid])
        self.lock_uuid[rid] = tree.inc_lock_ref(node)
        self.last_node[rid] = node
        self.protected[rid] = n

    def _cache_finished(self, rid: int) -> None:
        ps, tree = self.ps, self.tree
        row, length = int(self.row_of[rid]), int(self.length[rid])
        aligned = length // ps * ps
        if aligned:
            tree.insert(self.tokens[rid][:aligned],
                        self.req_to_token[row, :aligned].clone(),
                        int(self.protected[rid]), int(self.evicted[rid]))
        if length > aligned:  # the partial last page: FULL and its SWA (always held)
            self.free(self.req_to_token[row, aligned:aligned + 1], 0)
        tree.dec_lock_ref(self.last_node.pop(rid), self.lock_uuid.pop(rid))
        del self.live[rid]
        self.free_rows.append(row)
        self.row_of[rid] = -1

    # ---- state and checks ------------------------------------------------------------
    def _own_pages(self) -> tuple[int, int]:
        ids = np.fromiter(self.live, dtype=np.int64, count=len(self.live))
        if not len(ids):
            return 0, 0
        ps = self.ps
        end = _ceil_div(self.length[ids], ps)
        prot = self.protected[ids] // ps
        return (int((end - prot).sum()),
                int((end - np.maximum(self.evicted[ids], self.protected[ids]) // ps).sum()))

    def state(self) -> tuple:
        """(free, used, cached) of the FULL pool, then of the SWA pool (O(running))."""
        ps, t = self.ps, self.tree
        own_full, own_swa = self._own_pages()
        return (self.count["full"], t.full_protected // ps + own_full, t.full_evictable // ps,
                self.count["swa"], t.swa_protected // ps + own_swa, t.swa_evictable // ps)

    def verify(self, live_ids) -> dict:
        """Each ring's free section distinct and in range, free + used + cached == pool,
        the tree's counters and locks recounted, exactly the tree's non-tombstone slots
        and the requests' own SWA slots mapped (reads the device)."""
        out = {}
        state = self.state()
        for i, pool in enumerate(("full", "swa")):
            cap, count, head = self.cap[pool], self.count[pool], self.head[pool]
            idx = (head + torch.arange(count, device=self.device)) % cap
            free = self.rings[pool][idx].cpu().numpy()
            out[f"{pool}_free_distinct"] = bool(len(np.unique(free)) == count)
            out[f"{pool}_free_in_range"] = bool(count == 0 or (
                free.min() >= 1 and free.max() <= self.n_pages[pool]))
            out[f"{pool}_conserved"] = sum(state[3 * i:3 * i + 3]) == self.n_pages[pool]
        out["state"] = list(state)
        audit = self.tree.audit(self.last_node.values())
        out["tree_ok"] = audit["sizes_ok"] and audit["no_tombstone_leaf"] and audit[
            "locks_ok"]
        out["live_match"] = sorted(self.live) == sorted(int(x) for x in live_ids)
        ids = np.fromiter(self.live, dtype=np.int64, count=len(self.live))
        own = int((self.length[ids] - np.maximum(self.evicted[ids], self.protected[ids]))
                  .sum()) if len(ids) else 0
        out["mapped_slots"] = int(torch.count_nonzero(self.full_to_swa).item())
        out["mapped_slots_expected"] = (self.tree.swa_protected + self.tree.swa_evictable
                                        + own)
        out["ok"] = all(v for k, v in out.items() if k.endswith(
            ("distinct", "range", "conserved", "_ok", "match"))) and (
            out["mapped_slots"] == out["mapped_slots_expected"])
        return out


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
