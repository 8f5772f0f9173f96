"""Why a step is refused: one table from refusal codes to the documented typed errors.

Both planners refuse a step the same way: as a :class:`Refusal` -- a code, the kind of the
step part that broke the rule, the row (a request row, a handle, or an index the code
names), the offending value and the limit it broke -- and nothing else. The numpy
reference raises it; the compiled twin returns the same five integers. :func:`to_error`
turns it into the exception the errors table documents, with one message per code, so the
two planners' refusals are equal by construction and are compared as tuples in the tests.

A refusal is raised before anything changes (the planners roll back their writes first).
Cost: O(1).
"""

from __future__ import annotations

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

__all__ = ["Refusal", "to_error", "KIND_NAMES", "CODES", "kind_id", "SHORTAGE_CODES"]

# The step part a refusal names (message prefix), by id (the compiled planner returns ids).
KIND_NAMES = ("take_handle", "release", "commit", "trim", "evict", "advance", "drop_handle",
              "drop_handle_swa", "admit", "admit(handle=)", "decode", "extend", "load_back",
              "step", "reclaim")
_KIND_IDS = {name: i for i, name in enumerate(KIND_NAMES)}


def kind_id(name: str) -> int:
    return _KIND_IDS[name]


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
           ("SWA kv_indices entries", "PageTableSpec.max_swa_indices"))
_POOLS = ("FULL", "SWA")

# code: (exception class, message template). Fields: kind, row, value, limit, and the
# derived words state / shape / shape_name / pool.
CODES: dict[int, tuple[type, str]] = {
    1: (UnknownRequestError, "{kind}: request row {row} is {row_state}"),
    2: (OverlapError, "{kind}: request row {row} appears twice in one call; its segments "
                      "would share pages. Pass each request once"),
    3: (UnknownRequestError, "{kind}: request row {row} is {admit_state}; admit takes a "
                             "free row"),
    4: (OverlapError, "{kind}: request row {row} is admitted twice in one step"),
    5: (UnknownHandleError, "{kind}: handle {row} is {handle_state}"),
    6: (OverlapError, "{kind}: handle {row} is written in this step; use it in the next "
                      "step"),
    7: (OverlapError, "{kind}: handle {row} appears twice in one step; pass each once"),
    8: (OverlapError, "{kind}: handle {row} is held; a take needs a free handle"),
    9: (ContractError, "{kind}: prefix sharing needs pool mode; in ring mode every request "
                       "keeps its window in its own ring of SWA pages, so a shared prefix's "
                       "window cannot be shared (build the allocator with swa_ring_pages=0)"),
    10: (AlignmentError, "{kind}: {value} tokens is not a whole number of pages (page_size "
                         "{limit}); share whole pages only"),
    11: (PositionError, "{kind}: {value} tokens, request {row} holds {limit} committed "
                        "tokens (when the step began); take 1 .. that many, whole pages"),
    12: (PositionError, "{kind}: handle {row} holds {limit} tokens, cannot share {value}; "
                        "share 1 .. that many, whole pages"),
    13: (SpeculativeStateError, "{kind}: request {row} has no speculative step to commit "
                                "(decode(..., lookahead=k) makes one)"),
    14: (PositionError, "{kind}: request {row}: {value} tokens accepted of a speculative "
                        "step of {limit}"),
    15: (PositionError, "{kind}: request {row}: a length must be >= 0, got {value}"),
    16: (PositionError, "{kind}: request {row} holds {limit} tokens, cannot trim to {value} "
                        "(a trim only shortens)"),
    17: (FrontierError, "{kind}: request {row}: length {value} is below frontier + window "
                        "{limit}: the window of the new length would need SWA pages already "
                        "evicted. Release the request instead (or load_back)"),
    18: (SharedPageError, "{kind}: request {row}: a length of {value} ends inside a page "
                          "another holder references (its shared part ends at {limit}); the "
                          "next allocation would write that shared page. Trim to a page "
                          "boundary, or to at least {limit}"),
    19: (AlignmentError, "{kind}: request {row}: frontier {value} is not a multiple of "
                         "page_size {limit}; only whole pages are freed"),
    20: (FrontierError, "{kind}: request {row}: frontier would move back from {limit} to "
                        "{value} (only load_back() moves it back)"),
    21: (PositionError, "{kind}: request {row}: frontier {value} is past the last whole "
                        "committed page ({limit}) that existed when the step began"),
    22: (OverlapError, "{kind}: request {row} already allocates in this step; merge its "
                       "tokens into one call"),
    23: (OverlapError, "{kind}: request {row} is admitted in this step (ring mode): its "
                       "ring pages are written by this step, so it allocates from the next "
                       "step on"),
    24: (SpeculativeStateError, "{kind}: request {row} already has {limit} speculative steps "
                                "in flight; commit the oldest (step(commit=...)) before "
                                "drafting another"),
    25: (SpeculativeStateError, "{kind}: request {row} has a speculative tail of {value} "
                                "tokens; commit or trim it first, or decode with lookahead="),
    26: (PositionError, "{kind}: request {row}: positions up to {value} exceed "
                        "max_context_len {limit}"),
    27: (BatchTooLargeError, "{kind}: request {row} allocates {value} tokens in one step; "
                             "the frozen max_tokens_per_alloc_row is {limit}: split it over "
                             "steps"),
    28: (CapacityError, "{kind}: the step needs {value} more {pool} pages; {limit} are free. "
                        "Nothing was allocated: free or evict first, or allocate fewer "
                        "tokens"),
    29: (RingOverflowError, "{kind}: request {row}: its pages from the frontier would span "
                            "{value} ring pages, the ring has {limit}. Evict the window "
                            "first (in the same step is fine), or extend in smaller chunks"),
    30: (CapacityError, "{kind}: admitting a request in ring mode needs {limit} SWA pages, "
                        "{value} are free"),
    31: (ContractError, "{kind} is for pool mode; a ring request keeps its ring pages, "
                        "there is nothing to load back"),
    32: (FrontierError, "{kind}: request {row}: the frontier must move back into [0, "
                        "frontier {limit}], got {value}"),
    33: (ContractError, "{kind}: request {row}'s page at position {value} still has an SWA "
                        "page (another holder's window covers it), or another row of this "
                        "step loads it back (a page the rows share); load back only pages "
                        "nobody maps, one row per shared page"),
    34: (BatchTooLargeError, "{kind}: request {row}: {value} positions exceed the frozen "
                             "max_tokens_per_alloc_row {limit}: load back in parts"),
    35: (BatchTooLargeError, "this step needs {value} {shape}; the frozen {shape_name} is "
                             "{limit}. Split the step, or build the allocator with a larger "
                             "{shape_name}"),
    36: (CapacityError, "{kind}: request row {row} is not free and every other row is taken"),
    40: (PositionError, "{kind}: handle {row} holds a recurrent-state snapshot at {limit} "
                        "tokens only, cannot share {value}: admit on the whole handle (the "
                        "prefix cache matches at snapshot boundaries)"),
    41: (PositionError, "{kind}: request {row} has a recurrent state at its committed "
                        "length {limit} only (when the step begins), cannot snapshot {value} "
                        "tokens: take the handle at {limit}"),
    42: (PositionError, "{kind}: request {row}: a recurrent state cannot be rolled back below "
                        "the committed length {limit}, cannot trim to {value}"),
    43: (CapacityError, "{kind}: the step needs {value} recurrent-state slots; {limit} are "
                        "free. Nothing was allocated: release requests or drop snapshots"),
    44: (BatchTooLargeError, "{kind}: request {row}'s speculative step of {value} tokens "
                             "needs a state slot per token; max_spec_tokens is {limit}"),
    45: (CapacityError, "{kind}: state slot {value} is copied from in this step, so it cannot "
                        "also be a copy's destination; the pool had no other free slot. "
                        "Retry next step (the slot is free then)"),
}

