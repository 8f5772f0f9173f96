"""A pure-Python model of the allocator's semantics, written from the rules, not the code.

Plain ints, lists, dicts and deques; no numpy, no torch, nothing from graphalloc
except (optionally) the config dataclass it is built from. It predicts, for the
same sequence of operations, the exact page ids the device hands out (both free
lists are FIFO queues holding pages ``1..N`` in order at start: pop from the
front, push to the back), ``req_to_token`` on every position a live request
holds, ``full_to_swa`` for every slot, the free queues in order, the counts,
and which contract an invalid operation violates.

Rules modelled (``ps`` page size, ``W`` window, ``R`` ring pages, L a length):

* admit: lowest row that is neither live nor released in an open free group.
  An optional protected prefix (whole pages of someone else's slots) is copied
  into the row, never owned, never freed; length = frontier = prefix length.
  Ring mode pops the request's R ring pages (one step).
* extend / decode: positions ``[L, L + n)``; a position starting a page that does
  not exist yet pops one FULL page and (pool mode) one SWA page. Rows are served
  in call order, decode rows before extend rows. Ring mode: the SWA page of page
  index p is ``ring[p % R]``.
* window eviction: ``new = floor_page(max(old, L - W))``; with a protected prefix
  the threshold is ``L - max(W, ps)``; never below the prefix. Advancing the
  frontier from ``old`` to ``new`` pushes the SWA pages of ``[old, new)`` in page
  order, rows in call order (ring mode pushes nothing); the mapping is cleared,
  the FULL pages stay.
* release: pushes, all rows of the call in order each time, first the FULL pages
  of ``[prefix, frontier)``, then the FULL pages of ``[frontier, ceil_page(L))``
  (a partial tail page whole) together with their SWA peers; ring mode pushes the
  ring pages ``ring[0..R-1]`` of each row after that.
* a step runs release, evict, advance, decode, extend in this order: every push of a
  step precedes every pop, so pages freed by a step are reused by it.
* free_group: releases, evictions and frontier advances are decided at the call,
  by the same rules as outside a block (the window rule on the length at the call; an
  advance validated against the frontier as the block has moved it), but the pages
  they free reach the free queues only at exit, in call order. Allocations in the block
  run at once and cannot use those pages; a request released in it cannot allocate and
  its row is not reused before the exit. The exit runs the block's release segments
  (each split every ``max_pages_per_row`` pages) as the fewest consecutive steps that
  each fit the frozen step shape, cut greedily in order; it is never refused.
* the frozen step shape: release segments (split every ``max_pages_per_row``
  pages), freed pages, allocating rows and tokens per step are bounded.

Violations are reported as :class:`Violation` with a set of kinds (names of
the rules broken by the first failing sub-operation); the model is unchanged.
"""

from __future__ import annotations

import copy
from collections import deque

# Violation kinds (the test maps them onto graphalloc.errors classes).
UNKNOWN = "unknown"  # row out of range, not an int, not live, released in this group
OVERLAP = "overlap"  # a row listed twice in one call / allocating twice in one step
CAPACITY = "capacity"  # not enough free pages or rows
ALIGNMENT = "alignment"  # frontier / prefix not page-aligned
POSITION = "position"  # beyond max_context_len, frontier past the last whole page, bad lengths
FRONTIER = "frontier"  # frontier moved backwards
BATCH = "batch"  # frozen step shape exceeded
RING = "ring"  # ring mode: more live pages than ring pages
NESTED = "nested"  # nested free_group / release or evict through step() inside a group


class Violation(Exception):
    def __init__(self, kinds):
        super().__init__(sorted(kinds))
        self.kinds = frozenset(kinds)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _is_int(x) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return True
    return type(x).__module__ == "numpy" and "int" in type(x).__name__


