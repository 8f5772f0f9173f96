"""Why a step is refused: named refusal codes, one table from each to its typed error.

Both planners refuse a step the same way: as a :class:`Refusal` -- a :class:`RefusalCode`,
the :class:`Kind` of step part that broke the rule, the row (a request row, a handle, or an
index the code names), the offending value and the limit it broke -- and nothing else. The
numpy reference raises it; the compiled twin returns the same five integers, using the
same names: ``_cplan_refusals.h`` is emitted from this module (``python -m
graphalloc.plan.refusals``; a test keeps the committed header equal to the emitted one) and
the extension's table is compared with the enums at import, like the device ABI.
:func:`to_error` turns a refusal into the exception the table documents, with one message
per code, so the two planners' refusals are equal by construction and are compared as
tuples in the tests. The error carries the refusal (``ContractError.refusal``, a
:class:`RefusalInfo`).

Each code says whether it is a *shortage* (``fits()`` is False and ``try_step()`` returns
None: not now, for lack of room or of the frozen shape) and whether it is short of pool
*room* (pages, state slots, request rows: frees or cache drops can make room).

A refusal is raised before anything changes (the planners roll back their writes first).
Cost: O(1).
"""

from __future__ import annotations

import enum
import sys
from typing import NamedTuple

from ..errors import (
    AlignmentError,
    BatchTooLargeError,
    CapacityError,
    ContractError,
    FrontierError,
    OverlapError,
    PositionError,
    RingOverflowError,
    SharedPageError,
    SpeculativeStateError,
    UnknownHandleError,
    UnknownRequestError,
)

__all__ = ["Refusal", "RefusalCode", "RefusalInfo", "Kind", "to_error", "kind_id",
           "c_header", "SHAPE_WINDOW_ROWS", "SHAPE_WINDOW_PAGES"]


class Kind(enum.IntEnum):
    """The step part a refusal names; ``label`` is its message prefix."""

    def __new__(cls, value: int, label: str):
        member = int.__new__(cls, value)
        member._value_ = value
        member.label = label
        return member

    TAKE_HANDLE = 0, "take_handle"
    RELEASE = 1, "release"
    COMMIT = 2, "commit"
    TRIM = 3, "trim"
    EVICT = 4, "evict"
    ADVANCE = 5, "advance"
    DROP_HANDLE = 6, "drop_handle"
    DROP_HANDLE_SWA = 7, "drop_handle_swa"
    ADMIT = 8, "admit"
    ADMIT_ON = 9, "admit(handle=)"
    DECODE = 10, "decode"
    EXTEND = 11, "extend"
    LOAD_BACK = 12, "load_back"
    STEP = 13, "step"
    RECLAIM = 14, "reclaim"


_KIND_IDS = {kind.label: kind for kind in Kind}


def kind_id(label: str) -> Kind:
    """The :class:`Kind` whose message prefix is ``label``."""
    return _KIND_IDS[label]


_ROW_STATES = ("not admitted; admit() returns live rows",
               "already released (a second release of one request?); a row is live again "
               "only after admit() returns it",
               "released earlier in this step",
               "released earlier in the open free_group(); its release runs when the block "
               "closes")
_ADMIT_STATES = ("live (admitted and not released)",
                 "released in this step (a row is reused only after its release ran)",
                 "released in the open free_group() (reused after the block)")
_HANDLE_STATES = ("outside [0, max_handles)", "not held (never taken, or dropped already)",
                  "dropped in the open free_group()", "dropped earlier in this step")
_SHAPES = (("release rows", "max_release_rows"), ("freed pages", "max_step_pages"),
           ("allocation rows", "max_alloc_rows"), ("allocated tokens", "max_step_tokens"),
           ("attention lanes", "PageTableSpec.max_batch"),
           ("FULL kv_indices entries", "PageTableSpec.max_full_indices"),
           ("SWA kv_indices entries", "PageTableSpec.max_swa_indices"),
           ("release rows of a further window pool", "max_release_rows"),
           ("freed pages of a further window pool", "max_step_pages"))
SHAPE_WINDOW_ROWS, SHAPE_WINDOW_PAGES = 7, 8  # an extra window pool's release section
_POOLS = ("FULL", "SWA")  # then "window pool p" for a model's further window pools
_ROOM = frozenset({28, 30, 36, 43, 45})  # short of pages, state slots or request rows