# Refusals that mean "not now, for lack of room" (fits() -> False, try_step() -> None).
SHORTAGE_CODES = frozenset({27, 28, 29, 30, 34, 35, 43, 45})


class Refusal(Exception):
    """A planner's refusal: ``(code, kind, row, value, limit)`` (see the module)."""

    def __init__(self, code: int, kind: int, row: int = 0, value: int = 0, limit: int = 0):
        super().__init__(code, kind, row, value, limit)
        self.code, self.kind, self.row, self.value, self.limit = (
            int(code), int(kind), int(row), int(value), int(limit))

    @property
    def fields(self) -> tuple[int, int, int, int, int]:
        return self.code, self.kind, self.row, self.value, self.limit

    @property
    def shortage(self) -> bool:
        return self.code in SHORTAGE_CODES


def _word(table, i: int) -> str:
    return table[i] if 0 <= i < len(table) else f"state {i}"


def to_error(refusal: Refusal) -> ContractError:
    """The typed error of ``refusal`` (its class and message from :data:`CODES`)."""
    cls, template = CODES[refusal.code]
    shape, shape_name = _SHAPES[refusal.row] if 0 <= refusal.row < len(_SHAPES) else ("?", "?")
    message = template.format(
        kind=_word(KIND_NAMES, refusal.kind), row=refusal.row, value=refusal.value,
        limit=refusal.limit, row_state=_word(_ROW_STATES, refusal.value),
        admit_state=_word(_ADMIT_STATES, refusal.value),
        handle_state=_word(_HANDLE_STATES, refusal.value), shape=shape, shape_name=shape_name,
        pool=_word(_POOLS, refusal.row))
    error = cls(message)
    error.refusal = refusal.fields
    return error
