"""An SGLang-style SWA radix tree for the scheduler benchmark (``sched_sglang_prefix``).

Written from SGLang's documented ``SWARadixCache`` behaviour. Keys are token ids on the
host (numpy), page aligned; a node's value is the device tensor of its tokens' FULL slots
(int64, ``len(value) == len(key)``); a node's SWA KV is the SWA slots those FULL slots map
to (``full_to_swa``), unless the node is a *tombstone* (its SWA freed, FULL kept)::

    match_prefix   walk whole pages from the root, splitting the last node at the
                   mismatch; the match may end at a node only if its path has no
                   tombstone, or at least `window` non-tombstone tokens follow the last
                   tombstone (an SWA layer there reads the window before the hit)
    insert         walk and split as match; an existing non-tombstone node frees the
                   incoming duplicate slots; a tombstone node beyond the caller's shared
                   prefix adopts the incoming SWA (a locked node keeps its FULL slots and
                   is re-mapped to the incoming SWA, an unlocked one takes the incoming
                   slots, its own FULL freed); the rest becomes new nodes, the part whose
                   SWA the request already evicted ([.., swa_evicted_seqlen)) a tombstone
    locks          inc_lock_ref(node): FULL lock on every node up to the root, SWA lock
                   on the nodes from `node` up until `window` tokens are covered (the last
                   one gets a uuid that dec_lock_ref stops at); unlocked nodes are
                   evictable, sizes kept in tokens: full/swa evictable and protected
    evict          FULL: least recently used unlocked leaves, freed (FULL + SWA), then
                   tombstone parents left as leaves; SWA (when the SWA pool is still
                   short): least recently used unlocked non-tombstone nodes, SWA first:
                   an internal node (or a leaf a request still holds FULL) is tombstoned,
                   an unlocked leaf deleted

Departures (each stated, none changes what is cached when nothing is evicted): LRU order
comes from a heap built per eviction call (SGLang keeps two linked LRU lists); a split or
a new node keeps a view of the inserted tensor (SGLang clones); SGLang's optional SWA
optimisations (releasing a request's prefix SWA lock once its decode passes the window,
splitting leaves at one window on insert, compacting single-child chains) are off, as
they are by default behind SGLang's environment switches.

The tree frees through its owner: ``free(value, swa_from)`` frees the FULL pages of a
page-aligned value and the SWA pages of ``value[swa_from:]``; ``free_swa(value)`` the SWA
pages only; ``remap(dst, src)`` points ``dst``'s FULL slots at ``src``'s SWA slots and
clears ``src``'s mapping (``src``'s FULL pages are then freed with ``free(src, len)``).
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["SWARadixTree", "Node"]


class Node:
    __slots__ = ("children", "parent", "key", "value", "swa_tombstone", "full_lock_ref",
                 "swa_lock_ref", "swa_uuid", "last_access", "deleted")

    def __init__(self, parent, key, value, tombstone: bool, tick: int):
        self.children: dict = {}  # first page's token bytes -> child
        self.parent = parent
        self.key = key  # int32 token ids, page aligned
        self.value = value  # device int64 FULL slots, len(key) of them
        self.swa_tombstone = tombstone
        self.full_lock_ref = 0
        self.swa_lock_ref = 0  # invariant: full_lock_ref >= swa_lock_ref
        self.swa_uuid = None
        self.last_access = tick
        self.deleted = False

    def __lt__(self, other):
        return self.last_access < other.last_access


class SWARadixTree:
    """The tree (module docstring). ``owner`` frees pages (``free``, ``free_swa``,
    ``remap``); ``window`` is SGLang's ``sliding_window_size`` (the allocator's W - 1)."""

    def __init__(self, owner, page_size: int, window: int):
        self.owner, self.ps, self.window = owner, page_size, window
        self.tick = 0
        self.root = Node(None, np.zeros(0, np.int32), None, False, 0)
        self.root.full_lock_ref = self.root.swa_lock_ref = 1
        self.full_evictable = self.full_protected = 0  # tokens
        self.swa_evictable = self.swa_protected = 0
        self._uuid = 0

    # ---- helpers -------------------------------------------------------------------
    def _now(self) -> int:
        self.tick += 1
        return self.tick

    def _child_key(self, key) -> bytes:
        return key[:self.ps].tobytes()

    def _match_len(self, a, b) -> int:
        m = min(len(a), len(b))
        neq = np.flatnonzero(a[:m] != b[:m])
        k = int(neq[0]) if len(neq) else m
        return k // self.ps * self.ps

    def _split(self, child: Node, p: int) -> Node:
        """``child`` -> upper [0, p) (returned, takes the locks and the uuid) + lower."""
        up = Node(child.parent, child.key[:p], child.value[:p], child.swa_tombstone,
                  child.last_access)
        up.full_lock_ref, up.swa_lock_ref = child.full_lock_ref, child.swa_lock_ref
        up.swa_uuid, child.swa_uuid = child.swa_uuid, None
        child.parent.children[self._child_key(child.key)] = up
        child.key, child.value = child.key[p:], child.value[p:]
        child.parent = up
        child.last_access = self._now()  # a child is more recent than its parent
        up.children[self._child_key(child.key)] = child
        return up

    def _add(self, parent: Node, key, value, tombstone: bool) -> Node:
        node = Node(parent, key, value, tombstone, self._now())
        parent.children[self._child_key(key)] = node
        self.full_evictable += len(key)
        if not tombstone:
            self.swa_evictable += len(key)
        return node

    # ---- match ----------------------------------------------------------------------
    def match_prefix(self, key) -> tuple[list, Node, int]:
        """``(values, last_node, n_tokens)`` of the longest usable match of ``key``
        (page-aligned by the caller). Marks the matched path most recently used."""
        node, values = self.root, []
        since_tombstone = float("inf")  # a path without a tombstone always matches
        best_len, best_node = 0, node
        n = 0
        while len(key) and self._child_key(key) in node.children:
            child = node.children[self._child_key(key)]
            if child.swa_tombstone:
                if since_tombstone >= self.window:
                    best_len, best_node = n, node
                since_tombstone = 0
            p = self._match_len(child.key, key)
            split = p < len(child.key)
            if split:
                child = self._split(child, p)
            values.append(child.value)
            n += p
            if not child.swa_tombstone:
                since_tombstone += p
            node = child
            key = key[p:]
            if split:
                break
        if since_tombstone >= self.window:
            best_len, best_node = n, node
        t = self._now()
        x = best_node
        while x is not self.root:  # nodes nearer the root are less recently used
            x.last_access = t
            t -= 1e-6
            x = x.parent
        out, m = [], 0
        for v in values:
            if m >= best_len:
                break
            out.append(v)
            m += len(v)
        return out, best_node, best_len

    # ---- insert ---------------------------------------------------------------------
    def insert(self, key, value, prev_prefix_len: int, swa_evicted_seqlen: int = 0) -> int:
        """Insert ``key`` -> ``value``; returns the tokens already in the tree (their
        incoming slots are freed or adopted here, module docstring)."""
        node, total, own = self.root, 0, self.owner
        while len(key) and self._child_key(key) in node.children:
            node = node.children[self._child_key(key)]
            node.last_access = self._now()
            p = self._match_len(node.key, key)
            if p < len(node.key):
                node = self._split(node, p)
            if prev_prefix_len < total + p:  # beyond what the caller already shared
                # (its shared prefix ends at a node boundary: the match split there)
                assert total >= prev_prefix_len, "a node straddles the shared prefix"
                self._overlap(node, value[:p], total, p, swa_evicted_seqlen)
            total += p
            key, value = key[p:], value[p:]
        if len(key):
            end = total + len(key)
            if swa_evicted_seqlen >= end:  # nothing left with SWA: no tombstone leaves
                own.free(value, len(value))
                return total
            if swa_evicted_seqlen > total:
                t = swa_evicted_seqlen - total
                node = self._add(node, key[:t], value[:t], True)
                key, value = key[t:], value[t:]
            self._add(node, key, value, False)
        return total

    def _overlap(self, node: Node, incoming, total: int, p: int, swa_ev: int) -> None:
        own = self.owner
        if not node.swa_tombstone:  # a duplicate: free the incoming slots
            own.free(incoming, min(p, max(0, swa_ev - total)))
            return
        if swa_ev <= total:  # the incoming SWA is all there: the node adopts it
            self._recover(node, incoming)
        elif swa_ev < total + p:  # partly: the suffix adopts it, the rest is freed
            s = swa_ev - total
            lower = node
            self._split(lower, s)  # lower keeps [s, p) of this node
            own.free(incoming[:s], s)
            self._recover(lower, incoming[s:])
        else:
            own.free(incoming, p)

    def _recover(self, node: Node, incoming) -> None:
        """A tombstone takes the incoming SWA back (module docstring)."""
        if node.full_lock_ref > 0:
            self.owner.remap(node.value, incoming)
            self.owner.free(incoming, len(incoming))  # FULL only: its SWA moved
        else:
            self.owner.free(node.value, len(node.value))
            node.value = incoming
        node.swa_tombstone = False
        if node.swa_lock_ref == 0:
            self.swa_evictable += len(node.key)
        else:
            self.swa_protected += len(node.key)

    # ---- locks ----------------------------------------------------------------------
    def inc_lock_ref(self, node: Node):
        """Lock ``node``'s path; returns the uuid ``dec_lock_ref`` stops its SWA unlock at."""
        swa_size, uuid = 0, None
        while node is not self.root:
            n = len(node.key)
            if node.full_lock_ref == 0:
                self.full_evictable -= n
                self.full_protected += n
            node.full_lock_ref += 1
            if swa_size < self.window:
                assert not node.swa_tombstone, "SWA lock on a tombstone"
                if node.swa_lock_ref == 0:
                    self.swa_evictable -= n
                    self.swa_protected += n
                node.swa_lock_ref += 1
                swa_size += n
                if swa_size >= self.window:
                    if node.swa_uuid is None:
                        self._uuid += 1
                        node.swa_uuid = self._uuid
                    uuid = node.swa_uuid
            node = node.parent
        return uuid

    def dec_lock_ref(self, node: Node, uuid) -> None:
        swa = True
        while node is not self.root:
            n = len(node.key)
            if node.full_lock_ref == 1:
                self.full_evictable += n
                self.full_protected -= n
            node.full_lock_ref -= 1
            if swa:
                if node.swa_lock_ref == 1:
                    self.swa_evictable += n
                    self.swa_protected -= n
                node.swa_lock_ref -= 1
                if uuid is not None and node.swa_uuid == uuid:
                    swa = False
            node = node.parent

    # ---- eviction -------------------------------------------------------------------
    def _nodes(self) -> list:
        out, stack = [], list(self.root.children.values())
        while stack:
            x = stack.pop()
            out.append(x)
            stack.extend(x.children.values())
        return out

    def _delete_leaf(self, x: Node) -> None:
        del x.parent.children[self._child_key(x.key)]
        x.deleted = True
        self.full_evictable -= len(x.key)
        if not x.swa_tombstone:
            self.swa_evictable -= len(x.key)

    def _free_leaf(self, x: Node) -> int:
        """Free and delete an unlocked leaf, then the tombstone leaves it exposes; returns
        the FULL tokens freed."""
        self.owner.free(x.value, len(x.value) if x.swa_tombstone else 0)
        n = len(x.key)
        self._delete_leaf(x)
        p = x.parent
        while (p is not self.root and not p.children and p.swa_tombstone
               and p.full_lock_ref == 0):
            self.owner.free(p.value, len(p.value))  # a tombstone: FULL only
            n += len(p.key)
            self._delete_leaf(p)
            p = p.parent
        return n

    def evict(self, full_tokens: int, swa_tokens: int) -> tuple[int, int]:
        """Free at least ``full_tokens`` FULL and ``swa_tokens`` SWA tokens where unlocked
        entries allow; returns what was freed (FULL, SWA)."""
        full_done = swa_done = 0
        if full_tokens > 0:
            heap = [x for x in self._nodes() if not x.children and x.full_lock_ref == 0]
            heapq.heapify(heap)
            while full_done < full_tokens and heap:
                x = heapq.heappop(heap)
                if x.deleted or x.children or x.full_lock_ref:
                    continue
                if not x.swa_tombstone:
                    swa_done += len(x.key)
                full_done += self._free_leaf(x)
                p = x.parent
                while p.deleted:
                    p = p.parent
                if p is not self.root and not p.children and p.full_lock_ref == 0:
                    heapq.heappush(heap, p)
        if swa_done < swa_tokens:
            heap = [x for x in self._nodes() if not x.swa_tombstone and x.swa_lock_ref == 0]
            heapq.heapify(heap)
            while swa_done < swa_tokens and heap:
                x = heapq.heappop(heap)
                if x.deleted or x.swa_tombstone or x.swa_lock_ref:
                    continue
                swa_done += len(x.key)
                if x.children or x.full_lock_ref > 0:  # tombstone it: SWA only
                    self.owner.free_swa(x.value)
                    x.swa_tombstone = True
                    self.swa_evictable -= len(x.key)
                else:
                    full_done += self._free_leaf(x)
        return full_done, swa_done

    # ---- checks ---------------------------------------------------------------------
    def audit(self, locked_paths) -> dict:
        """Recount from the nodes (O(nodes)): sizes equal the counters, no tombstone leaf,
        every FULL lock count equals the running requests whose path holds the node
        (``locked_paths``: their last nodes)."""
        nodes = self._nodes()
        want: dict = {}
        for last in locked_paths:
            x = last
            while x is not self.root:
                want[id(x)] = want.get(id(x), 0) + 1
                x = x.parent
        full_prot = sum(len(x.key) for x in nodes if x.full_lock_ref)
        full_evict = sum(len(x.key) for x in nodes if not x.full_lock_ref)
        swa_prot = sum(len(x.key) for x in nodes if not x.swa_tombstone and x.swa_lock_ref)
        swa_evict = sum(len(x.key) for x in nodes
                        if not x.swa_tombstone and not x.swa_lock_ref)
        return {
            "sizes_ok": (full_prot, full_evict, swa_prot, swa_evict) == (
                self.full_protected, self.full_evictable, self.swa_protected,
                self.swa_evictable),
            "no_tombstone_leaf": not any(x.swa_tombstone and not x.children for x in nodes),
            "locks_ok": all(x.full_lock_ref == want.get(id(x), 0) for x in nodes),
            "nodes": len(nodes)}


if __name__ == "__main__":  # a module, not a script: --help says what it is and what to run
    import argparse

    _ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=(
            "A module imported by other scripts; run benchmarks/bench_scheduler.py "
            "instead (each takes --help)."))
    _ap.parse_args()
    _ap.error("nothing to run here: see --help")