class RefusalCode(enum.IntEnum):
    """Every reason a step is refused: ``error`` (the typed exception), ``shortage`` (not
    now: ``fits()`` False, ``try_step()`` None), ``room`` (short of pages, state slots or
    request rows: frees or cache drops can help) and ``template`` (the message; fields
    kind, row, value, limit and the derived words row_state / admit_state / handle_state /
    shape / shape_name / pool)."""

    def __new__(cls, value: int, error: type, shortage: bool, template: str):
        member = int.__new__(cls, value)
        member._value_ = value
        member.error, member.shortage, member.template = error, shortage, template
        member.room = value in _ROOM
        return member

    ROW_NOT_LIVE = (1, UnknownRequestError, False,
        "{kind}: request row {row} is {row_state}")
    ROW_REPEATED = (2, OverlapError, False,
        "{kind}: request row {row} appears twice in one call; its segments "
        "would share pages. Pass each request once")
    ROW_NOT_FREE = (3, UnknownRequestError, False,
        "{kind}: request row {row} is {admit_state}; admit takes a "
        "free row")
    ROW_ADMITTED_TWICE = (4, OverlapError, False,
        "{kind}: request row {row} is admitted twice in one step")
    HANDLE_NOT_HELD = (5, UnknownHandleError, False,
        "{kind}: handle {row} is {handle_state}")
    HANDLE_WRITTEN_THIS_STEP = (6, OverlapError, False,
        "{kind}: handle {row} is written in this step; use it in the next "
        "step")
    HANDLE_REPEATED = (7, OverlapError, False,
        "{kind}: handle {row} appears twice in one step; pass each once")
    HANDLE_HELD = (8, OverlapError, False,
        "{kind}: handle {row} is held; a take needs a free handle")
    SHARING_NEEDS_POOL_MODE = (9, ContractError, False,
        "{kind}: prefix sharing needs pool mode; in ring mode every request "
        "keeps its window in its own ring of SWA pages, so a shared prefix's "
        "window cannot be shared (build the allocator with swa_ring_pages=0)")
    NOT_WHOLE_PAGES = (10, AlignmentError, False,
        "{kind}: {value} tokens is not a whole number of pages (page_size "
        "{limit}); share whole pages only")
    TAKE_PAST_COMMITTED = (11, PositionError, False,
        "{kind}: {value} tokens, request {row} holds {limit} committed "
        "tokens (when the step began); take 1 .. that many, whole pages")
    SHARE_PAST_HANDLE = (12, PositionError, False,
        "{kind}: handle {row} holds {limit} tokens, cannot share {value}; "
        "share 1 .. that many, whole pages")
    NO_SPECULATIVE_STEP = (13, SpeculativeStateError, False,
        "{kind}: request {row} has no speculative step to commit "
        "(decode(..., lookahead=k) makes one)")
    ACCEPTED_PAST_STEP = (14, PositionError, False,
        "{kind}: request {row}: {value} tokens accepted of a speculative "
        "step of {limit}")
    NEGATIVE_LENGTH = (15, PositionError, False,
        "{kind}: request {row}: a length must be >= 0, got {value}")
    TRIM_LENGTHENS = (16, PositionError, False,
        "{kind}: request {row} holds {limit} tokens, cannot trim to {value} "
        "(a trim only shortens)")
    TRIM_BELOW_WINDOW = (17, FrontierError, False,
        "{kind}: request {row}: length {value} is below frontier + window "
        "{limit}: the window of the new length would need SWA pages already "
        "evicted. Release the request instead (or load_back)")
    TRIM_INSIDE_SHARED_PAGE = (18, SharedPageError, False,
        "{kind}: request {row}: a length of {value} ends inside a page "
        "another holder references (its shared part ends at {limit}); the "
        "next allocation would write that shared page. Trim to a page "
        "boundary, or to at least {limit}")
    FRONTIER_NOT_ALIGNED = (19, AlignmentError, False,
        "{kind}: request {row}: frontier {value} is not a multiple of "
        "page_size {limit}; only whole pages are freed")
    FRONTIER_BACKWARDS = (20, FrontierError, False,
        "{kind}: request {row}: frontier would move back from {limit} to "
        "{value} (only load_back() moves it back)")
    FRONTIER_PAST_COMMITTED = (21, PositionError, False,
        "{kind}: request {row}: frontier {value} is past the last whole "
        "committed page ({limit}) that existed when the step began")
    ROW_ALLOCATES_TWICE = (22, OverlapError, False,
        "{kind}: request {row} already allocates in this step; merge its "
        "tokens into one call")
    RING_ADMIT_ALLOCATES = (23, OverlapError, False,
        "{kind}: request {row} is admitted in this step (ring mode): its "
        "ring pages are written by this step, so it allocates from the next "
        "step on")
    SPECULATION_TOO_DEEP = (24, SpeculativeStateError, False,
        "{kind}: request {row} already has {limit} speculative steps "
        "in flight; commit the oldest (step(commit=...)) before "
        "drafting another")
    SPECULATIVE_TAIL_PENDING = (25, SpeculativeStateError, False,
        "{kind}: request {row} has a speculative tail of {value} "
        "tokens; commit or trim it first, or decode with lookahead=")
    PAST_CONTEXT = (26, PositionError, False,
        "{kind}: request {row}: positions up to {value} exceed "
        "max_context_len {limit}")
    ROW_OVER_TOKEN_SHAPE = (27, BatchTooLargeError, True,
        "{kind}: request {row} allocates {value} tokens in one step; "
        "the frozen max_tokens_per_alloc_row is {limit}: split it over "
        "steps")
    PAGES_SHORT = (28, CapacityError, True,
        "{kind}: the step needs {value} more {pool} pages; {limit} are free. "
        "Nothing was allocated: free or evict first, or allocate fewer "
        "tokens")
    RING_SPAN_TOO_LONG = (29, RingOverflowError, True,
        "{kind}: request {row}: its pages from the frontier would span "
        "{value} ring pages, the ring has {limit}. Evict the window "
        "first (in the same step is fine), or extend in smaller chunks")
    RING_ADMIT_SHORT = (30, CapacityError, True,
        "{kind}: admitting a request in ring mode needs {limit} SWA pages, "
        "{value} are free")
    LOAD_BACK_IN_RING_MODE = (31, ContractError, False,
        "{kind} is for pool mode; a ring request keeps its ring pages, "
        "there is nothing to load back")
    LOAD_BACK_OUTSIDE_FRONTIER = (32, FrontierError, False,
        "{kind}: request {row}: the frontier must move back into [0, "
        "frontier {limit}], got {value}")
    LOAD_BACK_MAPPED_PAGE = (33, ContractError, False,
        "{kind}: request {row}'s page at position {value} still has an SWA "
        "page (another holder's window covers it), or another row of this "
        "step loads it back (a page the rows share); load back only pages "
        "nobody maps, one row per shared page")
    LOAD_BACK_OVER_TOKEN_SHAPE = (34, BatchTooLargeError, True,
        "{kind}: request {row}: {value} positions exceed the frozen "
        "max_tokens_per_alloc_row {limit}: load back in parts")
    STEP_OVER_SHAPE = (35, BatchTooLargeError, True,
        "this step needs {value} {shape}; the frozen {shape_name} is "
        "{limit}. Split the step, or build the allocator with a larger "
        "{shape_name}")
    NO_FREE_ROW = (36, CapacityError, True,
        "{kind}: request row {row} is not free and every other row is taken")
    STATE_SHARE_NOT_AT_SNAPSHOT = (40, PositionError, False,
        "{kind}: handle {row} holds a recurrent-state snapshot at {limit} "
        "tokens only, cannot share {value}: admit on the whole handle (the "
        "prefix cache matches at snapshot boundaries)")
    STATE_TAKE_NOT_AT_COMMITTED = (41, PositionError, False,
        "{kind}: request {row} has a recurrent state at its committed "
        "length {limit} only (when the step begins), cannot snapshot {value} "
        "tokens: take the handle at {limit}")
    STATE_TRIM_BELOW_COMMITTED = (42, PositionError, False,
        "{kind}: request {row}: a recurrent state cannot be rolled back below "
        "the committed length {limit}, cannot trim to {value}")
    STATE_SLOTS_SHORT = (43, CapacityError, True,
        "{kind}: the step needs {value} recurrent-state slots; {limit} are "
        "free. Nothing was allocated: release requests or drop snapshots")
    STATE_SPEC_OVER_SHAPE = (44, BatchTooLargeError, True,  # a frozen-shape limit
        "{kind}: request {row}'s speculative step of {value} tokens "
        "needs a state slot per token; max_spec_tokens is {limit}")
    STATE_COPY_SOURCE_BUSY = (45, CapacityError, True,
        "{kind}: state slot {value} is copied from in this step, so it cannot "
        "also be a copy's destination; the pool had no other free slot. "
        "Retry next step (the slot is free then)")
    NO_WINDOW_POOL = (46, ContractError, False,
        "{kind}: the model has no window layers (no SlidingWindow or ChunkedLocal pool), "
        "so there is no frontier to move; every position keeps its FULL page until the "
        "request is released or trimmed")


