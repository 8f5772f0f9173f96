"""A pure-Python model of the allocator's semantics, written from the rules, not the code.

Plain ints, lists, dicts and deques; no numpy, no torch, nothing from graphalloc
except (optionally) the config dataclass it is built from. It predicts, for the
same sequence of operations, the exact page ids the device hands out (both free
lists are FIFO queues holding pages ``1..N`` in order at start: pop from the
front, push to the back), ``req_to_token`` on every position a live request or a
handle holds, ``full_to_swa`` for every slot, the free queues in order, the
reference counts, the counts, and which contract an invalid operation violates.

Rules modelled (``ps`` page size, ``W`` window, ``R`` ring pages, L a length):

* references: every FULL page and every SWA page has a reference count. Holders are
  live requests (FULL pages of ``[0, L)``, SWA pages of ``[frontier, L)``) and handles
  (FULL ``[0, n)``, SWA ``[swa_start, n)``). A page returns to its free queue only in
  the call where its last reference is dropped; dropping any other reference changes
  nothing on the device. The SWA page of a full page is pushed, and the full page's
  mapping cleared, when its last SWA reference goes (even if FULL references remain).
  Ring mode has no sharing: every sharing call is refused (kind ``sharing``).
* admit: lowest row that is neither live nor released in an open free group; a new
  request is empty (length = frontier = 0). Every operation is one step: a plain admit
  too (it has no device work in pool mode, but it is a step). ``admit(handle=h)`` is a
  request sharing the handle's pages: length ``n_h``, frontier the handle's SWA start, its
  ``req_to_token`` the handle's slots, references like any request (one step). Ring
  mode pops the request's R ring pages (one step).
* take_handle(row, n): ``n`` a multiple of ps, ``0 < n <= L``; the lowest free handle
  id (neither live nor dropped in an open free group); holds FULL ``[0, n)`` and SWA
  ``[min(frontier, n), n)``; one step. drop_handle: drops all its references;
  drop_handle_swa: only the SWA ones (its SWA start becomes n). One step each.
* extend / decode: positions ``[L, L + n)``; a position starting a page that does
  not exist yet pops one FULL page and (pool mode) one SWA page. Rows are served
  in call order, decode rows before extend rows. Ring mode: the SWA page of page
  index p is ``ring[p % R]``.
* window eviction: ``new = floor_page(max(old, L - W))``. Advancing the frontier from
  ``old`` to ``new`` drops the request's SWA references of ``[old, new)``; the FULL
  pages stay (ring mode: the mapping of those pages is cleared, nothing is pushed).
* release: drops FULL ``[0, L)`` (a partial tail page whole) and SWA ``[frontier, L)``;
  ring mode pushes the ring pages ``ring[0..R-1]`` of each row after the rest.
* push order of one call (a release, an eviction, an advance, a handle drop; a step's
  release, eviction and advance parts are separate calls, in this order): first every
  page whose action is "FULL only" (FULL count reached 0, no SWA page any more), then
  every page whose action is "FULL and SWA" or "SWA only"; within a phase, rows in
  call order, each row's pages in position order. A page several rows of one call
  drop references to is pushed once, in the segment of the first of those rows, with
  the action the counts give after the whole call. Without sharing this is exactly the
  order of release: FULL of ``[0, frontier)``, then FULL + SWA of ``[frontier, L)``.
* release segments (the frozen step shape): each row's pages of one phase are cut into
  maximal runs of consecutive positions with the same action; each run is split every
  ``max_pages_per_row`` pages into release rows (descriptor order: phase 1 then phase 2,
  rows in call order). take_handle and admit(handle) use no release rows.
* a step runs release, commit, trim, evict, advance, decode, extend in this order: every
  push of a step precedes every pop, so pages freed by a step are reused by it. Its form
  is checked first: a row outside ``[0, max_reqs)`` (or not an int) anywhere in it is an
  ``unknown`` violation before any other rule.
* speculative decoding: a request has a committed length C <= L; the positions
  ``[C, L)`` are its speculative steps, oldest first, at most two. A decode with
  lookahead k appends ``1 + k`` positions as one speculative step (refused when two are
  in flight); a plain decode or extend of a request with speculative steps is refused
  (kind ``spec``), otherwise it commits (C = L). ``commit(r, n)``: n <= the oldest step's
  size (else ``position``; no step: ``spec``); C becomes C + n, the step is gone, the
  request is cut to C + the later steps' sizes. ``trim(r, n)``: n <= L (``position``) and,
  once the frontier f > 0, n >= f + W (``frontier``); the request is cut to n, C becomes
  min(C, n), the steps are cut at n (oldest first). A cut to n drops the request's
  references to the pages of ``[ceil(n / ps), ceil(L / ps))``, FULL and SWA (a partial page
  stays), as one call. The window rule and every frontier move use C, not L: the window
  rule is ``floor_page(max(old, C - W))`` and a frontier may not pass ``floor_page(C)``; a
  handle takes at most C tokens. commit and trim inside a free group, or through a step
  inside one, are refused (``nested``).
* free_group: releases, handle drops (whole or SWA only), evictions and frontier advances
  are validated at the call, by the same rules as outside a block, against the committed
  state plus what the block recorded: a row released in the block cannot be freed again,
  allocate, or be reused by admit; a handle dropped in it is gone (a second drop, an
  admit on it, its info are refused) and its id is not reused; an eviction records the
  window rule's target on the committed length at the call (the largest recorded target
  wins); an advance must not be behind the live frontier nor behind the block's target.
  Nothing changes until the exit: every view (lengths, frontiers, free counts, handle
  info) is the committed state, and operations that run at once inside the block
  (allocations, admits, take_handle) see it. A release supersedes the row's recorded
  target; a whole drop supersedes a tombstone. The exit runs what was recorded as ONE
  step in the step's order: the releases (one drop call, rows in call order), the
  frontier moves (one drop call, rows in the order their first target was recorded), the
  handle drops (one drop call: whole drops in call order, then tombstones), split into
  the fewest consecutive steps whose release rows fit the frozen shape (greedy, in order);
  never refused. An exception escaping the block discards it (nothing recorded runs).
* shared pages are never written: a trim to n (n not a multiple of ps) whose page
  n // ps another holder references is refused (kind ``shared``), because the next
  allocation would continue that page.
* the frozen step shape: release segments, freed pages, allocating rows and tokens per
  step are bounded. A combined ``step()`` beyond it is refused whole; a free called on its
  own outside a block (release, evict_window, advance_frontier, drop_handle,
  drop_handle_swa) is one step when it fits and is otherwise split into consecutive steps
  like a block's flush, never refused (issue 17, defect 3: nothing may be stranded).
* recurrent-state slots (``num_state_slots`` S > 0; issue 25): slots ``1..S`` (0 the sink)
  form a FIFO queue, initially ``[1..S]`` (pop the front, push the back). Every slot is
  free or held once: by a live request (its state after its committed tokens), a handle
  (its snapshot, the state after its n tokens) or a speculative token in flight. Effects
  happen in the step's order, interleaved with the page effects; within a kind, rows or
  handles in call order. admit: pop s, slot(r) = s (the network initialises it).
  admit on handle h: n must be the handle's n (``state_admit``); pop s, copy (snapshot(h)
  -> s; a handle taken in the same step would copy from its take's source, but the page
  rules refuse using such a handle). take_handle of r at n: n must be r's committed length
  when the step began (``state_take``); pop t, snapshot = t, copy (slot(r) -> t). release:
  push slot(r), then its speculative slots (oldest step first, token order). commit(r, n)
  of the oldest step's slots s[0..k]: n >= 1 pushes the old slot(r), then s without
  s[n-1] in order, and slot(r) = s[n-1]; n == 0 pushes all of s. trim below the committed
  length is refused (``state_trim``); otherwise each step's cut tokens give their slots
  back (oldest step first, token order). drop_handle pushes the snapshot (a tombstone
  keeps it). A decode with lookahead k pops 1 + k slots (``1 + k > max_spec_tokens``:
  ``state_spec``); a plain decode or extend pops nothing (the network updates slot(r) in
  place). Pops of one kind are refused together when the queue, as it is at that point of
  the step, is short (``state_short``). A copy whose destination is the source of a copy
  of the same step is refused (``state_read``): every copy reads the states as the step
  began (checked last, once the step passed every other rule, its frozen shape
  included). The step's copies: takes' first, then admits on handles, in call order.
  ``state_writes`` lists the slots the network writes after each step (an admit's new
  slot, a plain allocation's slot, each speculative token's slot), ``step_copies`` the
  last step's copies, ``state_content`` what each slot holds (the copies applied).

* further window pools (a model with several window layer kinds: two sliding windows, a
  window and chunked local attention): the first window pool is the SWA pool above; each
  further pool p has its own FIFO queue ``[1..N_p]``, reference counts, mapping of FULL
  pages to its pages and a frontier per request / start per handle, with its own rule
  (``needed_p``). Its references: a request holds pool p's pages of ``[f_p, L)``, a handle
  of ``[start_p, n)``. Every new FULL page pops one page of every further pool, in the same
  order (rows in call order), refused (``capacity``) when a pool is short. Drops of one
  call, per pool: a page whose count reaches 0 is pushed once, at the first row of the call
  that held it, rows in call order, pages in position order; its mapping is cleared.
  Calls: a release drops ``[f_p, L)``; a cut (commit, trim) ``[ceil(n / ps), L)``; the
  step's evict (``evict``, ``evict_all``, a single ``evict_window`` outside a free group)
  moves f_p to ``max(f_p, floor_page(needed_p(C)))`` dropping ``[f_p, f_p')``; a handle
  drop or tombstone drops ``[start_p, n)`` (a tombstone: start_p = n). take_handle:
  ``start_p = min(f_p, n)``; admit on a handle: ``f_p = min(start_p, n)``. An explicit
  advance, a load-back and the frontier targets a free group records move the first pool
  only. A trim is refused (``frontier``) when a pool's ``f_p > 0`` and
  ``n < min_length_p(f_p)``. Each pool's drops are release segments of its own section
  (runs of consecutive positions of one row), bounded like the main one (``batch``); a free
  group's flush takes as many steps as its most demanding section needs.

Violations are reported as :class:`Violation` with a set of kinds (names of
the rules broken by the first failing sub-operation); the model is unchanged.
"""