class Req:
    """One live request."""

    def __init__(self, prefix_slots: list[int], ps: int):
        self.slots = list(prefix_slots)  # full slot of each position [0, length)
        self.pages = [prefix_slots[i * ps] // ps for i in range(len(prefix_slots) // ps)]
        self.swa: list[int | None] = [None] * len(self.pages)  # pool mode: SWA page per page
        self.protected = len(prefix_slots)
        self.frontier = len(prefix_slots)
        self.ring: list[int] = []

    @property
    def length(self) -> int:
        return len(self.slots)


class Model:
    def __init__(self, page_size, num_full_pages, num_swa_pages, max_reqs, max_context_len,
                 sliding_window, swa_ring_pages=0, max_release_rows=0, max_pages_per_row=0,
                 max_alloc_rows=0, max_tokens_per_alloc_row=0, max_step_pages=0,
                 max_step_tokens=0):
        self.ps = page_size
        self.n_full = num_full_pages
        self.n_swa = num_swa_pages
        self.max_reqs = max_reqs
        self.max_ctx = max_context_len
        self.window = sliding_window
        self.ring_pages = swa_ring_pages
        # Frozen step shape (defaults as documented in AllocatorConfig).
        self.max_release_rows = max_release_rows or 3 * max_reqs
        self.max_pages_per_row = max_pages_per_row or ceil_div(max_context_len, page_size)
        self.max_alloc_rows = max_alloc_rows or max_reqs
        self.max_tokens_per_alloc_row = max_tokens_per_alloc_row or max_context_len
        self.max_step_pages = max_step_pages or num_full_pages + num_swa_pages
        self.max_step_tokens = (max_step_tokens
                                or self.max_alloc_rows + self.max_tokens_per_alloc_row)

        self.full_q: deque[int] = deque(range(1, num_full_pages + 1))
        self.swa_q: deque[int] = deque(range(1, num_swa_pages + 1))
        self.full_pops = 0  # total pops: the FIFO ring's head is this mod N
        self.swa_pops = 0
        self.reqs: dict[int, Req] = {}
        self.steps = 0
        # free_group state
        self.group: list | None = None  # deferred pushes, in order: ("full"|"swa", page)
        self.group_segs: list[int] = []  # the block's release segments (pages each), in order
        self.deferring = False
        self.pending: set[int] = set()

    @classmethod
    def from_config(cls, cfg) -> Model:
        return cls(cfg.page_size, cfg.num_full_pages, cfg.num_swa_pages, cfg.max_reqs,
                   cfg.max_context_len, cfg.sliding_window, cfg.swa_ring_pages,
                   cfg.max_release_rows, cfg.max_pages_per_row, cfg.max_alloc_rows,
                   cfg.max_tokens_per_alloc_row, cfg.max_step_pages, cfg.max_step_tokens)

    def clone(self) -> Model:
        return copy.deepcopy(self)

    @property
    def ring_mode(self) -> bool:
        return self.ring_pages > 0

    # ---- queues --------------------------------------------------------------------------
    def _pop_full(self) -> int:
        self.full_pops += 1
        return self.full_q.popleft()

    def _pop_swa(self) -> int:
        self.swa_pops += 1
        return self.swa_q.popleft()

    def _push(self, pool: str, page: int) -> None:
        if self.deferring:
            self.group.append((pool, page))
        else:
            (self.full_q if pool == "full" else self.swa_q).append(page)

    # ---- validation helpers --------------------------------------------------------------
    def _rows(self, rows) -> list[int]:
        """Validate a list of rows: ints, in range, live (and not released in the open group),
        each once."""
        rows = list(rows)
        kinds = set()
        for r in rows:
            if not _is_int(r) or not 0 <= int(r) < self.max_reqs or int(r) not in self.reqs:
                kinds.add(UNKNOWN)
            elif int(r) in self.pending:
                kinds.add(UNKNOWN)
        ints = [int(r) for r in rows if _is_int(r)]
        if len(set(ints)) != len(ints):
            kinds.add(OVERLAP)
        if kinds:
            raise Violation(kinds)
        return ints

    # ---- public ops (each one is atomic: on a Violation nothing changed) ------------------
    def admit(self, prefix_slots: list[int] | None = None) -> int:
        prefix = list(prefix_slots or [])
        kinds = set()
        if len(prefix) % self.ps:
            kinds.add(ALIGNMENT)
        if len(prefix) > self.max_ctx:
            kinds.add(POSITION)
        free_rows = [r for r in range(self.max_reqs)
                     if r not in self.reqs and r not in self.pending]
        if not free_rows:
            kinds.add(CAPACITY)
        if self.ring_mode and len(self.swa_q) < self.ring_pages:
            kinds.add(CAPACITY)
        if kinds:
            raise Violation(kinds)
        row = free_rows[0]
        req = Req(prefix, self.ps)
        if self.ring_mode:
            req.ring = [self._pop_swa() for _ in range(self.ring_pages)]
            self.steps += 1
        self.reqs[row] = req
        return row

    def step(self, release=(), evict=None, evict_all=False, advance=None, decode=(),
             extend=None):
        """``evict``: None / rows; ``evict_all``: every live request; ``advance``: (rows, new
        frontiers) or None; ``extend``: (rows, n_tokens) or None. Order: release, evict,
        advance, decode, extend. Returns the allocation results ``[(row, full_slots,
        swa_slots)]`` (decode rows first) or None when nothing allocates."""
        release = [] if release is None else release
        decode = [] if decode is None else decode
        if self.group is not None and (list(release) or evict_all or (evict is not None and
                                                                      list(evict))
                                       or advance is not None):
            raise Violation({NESTED})
        work = self.clone()
        rel_rows: list = []
        results = None
        rel_rows += work._release(work._rows(release))
        if evict_all or evict is not None:
            rows = sorted(work.reqs) if evict_all else work._rows(evict)
            rel_rows += work._advance(rows, [work.window_frontier(r) for r in rows])
        if advance is not None:
            rel_rows += work._advance(work._rows(advance[0]), [int(p) for p in advance[1]])
        allocated: set[int] = set()
        alloc_rows: list = []
        if list(decode):
            rows = work._rows(decode)
            results = (results or []) + work._extend(rows, [1] * len(rows), allocated,
                                                     alloc_rows)
        if extend is not None:
            rows = work._rows(extend[0])
            results = (results or []) + work._extend(rows, list(extend[1]), allocated,
                                                     alloc_rows)
        work._check_shape(rel_rows, alloc_rows)
        work.steps += 1
        self.__dict__.update(work.__dict__)
        return results

    def _defer(self, fn) -> None:
        """Inside a free group: decide the frees now (on a clone, so a violation changes
        nothing), keep their pushes for the exit."""
        work = self.clone()
        work.deferring = True
        work.group_segs = work.group_segs + fn(work)
        work.deferring = False
        self.__dict__.update(work.__dict__)

    def advance_frontier(self, rows, new_pos) -> None:
        rows_v = self._rows(rows)
        new_pos = [int(p) for p in new_pos]
        if self.group is not None:
            self._defer(lambda w: w._advance(rows_v, new_pos))
            return
        work = self.clone()
        rel_rows = work._advance(rows_v, new_pos)
        work._check_shape(rel_rows, [])
        work.steps += 1
        self.__dict__.update(work.__dict__)

    def evict_window(self, rows=None) -> None:
        if self.group is not None:
            rows_v = sorted(self.reqs) if rows is None else self._rows(rows)
            self._defer(lambda w: w._advance(rows_v, [w.window_frontier(r) for r in rows_v]))
            return
        if rows is None:
            self.step(evict_all=True)
        else:
            self.step(evict=rows)

    def release(self, rows) -> None:
        if self.group is not None:
            rows_v = self._rows(rows)
            self._defer(lambda w: w._release(rows_v))
            self.pending.update(rows_v)
            return
        self.step(release=rows)

    def alloc_extend(self, rows, n_tokens):
        return self.step(extend=(rows, n_tokens))

    def alloc_decode(self, rows):
        return self.step(decode=rows)

    # ---- free_group ------------------------------------------------------------------------
    def open_group(self) -> None:
        if self.group is not None:
            raise Violation({NESTED})
        self.group = []

    def close_group(self) -> None:
        """Push the block's deferred pages in order, as the fewest consecutive steps whose
        release rows each fit the frozen shape (greedy cut, in order). Never refused."""
        pushes, segs = self.group, self.group_segs
        self.group, self.group_segs, self.pending = None, [], set()
        for pool, page in pushes:
            self._push(pool, page)
        rows = [min(self.max_pages_per_row, n - k * self.max_pages_per_row)
                for n in segs for k in range(self._segments(n))]
        n_rows = n_pages = 0
        for i, pages in enumerate(rows):
            if i == 0 or n_rows + 1 > self.max_release_rows or (
                    n_pages + pages > self.max_step_pages):
                self.steps += 1
                n_rows = n_pages = 0
            n_rows += 1
            n_pages += pages

    # ---- rules -----------------------------------------------------------------------------
    def window_frontier(self, row: int) -> int:
        req, ps = self.reqs[row], self.ps
        length = req.length
        if req.protected > 0:
            threshold = length - max(self.window, ps)
        else:
            threshold = length - self.window
        new = max(req.frontier, max(threshold, 0) // ps * ps)
        return max(new, req.protected)

    def _check_advance(self, rows, new_pos, current) -> None:
        kinds = set()
        if len(new_pos) != len(rows):
            raise Violation({POSITION})
        for r, p, cur in zip(rows, new_pos, current, strict=True):
            if p % self.ps:
                kinds.add(ALIGNMENT)
            if p < cur:
                kinds.add(FRONTIER)
            if p > self.reqs[r].length // self.ps * self.ps:
                kinds.add(POSITION)
        if kinds:
            raise Violation(kinds)

    def _segments(self, n_pages: int) -> int:
        return ceil_div(n_pages, self.max_pages_per_row) if n_pages > 0 else 0

    def _advance(self, rows, new_pos) -> list:
        """Frontier advance; returns the release segments' page counts (for the step shape)."""
        self._check_advance(rows, new_pos, [self.reqs[r].frontier for r in rows])
        ps, segs = self.ps, []
        for r, new in zip(rows, new_pos, strict=True):
            req = self.reqs[r]
            n = (new - req.frontier) // ps
            for p in range(req.frontier // ps, new // ps):
                if not self.ring_mode:
                    self._push("swa", req.swa[p])
                    req.swa[p] = None
            req.frontier = new
            segs.append(n)
        return segs

    def _release(self, rows) -> list:
        ps, segs = self.ps, []
        for r in rows:  # FULL pages below the frontier
            req = self.reqs[r]
            segs.append(req.frontier // ps - req.protected // ps)
            for p in range(req.protected // ps, req.frontier // ps):
                self._push("full", req.pages[p])
        for r in rows:  # FULL (and SWA) pages at and after the frontier
            req = self.reqs[r]
            segs.append(len(req.pages) - req.frontier // ps)
            for p in range(req.frontier // ps, len(req.pages)):
                self._push("full", req.pages[p])
                if not self.ring_mode:
                    self._push("swa", req.swa[p])
        if self.ring_mode:
            for r in rows:
                segs.append(self.ring_pages)
                for page in self.reqs[r].ring:
                    self._push("swa", page)
        for r in rows:
            del self.reqs[r]
        return segs

    def _extend(self, rows, n_tokens, allocated: set, alloc_rows: list) -> list:
        ps, kinds = self.ps, set()
        n_tokens = list(n_tokens)
        if len(n_tokens) != len(rows):
            raise Violation({POSITION})
        need = 0
        for r, n in zip(rows, n_tokens, strict=True):
            if not _is_int(n) or n < 0:
                kinds.add(POSITION)
                continue
            req = self.reqs[r]
            if r in allocated:
                kinds.add(OVERLAP)
            end = req.length + n
            if end > self.max_ctx:
                kinds.add(POSITION)
            if n > self.max_tokens_per_alloc_row:
                kinds.add(BATCH)
            need += ceil_div(end, ps) - ceil_div(req.length, ps)
            if self.ring_mode and ceil_div(end, ps) - req.frontier // ps > self.ring_pages:
                kinds.add(RING)
        if need > len(self.full_q) or (not self.ring_mode and need > len(self.swa_q)):
            kinds.add(CAPACITY)
        if kinds:
            raise Violation(kinds)
        out = []
        for r, n in zip(rows, n_tokens, strict=True):
            req = self.reqs[r]
            full_slots, swa_slots = [], []
            for t in range(req.length, req.length + n):
                p, off = t // ps, t % ps
                if p == len(req.pages):  # a new page, popped in order from both queues
                    req.pages.append(self._pop_full())
                    req.swa.append(None if self.ring_mode else self._pop_swa())
                swa_page = req.ring[p % self.ring_pages] if self.ring_mode else req.swa[p]
                req.slots.append(req.pages[p] * ps + off)
                full_slots.append(req.pages[p] * ps + off)
                swa_slots.append(swa_page * ps + off)
            allocated.add(r)
            if n > 0:
                alloc_rows.append(n)
            out.append((r, full_slots, swa_slots))
        return out

    def _check_shape(self, rel_segs: list, alloc_tokens: list) -> None:
        n_rows = sum(self._segments(n) for n in rel_segs)
        if (n_rows > self.max_release_rows or sum(rel_segs) > self.max_step_pages
                or len(alloc_tokens) > self.max_alloc_rows
                or sum(alloc_tokens) > self.max_step_tokens):
            raise Violation({BATCH})

    # ---- predictions -----------------------------------------------------------------------
    def mapping(self) -> dict[int, int]:
        """full page -> SWA page for every mapped full page."""
        out = {}
        for req in self.reqs.values():
            for p in range(req.frontier // self.ps, len(req.pages)):
                out[req.pages[p]] = (req.ring[p % self.ring_pages] if self.ring_mode
                                     else req.swa[p])
        return out

    def full_to_swa(self) -> list[int]:
        ps = self.ps
        table = [0] * ((self.n_full + 1) * ps)
        for full, swa in self.mapping().items():
            for o in range(ps):
                table[full * ps + o] = swa * ps + o
        return table

    def owned_full(self) -> dict[int, list[int]]:
        return {r: req.pages[req.protected // self.ps:] for r, req in self.reqs.items()}

    def owned_swa(self) -> dict[int, list[int]]:
        if self.ring_mode:
            return {r: list(req.ring) for r, req in self.reqs.items()}
        return {r: req.swa[req.frontier // self.ps:] for r, req in self.reqs.items()}

    def free_ring_head(self, pool: str) -> int:
        if pool == "full":
            return self.full_pops % self.n_full
        return self.swa_pops % self.n_swa