class RefusalInfo(NamedTuple):
    """A refusal as data (``ContractError.refusal``): equal to the plain 5-tuple."""

    code: RefusalCode
    kind: Kind
    row: int
    value: int
    limit: int


class Refusal(Exception):
    """A planner's refusal: ``(code, kind, row, value, limit)`` (see the module)."""

    def __init__(self, code: RefusalCode, kind: Kind, row: int = 0, value: int = 0,
                 limit: int = 0):
        super().__init__(code, kind, row, value, limit)
        self.code, self.kind = RefusalCode(code), Kind(kind)
        self.row, self.value, self.limit = int(row), int(value), int(limit)

    @property
    def fields(self) -> RefusalInfo:
        return RefusalInfo(self.code, self.kind, self.row, self.value, self.limit)

    @property
    def shortage(self) -> bool:
        return self.code.shortage


def _word(table, i: int) -> str:
    return table[i] if 0 <= i < len(table) else f"state {i}"


def _pool(i: int) -> str:
    """Pool ``i`` of a PAGES_SHORT refusal: 0 FULL, 1 the (first) window pool, p + 1 the
    model's window pool p >= 1."""
    return _POOLS[i] if 0 <= i < len(_POOLS) else f"window pool {i - 1}"


def to_error(refusal: Refusal):
    """The typed error of ``refusal`` (its class and message from :class:`RefusalCode`),
    carrying ``refusal.fields`` as its ``refusal``."""
    code = refusal.code
    shape, shape_name = _SHAPES[refusal.row] if 0 <= refusal.row < len(_SHAPES) else ("?", "?")
    message = code.template.format(
        kind=refusal.kind.label, row=refusal.row, value=refusal.value,
        limit=refusal.limit, row_state=_word(_ROW_STATES, refusal.value),
        admit_state=_word(_ADMIT_STATES, refusal.value),
        handle_state=_word(_HANDLE_STATES, refusal.value), shape=shape, shape_name=shape_name,
        pool=_pool(refusal.row))
    error = code.error(message)
    error.refusal = refusal.fields
    return error