from __future__ import annotations

import copy
from collections import deque

# Violation kinds (the test maps them onto graphalloc.errors classes).
UNKNOWN = "unknown"  # row out of range, not an int, not live, released in this group
OVERLAP = "overlap"  # a row listed twice in one call / allocating twice in one step
CAPACITY = "capacity"  # not enough free pages, rows or handle slots
ALIGNMENT = "alignment"  # frontier / handle length not page-aligned
POSITION = "position"  # beyond max_context_len, frontier past the last whole page, bad lengths
FRONTIER = "frontier"  # frontier moved backwards
BATCH = "batch"  # frozen step shape exceeded
RING = "ring"  # ring mode: more live pages than ring pages
NESTED = "nested"  # nested free_group / release or evict through step() inside a group
HANDLE = "handle"  # unknown or dropped handle (UnknownHandleError)
SHARING = "sharing"  # a sharing call in ring mode (a ContractError)
SPEC = "spec"  # speculative state: nothing to commit, a tail blocks a plain allocation,
# a third step in flight (a ContractError)
SHARED = "shared"  # a trim into a page another holder references (SharedPageError)
NO_WINDOW = "no_window"  # a frontier move (advance, load-back) in a model with no window layers
MAPPED = "mapped"  # a load-back of a page with an SWA page, or one an earlier row loads back
# Recurrent-state slots (the test maps them onto refusal codes 40-45).
STATE_ADMIT = "state_admit"  # admit on a handle at n != the handle's n (40)
STATE_TAKE = "state_take"  # a handle at n != the committed length as the step began (41)
STATE_TRIM = "state_trim"  # a trim below the committed length (42)
STATE_SHORT = "state_short"  # not enough free state slots for a kind's pops (43)
STATE_SPEC = "state_spec"  # a speculative step of more than max_spec_tokens tokens (44)
STATE_READ = "state_read"  # a copy's destination is another copy's source (45)

# Actions of a page whose references a call drops.
ACT_FULL = "full"  # FULL count reached 0, no SWA page any more
ACT_BOTH = "both"  # FULL count reached 0 and the SWA page's too (ring: mapping cleared)
ACT_SWA = "swa"  # the SWA page's count reached 0, FULL references remain


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


def needed(rule, length: int) -> int:
    """The first position a window rule's layers read at committed length ``length``."""
    kind, size = rule
    return max(length - size, 0) if kind == "window" else length // size * size


def min_length(rule, frontier: int) -> int:
    """The shortest length whose window needs nothing below ``frontier`` (> 0)."""
    kind, size = rule
    return frontier + size if kind == "window" else ceil_div(frontier, size) * size


class XPool:
    """A further window pool: its rule, queue, counts and mapping (FULL page -> its page)."""

    def __init__(self, rule, n_pages: int, n_full: int):
        self.rule, self.n = rule, n_pages
        self.q: deque[int] = deque(range(1, n_pages + 1))
        self.pops = 0
        self.ref = [0] * (n_pages + 1)
        self.f2s = [0] * (n_full + 1)

    def pop(self) -> int:
        self.pops += 1
        return self.q.popleft()


class Req:
    """One live request: its FULL page per page index, its full slot per position."""

    def __init__(self, ps: int, pages=(), frontier: int = 0, xf=()):
        self.pages = list(pages)
        self.slots = [p * ps + o for p in self.pages for o in range(ps)]
        self.frontier = frontier
        self.xf = list(xf)  # its frontier in each further window pool
        self.ring: list[int] = []
        self.committed = len(self.slots)  # C: the rest, [C, L), is speculative
        self.spec: list[int] = []  # sizes of the speculative steps in flight, oldest first
        self.state = 0  # its recurrent-state slot (0: no state slots)
        self.spec_slots: list[list[int]] = []  # per speculative step, a slot per token

    @property
    def length(self) -> int:
        return len(self.slots)


class Handle:
    """One handle: the FULL pages of ``[0, n)``; SWA references of ``[swa_start, n)``."""

    def __init__(self, ps: int, pages, swa_start: int, xf=()):
        self.ps = ps
        self.pages = list(pages)
        self.frontier = swa_start  # named like a request's: the start of its SWA references
        self.xf = list(xf)  # its start in each further window pool
        self.state = 0  # its snapshot's state slot (0: no state slots)

    @property
    def n_tokens(self) -> int:
        return len(self.pages) * self.ps

    @property
    def swa_start(self) -> int:
        return self.frontier

    @property
    def slots(self) -> list[int]:
        return [p * self.ps + o for p in self.pages for o in range(self.ps)]


class Model:
    def __init__(self, page_size, num_full_pages, num_swa_pages, max_reqs, max_context_len,
                 sliding_window, swa_ring_pages=0, max_release_rows=0, max_pages_per_row=0,
                 max_alloc_rows=0, max_tokens_per_alloc_row=0, max_step_pages=0,
                 max_step_tokens=0, max_handles=0, num_state_slots=0, max_spec_tokens=0,
                 rule=None, extras=()):
        self.ps = page_size
        # The window layers' rule: ("window", W) keeps [C - W, C) of committed length C,
        # ("chunk", K) keeps [floor(C / K) * K, C) (chunked local attention), None: a model
        # without window layers (no window pages at all; frontiers stay 0).
        self.rule = rule if rule is not None or not num_swa_pages else ("window", sliding_window)
        self.n_full = num_full_pages
        self.n_swa = num_swa_pages
        self.max_reqs = max_reqs
        self.max_ctx = max_context_len
        self.window = sliding_window
        self.ring_pages = swa_ring_pages
        self.max_handles = max_handles
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
        self.full_ref = [0] * (num_full_pages + 1)  # per FULL page
        self.swa_ref = [0] * (num_swa_pages + 1)  # per SWA page
        self.f2s = [0] * (num_full_pages + 1)  # full page -> its SWA page (0: none)
        self.reqs: dict[int, Req] = {}
        self.handles: dict[int, Handle] = {}
        self.steps = 0
        # free_group state: what the open block recorded (None: no block is open)
        self.group: dict | None = None
        self.pending: set[int] = set()  # rows released in the open block
        self.pending_handles: set[int] = set()  # handles dropped in the open block
        # recurrent-state slots
        self.n_state = num_state_slots
        self.max_spec = max_spec_tokens or 8
        self.state_q: deque[int] = deque(range(1, num_state_slots + 1))
        self.state_content: list = [0] * (num_state_slots + 1)  # what each slot holds
        self.step_copies: list[tuple[int, int]] = []  # the last step's (source, destination)
        self.state_writes: list[int] = []  # slots the network writes after the steps so far
        self.taken_src: dict[int, int] = {}  # handle taken in this step -> its source slot
        # further window pools: (rule, pages) each
        self.x = [XPool(rule_p, n_p, num_full_pages) for rule_p, n_p in extras]
        self.xsegs: list[list[int]] = [[] for _ in self.x]  # this step's release segments

    @classmethod
    def from_config(cls, cfg) -> Model:
        windows = []  # the model's window layers, in order: (rule, pages)
        for layer in getattr(cfg, "layers", None) or ():
            if type(layer).__name__ == "ChunkedLocal":
                windows.append((("chunk", layer.chunk), layer.num_pages))
            elif type(layer).__name__ == "SlidingWindow":
                windows.append((("window", max(layer.window - 1, 1)), layer.num_pages))
        rule = windows[0][0] if windows else None
        return cls(cfg.page_size, cfg.num_full_pages, cfg.num_swa_pages, cfg.max_reqs,
                   cfg.max_context_len, cfg.sliding_window, cfg.swa_ring_pages,
                   cfg.max_release_rows, cfg.max_pages_per_row, cfg.max_alloc_rows,
                   cfg.max_tokens_per_alloc_row, cfg.max_step_pages, cfg.max_step_tokens,
                   getattr(cfg, "max_handles", 0), getattr(cfg, "num_state_slots", 0),
                   getattr(cfg, "max_spec_tokens", 0), rule, windows[1:])

    def clone(self) -> Model:
        return copy.deepcopy(self)

    @property
    def ring_mode(self) -> bool:
        return self.ring_pages > 0

    @property
    def has_window(self) -> bool:
        return self.rule is not None

    def needed_from(self, length: int) -> int:
        """The first position the window layers still read at committed length ``length``."""
        return needed(self.rule, length)

    def min_length(self, frontier: int) -> int:
        """The shortest length whose window needs nothing below ``frontier`` (> 0)."""
        return min_length(self.rule, frontier)

    def _window_start(self, frontier: int, n: int) -> int:
        """Where a holder of ``n`` tokens that shares a holder's window from ``frontier``
        starts holding window pages: ``min(frontier, n)``; nothing (n) without a window."""
        return min(frontier, n) if self.has_window else n

    # ---- queues --------------------------------------------------------------------------
    def _pop_full(self) -> int:
        self.full_pops += 1
        return self.full_q.popleft()

    def _pop_swa(self) -> int:
        self.swa_pops += 1
        return self.swa_q.popleft()

    def _push(self, pool: str, page: int) -> None:
        (self.full_q if pool == "full" else self.swa_q).append(page)

    # ---- recurrent-state slots -------------------------------------------------------------
    @property
    def has_states(self) -> bool:
        return self.n_state > 0

    def _state_short(self, n_pops: int) -> bool:
        """Whether ``n_pops`` pops of one kind find the queue (as it is now) short."""
        return self.has_states and n_pops > len(self.state_q)

    def _state_pop(self) -> int:
        return self.state_q.popleft()

    def _begin_step(self) -> None:
        self.step_copies, self.taken_src = [], {}
        self.xsegs = [[] for _ in self.x]

    def _check_reads(self) -> None:
        """Every copy reads the states as the step began: a destination that is the source
        of a copy of the same step is refused."""
        sources = {src for src, _ in self.step_copies}
        if any(dst in sources for _, dst in self.step_copies):
            raise Violation({STATE_READ})

    def _end_step(self) -> None:
        """Apply the step's copies, all reading the contents as the step began."""
        before = self.state_content
        self.state_content = list(before)
        for src, dst in self.step_copies:
            self.state_content[dst] = before[src]

    def write_state(self, slot: int, value) -> None:
        """The network wrote ``value`` into ``slot`` (between steps)."""
        self.state_content[slot] = value

    def req_to_state(self) -> list[int]:
        """Each row's slot (0: not live), as ``req_to_state`` shows it."""
        return [self.reqs[r].state if r in self.reqs else 0 for r in range(self.max_reqs)]

    def handle_to_state(self) -> list[int]:
        """Each handle's snapshot slot (0: not held), as ``handle_to_state`` shows it."""
        return [self.handles[h].state if h in self.handles else 0
                for h in range(self.max_handles)]

    # ---- references ----------------------------------------------------------------------
    def _hold(self, holder) -> None:
        """Take ``holder``'s references: FULL of all its pages, SWA from its frontier."""
        for page in holder.pages:
            self.full_ref[page] += 1
        if not self.has_window:
            return
        for page in holder.pages[holder.frontier // self.ps:]:
            swa = self.f2s[page]
            assert swa > 0, f"model: SWA reference to full page {page} with no SWA page"
            self.swa_ref[swa] += 1
        for x, start in zip(self.x, holder.xf, strict=True):
            for page in holder.pages[start // self.ps:]:
                assert x.f2s[page] > 0, "model: a further pool's reference with no page"
                x.ref[x.f2s[page]] += 1

    def _xdrop(self, i: int, items) -> list[int]:
        """One call's drops in further pool ``i``: per row of the call, in order, ``(pages,
        lo, hi)``. A page reaching 0 is pushed once (its first row), rows in call order,
        pages in index order; its mapping cleared. Returns (and records for the step's
        shape) the runs of consecutive positions of one row."""
        x = self.x[i]
        first: dict[int, tuple[int, int]] = {}
        for j, (pages, lo, hi) in enumerate(items):
            for k in range(lo, hi):
                first.setdefault(pages[k], (j, k))
                assert x.ref[x.f2s[pages[k]]] > 0, "model: a further pool's count below 0"
                x.ref[x.f2s[pages[k]]] -= 1
        freed = sorted((jk, page) for page, jk in first.items() if x.ref[x.f2s[page]] == 0)
        segs: list[int] = []
        prev = None
        for (j, k), page in freed:
            if prev is not None and prev == (j, k - 1):
                segs[-1] += 1
            else:
                segs.append(1)
            prev = (j, k)
            x.q.append(x.f2s[page])
            x.f2s[page] = 0
        self.xsegs[i] += segs
        return segs

    def _xevict(self, rows) -> None:
        """The step's evict in every further pool: its own rule on C."""
        ps = self.ps
        for i, x in enumerate(self.x):
            items, moves = [], []
            for r in rows:
                req = self.reqs[r]
                new = max(req.xf[i], needed(x.rule, req.committed) // ps * ps)
                if new > req.xf[i]:
                    items.append((req.pages, req.xf[i] // ps, new // ps))
                    moves.append((req, new))
            self._xdrop(i, items)
            for req, new in moves:
                req.xf[i] = new

    def _drop(self, items) -> list[int]:
        """Drop the references of one call's rows. ``items``: per row of the call, in call
        order, ``(pages, full_lo, full_hi, swa_lo, swa_hi)`` (page indices, half-open). Pages
        reaching 0 are pushed in the two-phase order; returns the release segments' page
        counts (runs, before the ``max_pages_per_row`` split) in descriptor order."""
        first: dict[int, tuple[int, int]] = {}  # full page -> (row of the call, page index)
        for i, (pages, flo, fhi, slo, shi) in enumerate(items):
            for k in sorted(set(range(flo, fhi)) | set(range(slo, shi))):
                first.setdefault(pages[k], (i, k))
            for k in range(flo, fhi):
                assert self.full_ref[pages[k]] > 0, "model: FULL count below 0"
                self.full_ref[pages[k]] -= 1
            for k in range(slo, shi):
                swa = self.f2s[pages[k]]
                assert swa > 0 and self.swa_ref[swa] > 0, "model: SWA count below 0"
                self.swa_ref[swa] -= 1
        action: dict[int, str] = {}
        for page in first:
            swa = self.f2s[page]
            full0 = self.full_ref[page] == 0
            if self.ring_mode:
                if full0:
                    action[page] = ACT_BOTH if swa else ACT_FULL
            elif full0:
                assert swa == 0 or self.swa_ref[swa] == 0, "model: SWA held, FULL free"
                action[page] = ACT_BOTH if swa else ACT_FULL
            elif swa and self.swa_ref[swa] == 0:
                action[page] = ACT_SWA
        segs: list[int] = []
        for phase in ((ACT_FULL,), (ACT_BOTH, ACT_SWA)):
            for i, (pages, *_rest) in enumerate(items):
                ks = sorted(k for page, (j, k) in first.items()
                            if j == i and action.get(page) in phase)
                prev = None
                for k in ks:
                    page = pages[k]
                    act = action[page]
                    if prev is not None and prev == (k - 1, act):
                        segs[-1] += 1
                    else:
                        segs.append(1)
                    prev = (k, act)
                    if act != ACT_SWA:
                        self._push("full", page)
                    if act != ACT_FULL:
                        if not self.ring_mode:
                            self._push("swa", self.f2s[page])
                        self.f2s[page] = 0
        return segs

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

    def _handle(self, h) -> int:
        """A live handle id (not dropped, also not in the open group), or a violation."""
        if self.ring_mode:
            raise Violation({SHARING})
        if not _is_int(h) or int(h) not in self.handles or int(h) in self.pending_handles:
            raise Violation({HANDLE})
        return int(h)

    def _free_rows(self) -> list[int]:
        return [r for r in range(self.max_reqs) if r not in self.reqs and r not in self.pending]

    # ---- public ops (each one is atomic: on a Violation nothing changed) ------------------
    def admit(self, handle=None, n_tokens=None) -> int:
        if handle is not None:
            return self.admit_handle(handle, n_tokens)
        kinds = set()
        free_rows = self._free_rows()
        if not free_rows:
            kinds.add(CAPACITY)
        if self.ring_mode and len(self.swa_q) < self.ring_pages:
            kinds.add(CAPACITY)
        if self._state_short(1):
            kinds.add(STATE_SHORT)
        if kinds:
            raise Violation(kinds)
        row = free_rows[0]
        req = Req(self.ps, xf=[0] * len(self.x))
        if self.ring_mode:
            req.ring = [self._pop_swa() for _ in range(self.ring_pages)]
        self._begin_step()
        if self.has_states:
            req.state = self._state_pop()
            self.state_writes.append(req.state)  # the network initialises it
        self.steps += 1
        self.reqs[row] = req
        return row

    def admit_handle(self, handle, n_tokens=None) -> int:
        """A new request on a handle's first ``n_tokens`` (None: all; one step)."""
        if self.ring_mode:
            raise Violation({SHARING})
        kinds = set()
        if not _is_int(handle) or int(handle) not in self.handles or (
                int(handle) in self.pending_handles):
            kinds.add(HANDLE)
        free_rows = self._free_rows()
        if not free_rows:
            kinds.add(CAPACITY)
        if kinds:
            raise Violation(kinds)
        h = self.handles[int(handle)]
        kinds = self._share_kinds(h, n_tokens)
        if self._state_short(1):
            kinds.add(STATE_SHORT)
        if kinds:
            raise Violation(kinds)
        n = h.n_tokens if n_tokens is None or n_tokens == -1 else int(n_tokens)
        row = free_rows[0]
        req = Req(self.ps, h.pages[:n // self.ps], min(h.swa_start, n) if self.has_window else 0,
                  [min(start, n) for start in h.xf])
        self._hold(req)
        self.reqs[row] = req
        self._begin_step()
        self._restore(req, int(handle))
        self._end_step()
        self.steps += 1
        return row

    def _share_kinds(self, hd: Handle, n) -> set:
        """What sharing ``n`` tokens (None / -1: all) of handle ``hd`` breaks."""
        n = hd.n_tokens if n is None or n == -1 else int(n)
        kinds = {ALIGNMENT} if n % self.ps else set()
        if not kinds and not 0 < n <= hd.n_tokens:
            kinds.add(POSITION)
        if self.has_states and n != hd.n_tokens:
            kinds.add(STATE_ADMIT)  # a snapshot exists at the handle's end only
        return kinds

    def _restore(self, req: Req, h: int) -> None:
        """A request admitted on handle ``h`` gets a fresh slot holding a copy of the
        snapshot (as the step began: a handle taken in this step copies its take's source)."""
        if self.has_states:
            req.state = self._state_pop()
            self.step_copies.append((self.taken_src.get(h, self.handles[h].state), req.state))

    def take_handle(self, row, n_tokens) -> int:
        """A handle on the first ``n_tokens`` of ``row`` (one step); returns its id."""
        if self.ring_mode:
            raise Violation({SHARING})
        kinds = set()
        r = None
        try:
            r = self._rows([row])[0]
        except Violation as v:
            kinds |= v.kinds
        if not _is_int(n_tokens):
            kinds.add(POSITION)
        else:
            n = int(n_tokens)
            if n % self.ps:
                kinds.add(ALIGNMENT)
            if n <= 0 or (r is not None and n > self.reqs[r].committed):
                kinds.add(POSITION)
            if self.has_states and r is not None and n != self.reqs[r].committed:
                kinds.add(STATE_TAKE)  # a state exists at the committed length only
        free = [h for h in range(self.max_handles)
                if h not in self.handles and h not in self.pending_handles]
        if not free:
            kinds.add(CAPACITY)
        if self._state_short(1):
            kinds.add(STATE_SHORT)
        if kinds:
            raise Violation(kinds)
        req, n = self.reqs[r], int(n_tokens)
        handle = Handle(self.ps, req.pages[:n // self.ps], self._window_start(req.frontier, n),
                        [min(f, n) for f in req.xf])
        self._hold(handle)
        self.handles[free[0]] = handle
        self._begin_step()
        self._snapshot(free[0], req)
        self._end_step()
        self.steps += 1
        return free[0]

    def _snapshot(self, h: int, req: Req) -> None:
        """Handle ``h`` gets a fresh slot holding a copy of ``req``'s state."""
        if self.has_states:
            self.handles[h].state = self._state_pop()
            self.taken_src[h] = req.state
            self.step_copies.append((req.state, self.handles[h].state))

    def drop_handle(self, handle) -> None:
        self._drop_handle_op(handle, swa_only=False)

    def drop_handle_swa(self, handle) -> None:
        self._drop_handle_op(handle, swa_only=True)

    def _drop_handle_op(self, handle, swa_only: bool) -> None:
        h = self._handle(handle)
        if h in self.pending_handles:
            raise Violation({HANDLE})

        def record(g):
            if swa_only:
                if h not in g["tomb"]:
                    g["tomb"].append(h)
            else:
                g["drop"].append(h)
        self._free_op(record)
        if self.group is not None and not swa_only:
            self.pending_handles.add(h)

    def _drop_handles(self, drops) -> list[int]:
        """One drop call: ``drops`` = [(handle, swa_only)] in order."""
        ps, items = self.ps, []
        for h, swa_only in drops:
            hd = self.handles[h]
            n = len(hd.pages)
            items.append((hd.pages, 0, 0 if swa_only else n, hd.swa_start // ps, n))
        segs = self._drop(items)
        for i in range(len(self.x)):  # every window pool's references (a tombstone too)
            self._xdrop(i, [(self.handles[h].pages, self.handles[h].xf[i] // ps,
                             len(self.handles[h].pages)) for h, _ in drops])
        for h, swa_only in drops:
            if swa_only:  # a tombstone keeps its snapshot
                self.handles[h].frontier = self.handles[h].n_tokens
                self.handles[h].xf = [self.handles[h].n_tokens] * len(self.x)
            else:
                if self.has_states:
                    self.state_q.append(self.handles[h].state)
                del self.handles[h]
        return segs

    def handle_info(self, handle) -> dict:
        """What a handle holds and what dropping it would free now (committed state)."""
        if _is_int(handle) and int(handle) in self.pending_handles:
            raise Violation({HANDLE})
        h = self.handles[self._handle(handle)]
        ps = self.ps
        swa_pages = [self.f2s[p] for p in h.pages[h.swa_start // ps:]]
        return {
            "n_tokens": h.n_tokens,
            "swa_start": h.swa_start,
            "n_full_pages": len(h.pages),
            "n_swa_pages": len(swa_pages),
            "frees_full": sum(1 for p in h.pages if self.full_ref[p] == 1),
            "frees_swa": sum(1 for s in swa_pages if self.swa_ref[s] == 1),
        }

    def live_handles(self) -> list[int]:
        return sorted(self.handles)

    def step(self, release=(), evict=None, evict_all=False, advance=None, decode=(),
             extend=None, commit=None, trim=None, lookahead=None, take=None, drop=(),
             drop_swa=(), admit=(), admit_on=None, load_back=None):
        """One step of any kinds, in the step's order: ``take`` ((handles, rows, n): a
        handle on a row's first n tokens, as the step begins), ``release``, ``commit``
        ((rows, n_accepted)), ``trim`` ((rows, new_lens)), ``evict`` (rows) or
        ``evict_all``, ``advance`` ((rows, new frontiers)), ``drop`` / ``drop_swa``
        (handles: one drop call, whole drops then tombstones), ``admit`` (free rows become
        empty requests; ring mode pops their ring pages), ``admit_on`` ((rows, handles, n or
        None): requests on a handle's first n tokens), ``decode`` (with ``lookahead``: None,
        an int or one per decode row; -1 marks a plain row), ``extend`` ((rows, n_tokens)),
        ``load_back`` ((rows, new frontiers): pool mode; each row's ``[new, f)`` gets fresh
        SWA pages, popped in row order, then position order; the pages must have no SWA page
        and no earlier row of the step may load them back).
        Returns the allocation results ``[(row, full_slots, swa_slots)]`` (decode rows
        first) or None when nothing allocates. Inside a free group a step with frees is
        refused (``nested``) first; then a malformed step -- a row that is not an int in
        ``[0, max_reqs)`` in any kind -- is refused before any other rule."""
        release = [] if release is None else release
        decode = [] if decode is None else decode
        if self.group is not None and (commit is not None or trim is not None):
            raise Violation({NESTED})
        if self.group is not None and (list(release) or evict_all or (evict is not None and
                                                                      list(evict))
                                       or advance is not None or list(drop) or list(drop_swa)):
            raise Violation({NESTED})
        for rows in (release, evict or (), decode, admit,
                     *(x[1 if x is take else 0] for x in (commit, trim, advance, extend, take,
                                                          admit_on, load_back)
                       if x is not None)):
            if any(not _is_int(r) or not 0 <= int(r) < self.max_reqs for r in rows):
                raise Violation({UNKNOWN})
        work = self.clone()
        work._begin_step()
        rel_rows: list = []
        results = None
        extra_rows = 0  # allocation rows without tokens: prefix copies, ring admissions
        taken = set()
        if take is not None:
            extra_rows += work._take(*take)
            taken = {int(h) for h in take[0]}
        rel_rows += work._release(work._rows(release))
        if commit is not None:
            rel_rows += work._commit(work._rows(commit[0]), list(commit[1]))
        if trim is not None:
            rel_rows += work._trim(work._rows(trim[0]), list(trim[1]))
        if evict_all or evict is not None:
            rows = work._rows(evict) if evict is not None else []  # checked either way
            if evict_all:
                rows = sorted(r for r in work.reqs if r not in work.pending)
            rel_rows += work._advance(rows, [work.window_frontier(r) for r in rows])
            work._xevict(rows)
        if advance is not None:
            rel_rows += work._advance(work._rows(advance[0]), [int(p) for p in advance[1]])
        if list(drop) or list(drop_swa):
            hs = [work._handle(h) for h in drop] + [work._handle(h) for h in drop_swa]
            if len(set(hs)) != len(hs) or taken & set(hs):
                raise Violation({OVERLAP})  # twice, or written (taken) in this step
            rel_rows += work._drop_handles([(h, False) for h in drop]
                                           + [(int(h), True) for h in drop_swa])
        allocated: set[int] = set()
        alloc_rows: list = []
        extra_rows += work._admit_rows(list(admit), allocated, released=set(release))
        if admit_on is not None:
            if taken & {int(h) for h in admit_on[1] if _is_int(h)}:
                raise Violation({OVERLAP})  # a handle is used from the step after its take
            extra_rows += work._admit_on(*admit_on, released=set(release))
        if list(decode):
            rows = work._rows(decode)
            if lookahead is None:
                n, spec = [1] * len(rows), [False] * len(rows)
            else:
                ks = [lookahead] * len(rows) if _is_int(lookahead) else list(lookahead)
                if len(ks) != len(rows) or not all(_is_int(k) and k >= -1 for k in ks):
                    raise Violation({POSITION})
                n, spec = [1 + max(int(k), 0) for k in ks], [int(k) >= 0 for k in ks]
            results = (results or []) + work._extend(rows, n, allocated, alloc_rows,
                                                     speculative=spec)
        elif lookahead is not None:
            raise Violation({SPEC})
        if extend is not None:
            rows = work._rows(extend[0])
            results = (results or []) + work._extend(rows, list(extend[1]), allocated,
                                                     alloc_rows)
        if load_back is not None and list(load_back[0]):
            if work.ring_mode:
                raise Violation({SHARING})  # pool mode only (a ContractError)
            if not work.has_window:
                raise Violation({NO_WINDOW})
            work._load_back(work._rows(load_back[0]), list(load_back[1]), allocated,
                            alloc_rows)
        work._check_shape(rel_rows, alloc_rows + [0] * extra_rows)
        work._check_reads()
        work._end_step()
        work.steps += 1
        self.__dict__.update(work.__dict__)
        return results

    def _take(self, handles, rows, n_tokens) -> int:
        """Handles taken as the step begins; returns the prefix-copy rows they add."""
        if self.ring_mode:
            raise Violation({SHARING})
        kinds, copies = set(), 0
        handles = [int(h) for h in handles]
        rows = self._rows(list(dict.fromkeys(rows))) and [int(r) for r in rows]
        if len(set(handles)) != len(handles) or any(h in self.handles for h in handles):
            kinds.add(OVERLAP)
        if any(not 0 <= h < self.max_handles or h in self.pending_handles for h in handles):
            kinds.add(HANDLE)
        for r, n in zip(rows, n_tokens, strict=True):
            if n % self.ps:
                kinds.add(ALIGNMENT)
            elif n <= 0 or n > self.reqs[r].committed:
                kinds.add(POSITION)
            if self.has_states and n != self.reqs[r].committed:
                kinds.add(STATE_TAKE)  # a state exists at the committed length only
        if self._state_short(len(handles)):
            kinds.add(STATE_SHORT)
        if kinds:
            raise Violation(kinds)
        for h, r, n in zip(handles, rows, n_tokens, strict=True):
            req = self.reqs[r]
            handle = Handle(self.ps, req.pages[:n // self.ps],
                            self._window_start(req.frontier, n), [min(f, n) for f in req.xf])
            self._hold(handle)
            self.handles[h] = handle
            self._snapshot(h, req)
            copies += 1
        return copies

    def _admit_rows(self, rows, allocated: set, released: set) -> int:
        """Free rows become empty requests; returns the ring admissions (allocation
        rows)."""
        if len(set(rows)) != len(rows):
            raise Violation({OVERLAP})
        if any(r in self.reqs or r in released or r in self.pending for r in rows):
            raise Violation({UNKNOWN})
        kinds = set()
        if self.ring_mode and len(self.swa_q) < self.ring_pages * len(rows):
            kinds.add(CAPACITY)
        if self._state_short(len(rows)):
            kinds.add(STATE_SHORT)
        if kinds:
            raise Violation(kinds)
        for r in rows:
            req = Req(self.ps, xf=[0] * len(self.x))
            if self.ring_mode:
                req.ring = [self._pop_swa() for _ in range(self.ring_pages)]
                allocated.add(r)  # its ring admission is its allocation row of the step
            if self.has_states:
                req.state = self._state_pop()
                self.state_writes.append(req.state)  # the network initialises it
            self.reqs[r] = req
        return len(rows) if self.ring_mode else 0

    def _admit_on(self, rows, handles, n_tokens, released: set) -> int:
        """Free rows become requests on handles' first n tokens; returns the prefix copies."""
        if self.ring_mode:
            raise Violation({SHARING})
        rows = [int(r) for r in rows]
        if len(set(rows)) != len(rows):
            raise Violation({OVERLAP})
        if any(r in self.reqs or r in released or r in self.pending for r in rows):
            raise Violation({UNKNOWN})
        hs = [self._handle(h) for h in handles]
        n_tokens = [None] * len(rows) if n_tokens is None else list(n_tokens)
        for h, n in zip(hs, n_tokens, strict=True):
            kinds = self._share_kinds(self.handles[h], n)
            if kinds:
                raise Violation(kinds)
        if self._state_short(len(rows)):
            raise Violation({STATE_SHORT})
        for r, h, n in zip(rows, hs, n_tokens, strict=True):
            hd = self.handles[h]
            n = hd.n_tokens if n is None or n == -1 else int(n)
            req = Req(self.ps, hd.pages[:n // self.ps],
                      min(hd.swa_start, n) if self.has_window else 0,
                      [min(start, n) for start in hd.xf])
            self._hold(req)
            self.reqs[r] = req
            self._restore(req, h)
        return sum(1 for r in rows if self.reqs[r].pages)

    def _free_op(self, record) -> None:
        """A free: inside an open block, ``record(group)`` (after the caller validated it);
        outside one, a block of its own (one step, or several when the frozen shape needs
        them; never refused for size)."""
        if self.group is not None:
            record(self.group)
            return
        work = self.clone()
        work.open_group()
        record(work.group)
        work.close_group(at_least_one_step=True)
        self.__dict__.update(work.__dict__)

    def advance_frontier(self, rows, new_pos) -> None:
        rows_v = self._rows(rows)
        new_pos = [int(p) for p in new_pos]
        self._check_advance(rows_v, new_pos, [self.reqs[r].frontier for r in rows_v])
        self._check_window(rows_v, new_pos)
        if self.group is not None:
            target = self.group["target"]
            if any(p < target.get(r, p) for r, p in zip(rows_v, new_pos, strict=True)):
                raise Violation({FRONTIER})  # behind the block's own target

        def record(g):
            for r, p in zip(rows_v, new_pos, strict=True):
                g["target"][r] = p
        self._free_op(record)

    def evict_window(self, rows=None) -> None:
        if rows is None:
            rows_v = sorted(r for r in self.reqs if r not in self.pending)
        else:
            rows_v = self._rows(rows)
        targets = [self.window_frontier(r) for r in rows_v]
        alone = self.group is None  # one step of its own: every window pool's rule

        def record(g):
            for r, p in zip(rows_v, targets, strict=True):
                g["target"][r] = max(g["target"].get(r, p), p)
            if alone:
                g["xevict"] = rows_v
        self._free_op(record)

    def release(self, rows) -> None:
        rows_v = self._rows(rows)

        def record(g):
            g["release"].extend(rows_v)
            for r in rows_v:
                g["target"].pop(r, None)
        self._free_op(record)
        if self.group is not None:
            self.pending.update(rows_v)

    def alloc_extend(self, rows, n_tokens):
        return self.step(extend=(rows, n_tokens))

    def alloc_decode(self, rows, lookahead=None):
        return self.step(decode=rows, lookahead=lookahead)

    def commit(self, rows, n_accepted) -> None:
        self.step(commit=(rows, n_accepted))

    def trim(self, rows, new_lens) -> None:
        self.step(trim=(rows, new_lens))

    # ---- free_group ------------------------------------------------------------------------
    def open_group(self) -> None:
        if self.group is not None:
            raise Violation({NESTED})
        self.group = {"release": [], "target": {}, "drop": [], "tomb": []}

    def discard_group(self) -> None:
        """An exception escaped the block: nothing it recorded runs."""
        self.group, self.pending, self.pending_handles = None, set(), set()

    def close_group(self, at_least_one_step: bool = False) -> None:
        """Run what the block recorded as one step in the step's order (releases, frontier
        moves, handle drops), as the fewest consecutive steps whose release rows each fit
        the frozen shape (greedy cut, in order). Never refused."""
        g = self.group
        self.group, self.pending, self.pending_handles = None, set(), set()
        self._begin_step()
        drops = [(h, False) for h in g["drop"]] + [(h, True) for h in g["tomb"]
                                                 if h not in g["drop"]]
        recorded = g["release"] or g["target"] or drops
        if not recorded:
            self.steps += at_least_one_step
            return
        segs = self._release(g["release"])
        rows = [r for r in g["target"] if r in self.reqs]
        segs += self._advance(rows, [g["target"][r] for r in rows])
        self._xevict(g.get("xevict", ()))  # a single evict_window: the step's evict kind
        segs += self._drop_handles(drops) if drops else []
        self.steps += max([self._parts(segs), 1] + [self._parts(x) for x in self.xsegs])

    # ---- rules -----------------------------------------------------------------------------
    def window_frontier(self, row: int) -> int:
        req, ps = self.reqs[row], self.ps
        if not self.has_window:
            return req.frontier
        return max(req.frontier, self.needed_from(req.committed) // ps * ps)

    def _check_advance(self, rows, new_pos, current) -> None:
        kinds = set()
        if len(new_pos) != len(rows):
            raise Violation({POSITION})
        for r, p, cur in zip(rows, new_pos, current, strict=True):
            if p % self.ps:
                kinds.add(ALIGNMENT)
            if p < cur:
                kinds.add(FRONTIER)
            if p > self.reqs[r].committed // self.ps * self.ps:
                kinds.add(POSITION)
        if kinds:
            raise Violation(kinds)

    def _check_window(self, rows, new_pos) -> None:
        """A frontier that would move needs window layers (their frontier stays 0)."""
        if not self.has_window and any(p != self.reqs[r].frontier
                                       for r, p in zip(rows, new_pos, strict=True)):
            raise Violation({NO_WINDOW})

    def _segments(self, n_pages: int) -> int:
        return ceil_div(n_pages, self.max_pages_per_row) if n_pages > 0 else 0

    def _advance(self, rows, new_pos) -> list:
        """Frontier advance; returns the release segments' page counts (for the step shape)."""
        self._check_advance(rows, new_pos, [self.reqs[r].frontier for r in rows])
        self._check_window(rows, new_pos)
        ps = self.ps
        if self.ring_mode:  # nothing pushed: the mapping of [old, new) is cleared
            segs = []
            for r, new in zip(rows, new_pos, strict=True):
                req = self.reqs[r]
                for k in range(req.frontier // ps, new // ps):
                    self.f2s[req.pages[k]] = 0
                segs.append((new - req.frontier) // ps)
                req.frontier = new
            return segs
        items = [(self.reqs[r].pages, 0, 0, self.reqs[r].frontier // ps, new // ps)
                 for r, new in zip(rows, new_pos, strict=True)]
        segs = self._drop(items)
        for r, new in zip(rows, new_pos, strict=True):
            self.reqs[r].frontier = new
        return segs

    def _release(self, rows) -> list:
        ps, items = self.ps, []
        for r in rows:
            req = self.reqs[r]
            n = len(req.pages)
            items.append((req.pages, 0, n, n if self.ring_mode or not self.has_window
                          else req.frontier // ps, n))
        segs = self._drop(items)
        for i in range(len(self.x)):
            self._xdrop(i, [(self.reqs[r].pages, self.reqs[r].xf[i] // ps,
                             len(self.reqs[r].pages)) for r in rows])
        if self.ring_mode:
            for r in rows:
                segs.append(self.ring_pages)
                for page in self.reqs[r].ring:
                    self._push("swa", page)
        for r in rows:
            req = self.reqs.pop(r)
            if self.has_states:  # its slot, then its speculative slots, oldest step first
                self.state_q.append(req.state)
                self.state_q.extend(x for slots in req.spec_slots for x in slots)
        return segs

    def _extend(self, rows, n_tokens, allocated: set, alloc_rows: list,
                speculative: bool = False) -> list:
        ps, kinds = self.ps, set()
        n_tokens = list(n_tokens)
        if len(n_tokens) != len(rows):
            raise Violation({POSITION})
        need = state_pops = 0
        for r, n in zip(rows, n_tokens, strict=True):
            if not _is_int(n) or n < 0:
                kinds.add(POSITION)
                continue
            req = self.reqs[r]
            if r in allocated:
                kinds.add(OVERLAP)
            spec_row = speculative[rows.index(r)] if isinstance(speculative, list) \
                else speculative
            if spec_row and self.has_states:  # a state slot per speculative token
                state_pops += n
                if n > self.max_spec:
                    kinds.add(STATE_SPEC)
            if (len(req.spec) >= 2) if spec_row else bool(req.spec):
                kinds.add(SPEC)
            end = req.length + n
            if end > self.max_ctx:
                kinds.add(POSITION)
            if n > self.max_tokens_per_alloc_row:
                kinds.add(BATCH)
            need += ceil_div(end, ps) - ceil_div(req.length, ps)
            if self.ring_mode and ceil_div(end, ps) - req.frontier // ps > self.ring_pages:
                kinds.add(RING)
        pooled = self.has_window and not self.ring_mode  # window pages popped with FULL ones
        if need > len(self.full_q) or (pooled and need > len(self.swa_q)) or any(
                need > len(x.q) for x in self.x):
            kinds.add(CAPACITY)
        if self._state_short(state_pops):
            kinds.add(STATE_SHORT)
        if kinds:
            raise Violation(kinds)
        out = []
        for r, n in zip(rows, n_tokens, strict=True):
            req = self.reqs[r]
            full_slots, swa_slots = [], []
            for t in range(req.length, req.length + n):
                p, off = t // ps, t % ps
                if p == len(req.pages):  # a new page, popped in order from both queues
                    full = self._pop_full()
                    req.pages.append(full)
                    self.full_ref[full] += 1
                    if self.ring_mode:
                        self.f2s[full] = req.ring[p % self.ring_pages]
                    elif self.has_window:
                        swa = self._pop_swa()
                        self.f2s[full] = swa
                        self.swa_ref[swa] += 1
                    for x in self.x:  # a page of every further window pool
                        x.f2s[full] = x.pop()
                        x.ref[x.f2s[full]] += 1
                swa_page = self.f2s[req.pages[p]]
                req.slots.append(req.pages[p] * ps + off)
                full_slots.append(req.pages[p] * ps + off)
                swa_slots.append(swa_page * ps + off)
            allocated.add(r)
            if speculative[rows.index(r)] if isinstance(speculative, list) else speculative:
                req.spec.append(n)
                if self.has_states:  # the network writes the state after each token
                    req.spec_slots.append([self._state_pop() for _ in range(n)])
                    self.state_writes.extend(req.spec_slots[-1])
            else:
                req.committed = req.length
                if self.has_states and n > 0:
                    self.state_writes.append(req.state)  # updated in place
            if n > 0:
                alloc_rows.append(n)
            out.append((r, full_slots, swa_slots))
        return out

    def _load_back(self, rows, new_pos, allocated: set, alloc_rows: list) -> None:
        """Frontiers back to ``new_pos``: a FULL page is paired with one SWA page at a time,
        so only pages nobody maps, each loaded back by one row of the step."""
        ps, kinds, seen, need = self.ps, set(), set(), 0
        if len(new_pos) != len(rows):
            raise Violation({POSITION})
        for r, p in zip(rows, new_pos, strict=True):
            req = self.reqs[r]
            if r in allocated:
                kinds.add(OVERLAP)
            if not _is_int(p):
                kinds.add(POSITION)
                continue
            if p % ps:
                kinds.add(ALIGNMENT)
                continue
            if p < 0 or p > req.frontier:
                kinds.add(FRONTIER)
                continue
            pages = req.pages[p // ps:req.frontier // ps]
            if any(self.f2s[x] or x in seen for x in pages):
                kinds.add(MAPPED)
            seen.update(pages)
            if len(pages) * ps > self.max_tokens_per_alloc_row:
                kinds.add(BATCH)
            need += len(pages)
        if need > len(self.swa_q):
            kinds.add(CAPACITY)
        if kinds:
            raise Violation(kinds)
        for r, p in zip(rows, new_pos, strict=True):
            req = self.reqs[r]
            for x in req.pages[p // ps:req.frontier // ps]:
                swa = self._pop_swa()
                self.f2s[x] = swa
                self.swa_ref[swa] += 1
            if req.frontier > p:
                alloc_rows.append(req.frontier - p)
            req.frontier = p
            allocated.add(r)

    def _commit(self, rows, n_accepted) -> list:
        """Resolve each row's oldest speculative step; returns the release segments."""
        if len(n_accepted) != len(rows):
            raise Violation({POSITION})
        kinds = set()
        for r, n in zip(rows, n_accepted, strict=True):
            req = self.reqs[r]
            if not req.spec:
                kinds.add(SPEC)
            elif not _is_int(n) or not 0 <= n <= req.spec[0]:
                kinds.add(POSITION)
        if kinds:
            raise Violation(kinds)
        cuts = []
        for r, n in zip(rows, n_accepted, strict=True):
            req = self.reqs[r]
            req.committed += int(n)
            req.spec = req.spec[1:]
            if self.has_states:
                n, slots = int(n), req.spec_slots.pop(0)
                if n >= 1:  # the state after the n-th token is the request's
                    self.state_q.append(req.state)
                    self.state_q.extend(x for i, x in enumerate(slots) if i != n - 1)
                    req.state = slots[n - 1]
                else:
                    self.state_q.extend(slots)
            cuts.append(req.committed + sum(req.spec))
        return self._cut(rows, cuts)

    def _trim(self, rows, new_lens) -> list:
        if len(new_lens) != len(rows):
            raise Violation({POSITION})
        kinds = set()
        for r, n in zip(rows, new_lens, strict=True):
            req = self.reqs[r]
            if not _is_int(n) or not 0 <= n <= req.length:
                kinds.add(POSITION)
            elif req.frontier > 0 and n < self.min_length(req.frontier):
                kinds.add(FRONTIER)
            elif any(f > 0 and n < min_length(x.rule, f) for x, f in zip(self.x, req.xf,
                                                                         strict=True)):
                kinds.add(FRONTIER)  # a further window pool's evicted pages
            elif n % self.ps and self.full_ref[req.pages[n // self.ps]] > 1:
                kinds.add(SHARED)  # the next allocation would write a shared page
            if self.has_states and _is_int(n) and 0 <= n < req.committed:
                kinds.add(STATE_TRIM)  # a recurrent state cannot roll back
        if kinds:
            raise Violation(kinds)
        for r, n in zip(rows, new_lens, strict=True):
            req = self.reqs[r]
            keep, steps, kept_slots = int(n) - req.committed, [], []
            for i, size in enumerate(req.spec):  # the speculative steps cut at n, oldest first
                if keep > 0:
                    steps.append(min(size, keep))
                if self.has_states:  # the cut tokens give their slots back
                    slots = req.spec_slots[i]
                    cut = max(0, min(size, keep))
                    self.state_q.extend(slots[cut:])
                    if cut:
                        kept_slots.append(slots[:cut])
                keep -= size
            req.spec = steps
            req.spec_slots = kept_slots
            req.committed = min(req.committed, int(n))
        return self._cut(rows, [int(n) for n in new_lens])

    def _cut(self, rows, new_lens) -> list:
        """One call: each row drops its references to the pages wholly past its new length
        (FULL and SWA; ring mode: FULL, the mapping cleared). Returns the release segments."""
        ps, items = self.ps, []
        for r, n in zip(rows, new_lens, strict=True):
            req = self.reqs[r]
            lo, hi = ceil_div(n, ps), len(req.pages)
            items.append((req.pages, lo, hi, hi if self.ring_mode or not self.has_window
                          else lo, hi))
        segs = self._drop(items)
        for i in range(len(self.x)):
            self._xdrop(i, [(self.reqs[r].pages, max(ceil_div(n, ps), self.reqs[r].xf[i] // ps),
                             len(self.reqs[r].pages)) for r, n in zip(rows, new_lens,
                                                                       strict=True)])
        for r, n in zip(rows, new_lens, strict=True):
            req = self.reqs[r]
            del req.pages[ceil_div(n, ps):]
            del req.slots[n:]
        return segs

    def _check_shape(self, rel_segs: list, alloc_tokens: list) -> None:
        n_rows = sum(self._segments(n) for n in rel_segs)
        if (n_rows > self.max_release_rows or sum(rel_segs) > self.max_step_pages
                or len(alloc_tokens) > self.max_alloc_rows
                or sum(alloc_tokens) > self.max_step_tokens):
            raise Violation({BATCH})
        for segs in self.xsegs:  # every further window pool's release section
            if (sum(self._segments(n) for n in segs) > self.max_release_rows
                    or sum(segs) > self.max_step_pages):
                raise Violation({BATCH})

    def _parts(self, segs: list) -> int:
        """Consecutive steps a flush's release segments take (greedy, in order)."""
        rows = [min(self.max_pages_per_row, n - k * self.max_pages_per_row)
                for n in segs for k in range(self._segments(n))]
        n_rows = n_pages = 0
        steps = 0
        for i, pages in enumerate(rows):
            if i == 0 or n_rows + 1 > self.max_release_rows or (
                    n_pages + pages > self.max_step_pages):
                steps += 1
                n_rows = n_pages = 0
            n_rows += 1
            n_pages += pages
        return steps

    # ---- predictions -----------------------------------------------------------------------
    def mapping(self) -> dict[int, int]:
        """full page -> SWA page for every mapped full page."""
        return {p: s for p, s in enumerate(self.f2s) if s}

    def full_to_swa(self) -> list[int]:
        ps = self.ps
        table = [0] * ((self.n_full + 1) * ps)
        for full, swa in self.mapping().items():
            for o in range(ps):
                table[full * ps + o] = swa * ps + o
        return table

    def holders(self):
        """Every holder of references: ``("req", row, Req)`` and ``("handle", id, Handle)``."""
        return ([("req", r, q) for r, q in sorted(self.reqs.items())]
                + [("handle", h, d) for h, d in sorted(self.handles.items())])

    def check_self(self) -> None:
        """The model's own invariants (outside a free group): counts equal the holders,
        conservation per pool, page 0 never referenced, mapping exactly where held."""
        assert self.group is None
        full = [0] * (self.n_full + 1)
        swa = [0] * (self.n_swa + 1)
        for _, _, h in self.holders():
            for k, page in enumerate(h.pages):
                full[page] += 1
                if self.has_window and not self.ring_mode and k >= h.frontier // self.ps:
                    swa[self.f2s[page]] += 1
        assert full == self.full_ref and full[0] == 0
        if not self.ring_mode:
            assert swa == self.swa_ref and swa[0] == 0
            held_swa = [s for s in range(1, self.n_swa + 1) if swa[s]]
            assert sorted(held_swa + list(self.swa_q)) == list(range(1, self.n_swa + 1))
            mapped = [s for s in self.f2s if s]
            assert sorted(mapped) == held_swa  # mapped exactly where held, one peer each
        for page in range(1, self.n_full + 1):
            assert self.f2s[page] == 0 or full[page] > 0
        held_full = [p for p in range(1, self.n_full + 1) if full[p]]
        assert sorted(held_full + list(self.full_q)) == list(range(1, self.n_full + 1))
        if self.has_states:  # every slot free or held exactly once
            held = [q.state for q in self.reqs.values()]
            held += [x for q in self.reqs.values() for slots in q.spec_slots for x in slots]
            held += [h.state for h in self.handles.values()]
            assert sorted(held + list(self.state_q)) == list(range(1, self.n_state + 1))
            for q in self.reqs.values():
                assert [len(slots) for slots in q.spec_slots] == q.spec
        for i, x in enumerate(self.x):  # every further window pool, the same laws
            counts = [0] * (x.n + 1)
            for _, _, h in self.holders():
                assert h.xf[i] % self.ps == 0 and h.xf[i] <= len(h.pages) * self.ps
                for page in h.pages[h.xf[i] // self.ps:]:
                    counts[x.f2s[page]] += 1
            assert counts == x.ref and counts[0] == 0
            held = [s for s in range(1, x.n + 1) if counts[s]]
            assert sorted(held + list(x.q)) == list(range(1, x.n + 1))
            assert sorted(s for s in x.f2s if s) == held
            for page in range(1, self.n_full + 1):
                assert x.f2s[page] == 0 or full[page] > 0

    def free_ring_head(self, pool) -> int:
        """The head of a free ring: ``"full"``, ``"swa"`` or a further window pool's index
        (1, 2, ...)."""
        if pool == "full":
            return self.full_pops % self.n_full
        if pool == "swa":
            return self.swa_pops % max(self.n_swa, 1)  # (no window layers: an empty ring)
        return self.x[pool - 1].pops % self.x[pool - 1].n

    def window_slots(self, pool: int, full_slots: list[int]) -> list[int]:
        """Further window pool ``pool``'s slots of ``full_slots`` (its current mapping)."""
        x, ps = self.x[pool - 1], self.ps
        return [x.f2s[s // ps] * ps + s % ps if x.f2s[s // ps] else 0 for s in full_slots]

    def x_full_to_swa(self, pool: int) -> list[int]:
        """Further window pool ``pool``'s ``full_to_swa``, slot by slot."""
        x, ps = self.x[pool - 1], self.ps
        return [x.f2s[s // ps] * ps + s % ps if x.f2s[s // ps] else 0
                for s in range((self.n_full + 1) * ps)]