def c_header() -> str:
    """The compiled twin's names of :class:`Kind` and :class:`RefusalCode`
    (``_cplan_refusals.h``), emitted from the enums so the C uses the same names."""
    lines = ["/* Emitted by `python -m graphalloc.plan.refusals` from graphalloc/plan/refusals.py:",
             " * do not edit (tests/planning/test_refusals.py compares it). */",
             "#ifndef GRAPHALLOC_CPLAN_REFUSALS_H", "#define GRAPHALLOC_CPLAN_REFUSALS_H", "",
             "/* Kind: the step part a refusal names */", "enum {"]
    lines += [f"    K_{kind.name} = {int(kind)}," for kind in Kind]
    lines += [f"    N_KINDS = {len(Kind)}", "};", "",
              "/* RefusalCode: why a step is refused */", "enum {"]
    lines += [f"    R_{code.name} = {int(code)}," for code in RefusalCode]
    lines += ["};", "", "/* name -> value, for the import-time comparison (compiled.py) */",
              "#define REFUSAL_TABLE \\"]
    lines += [f"    {{\"K_{kind.name}\", K_{kind.name}}}, \\" for kind in Kind]
    lines += [f"    {{\"R_{code.name}\", R_{code.name}}}, \\" for code in RefusalCode]
    lines += ["    {\"N_KINDS\", N_KINDS}", "", "#endif", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(c_header())
