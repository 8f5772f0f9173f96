"""The :class:`Step` value: everything one scheduler step can carry, and its one normaliser.

A step is a value, built once by whoever drives the allocator (``alloc.step(...)``'s
keywords, a single operation, a ``scheduler_step()`` or ``free_group()`` block, a seam, the
replica layer) and planned as a whole. Its kinds run in ONE order, stated here and nowhere
else; both planners (:mod:`graphalloc.plan.reference`, the compiled twin) follow it:

=====  ==============  ==============================  =====================================
order  kind            value                           effect
=====  ==============  ==============================  =====================================
1      ``take``        (handles, rows, n_tokens)       handle h takes references to row r's
                                                       first n tokens (a cache insert), as
                                                       the step begins
2      ``release``     rows                            free everything; the rows are free
3      ``accept``      (rows, n_accepted)              speculative: keep 1 + n tokens of the
                                                       oldest step (the verified token and n
                                                       accepted drafts, vLLM's count)
       ``commit``      (rows, n_kept)                  deprecated: keep n tokens (``accept``
                                                       with n - 1; the only way to keep 0)
4      ``trim``        (rows, new_len)                 cut requests back to new_len
5      ``evict``       rows (or ``evict_all=True``)    frontier by the window rule
6      ``advance``     (rows, new_frontier_pos)        explicit page-aligned frontier moves
7      ``drop``        handles                         drop every reference a handle holds
       ``drop_swa``    handles                         drop its SWA references (a tombstone)
8      ``admit``       rows                            free rows become empty requests
       ``admit_on``    (rows, handles, n_tokens)       ... sharing a handle's first n tokens
                                                       (``None``/-1: all of them)
9      ``decode``      rows (+ ``lookahead``)          1 token each, or 1 + k speculative
                                                       (k per row; -1 marks a plain row)
10     ``extend``      (rows, n_tokens)                prefill / chunked prefill
11     ``load_back``   (rows, new_frontier_pos)        frontier moved back, fresh SWA pages
=====  ==============  ==============================  =====================================

Every push of a step precedes every pop, so pages the frees give back serve the step's
allocations. Output lanes (the slots allocated) follow the order decode, extend, load_back,
rows as given. A prefix cache may add drops of its own entries (``reclaim``) when an
allocation is short: they run after step 7.

Rows of the frozen shape the kinds take (``max_alloc_rows``): one per decode, extend and
load_back row; one per ``take`` and ``admit_on`` (the prefix copy); none for a pool-mode
``admit``, but one per ring-mode ``admit`` (it pops the request's ring pages), and a
request admitted in ring mode cannot allocate in its admitting step (``OverlapError``: that
step writes its ring; it decodes or extends from the next step on; a pool-mode admit may
extend in the same step). One row carries at most ``max_tokens_per_alloc_row`` tokens; a
``load_back`` of ``[f', f)`` is one row of ``f - f'`` tokens, so a longer one is refused
(``BatchTooLargeError``, a shortage for ``try_step``) and must be split: move the frontier
back in parts, ``load_back(r, f - k)``, then ``load_back(r, f - 2k)``, ... (each part one
step, ``k`` whole pages within the limit).

:func:`normalize` turns a step into :class:`StepArrays`: int64 arrays in the order above
(one conversion path, :mod:`graphalloc.inputs`: the same inputs accepted, the same garbage
refused with the same typed error, before any planning). What a kind may do is decided by
the planners, which see the arrays only. Cost: O(rows) numpy; nothing when the caller
passes 1-D int64 arrays (they are used as they are, never written).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..deprecations import warn_renamed
from ..errors import ContractError, PositionError, SpeculativeStateError, UnknownHandleError
from ..inputs import as_counts, as_int64, as_positions, as_rows, compiled_half, is_empty

__all__ = ["Step", "StepArrays", "normalize", "normalize_fast", "step_from", "EMPTY", "KINDS",
           "ACCEPT_AND_COMMIT", "filled"]

EMPTY = np.zeros(0, dtype=np.int64)
EMPTY.flags.writeable = False

ACCEPT_AND_COMMIT = ("accept= and commit= both given: they are one kind (commit= is its "
                     "deprecated form); pass accept=(rows, n_accepted)")

KINDS = ("take", "release", "accept", "commit", "trim", "evict", "evict_all", "advance", "drop",
         "drop_swa", "admit", "admit_on", "decode", "lookahead", "extend", "load_back")


class Step:
    """One scheduler step (see the module docstring for the kinds and their order).

    Every field is optional; ``Step()`` is an empty step. Rows are request rows, handles
    handle ids; a count or position is one int (broadcast to the rows) or one per row.
    Build it with keywords: ``Step(release=done, evict_all=True, decode=running)``; a
    positional argument or a keyword that is not a kind raises ``ContractError`` (as
    ``alloc.step(...)`` does). A Step is a plain value: planning never writes it."""

    __slots__ = KINDS

    def __init__(self, *positional, take=None, release=None, accept=None, commit=None,
                 trim=None, evict=None, evict_all: bool = False, advance=None, drop=None,
                 drop_swa=None, admit=None, admit_on=None, decode=None, lookahead=None,
                 extend=None, load_back=None, **unknown):
        if positional or unknown:
            what = (f"{sorted(unknown)} is not a kind of Step" if unknown else
                    f"Step takes keywords only, got {len(positional)} positional argument(s)")
            raise ContractError(f"Step(): {what}; the kinds are {', '.join(KINDS)}")
        if commit is not None:
            warn_renamed("Step(commit=(rows, n)) counts the tokens kept, the verified one "
                         "included, and is deprecated: pass accept=(rows, n - 1), the draft "
                         "tokens accepted (vLLM's num_accepted_tokens); alloc.commit / "
                         "it.commit become alloc.accept / it.accept")
        self.take, self.release, self.accept, self.commit = take, release, accept, commit
        self.trim = trim
        self.evict, self.evict_all, self.advance = evict, evict_all, advance
        self.drop, self.drop_swa, self.admit, self.admit_on = drop, drop_swa, admit, admit_on
        self.decode, self.lookahead, self.extend, self.load_back = (decode, lookahead, extend,
                                                                    load_back)

    def __repr__(self) -> str:
        parts = [f"{k}={getattr(self, k)!r}" for k in KINDS
                 if getattr(self, k) is not None and getattr(self, k) is not False]
        return f"Step({', '.join(parts)})"

    def kinds(self) -> list[str]:
        """The kinds this step carries (non-empty fields), in the step's order."""
        return [k for k in KINDS if k != "lookahead" and not _absent(getattr(self, k))]


def step_from(step, kinds: dict, what: str) -> Step:
    """The Step a call names: ``step`` (a :class:`Step`) or its keywords ``kinds``, never
    both; ``ContractError`` for an unknown kind or a mix. O(kinds)."""
    if step is None:
        unknown = sorted(set(kinds) - set(KINDS))
        if unknown:
            raise ContractError(f"{what}(): {unknown} is not a kind of Step; the kinds are "
                                f"{', '.join(KINDS)}")
        return Step(**kinds)
    if kinds or not isinstance(step, Step):
        raise ContractError(f"{what}() takes a Step or its keywords, not both; got "
                            f"{type(step).__name__} and {sorted(kinds)}")
    return step


def _absent(value) -> bool:
    return value is None or value is False or (not isinstance(value, tuple) and is_empty(value))


class StepArrays(NamedTuple):
    """A normalised step: int64 1-D arrays (read-only ``EMPTY`` where a kind is absent) and
    two flags, in the step's order. This tuple is what both planners take."""

    take_handle: np.ndarray
    take_row: np.ndarray
    take_tokens: np.ndarray
    release: np.ndarray
    commit_row: np.ndarray
    commit_n: np.ndarray  # tokens kept of the oldest speculative step (accept: 1 + accepted)
    trim_row: np.ndarray
    trim_len: np.ndarray
    evict: np.ndarray
    evict_all: int
    advance_row: np.ndarray
    advance_pos: np.ndarray
    drop: np.ndarray
    drop_swa: np.ndarray
    admit: np.ndarray
    admit_on_row: np.ndarray
    admit_on_handle: np.ndarray
    admit_on_tokens: np.ndarray  # -1: every token of the handle
    decode: np.ndarray
    decode_n: np.ndarray  # tokens per decode row: 1, or 1 + lookahead
    decode_spec: np.ndarray  # per decode row, 1: a speculative step (lookahead given)
    extend_row: np.ndarray
    extend_n: np.ndarray
    load_row: np.ndarray
    load_pos: np.ndarray

    @property
    def n_alloc_rows(self) -> int:
        """Rows that get output lanes (decode, extend, load-back)."""
        return len(self.decode) + len(self.extend_row) + len(self.load_row)


def _pair(value, what: str, second: str, n: int = 2):
    if not isinstance(value, (tuple, list)) or len(value) != n:
        names = "(rows, " + second + ")"
        raise ContractError(f"{what} takes {names}; got {value!r}")
    return value


def _rows(value, n_reqs: int, what: str) -> np.ndarray:
    if value is None:
        return EMPTY
    if type(value) is np.ndarray and value.dtype == np.int64 and value.ndim == 1:
        if len(value) and _largest_unsigned(value) >= n_reqs:  # (a negative row is huge)
            return as_rows(value, n_reqs, what)  # raises with the row named
        return value
    return as_rows(value, n_reqs, what) if not is_empty(value) else EMPTY


def _largest_unsigned(value: np.ndarray) -> int:
    """max(value) as unsigned 64-bit (a negative entry is huge): one numpy reduction, or a
    list for a few entries (a reduction's fixed cost is microseconds)."""
    if len(value) <= 16:
        return max(x & 0xFFFFFFFFFFFFFFFF for x in value.tolist())
    return int(value.view(np.uint64).max())


_FILLED: dict[int, np.ndarray] = {}  # read-only int64 arrays of one value (np.full costs more)


def filled(value: int, n: int) -> np.ndarray:
    """``n`` copies of ``value`` as a read-only int64 view (a few small values cached)."""
    base = _FILLED.get(value, EMPTY)
    if len(base) < n:
        base = np.full(max(n, 2 * len(base), 1024), value, dtype=np.int64)
        base.flags.writeable = False
        _FILLED[value] = base
    return base[:n]


def _handles(value, what: str) -> np.ndarray:
    """Handle ids as int64 (ranges are the planners' rule: an unknown handle)."""
    if value is None or (not isinstance(value, (int, np.integer)) and is_empty(value)):
        return EMPTY
    return as_int64(value, what, UnknownHandleError)


def _bind_fast():
    """``graphalloc._cinputs.normalize`` bound to this module's types, or None (not built, or
    built for other kinds or fields)."""
    half = compiled_half
    if half is None or tuple(half.KINDS) != KINDS or tuple(half.FIELDS) != StepArrays._fields:
        return None
    half.bind(np.ndarray, np.integer, np.empty, np.int64, Step, StepArrays, EMPTY)
    return half.normalize


normalize_fast = _bind_fast()  # (step or keywords dict, max_reqs) -> StepArrays | None


def normalize(step: Step, config) -> StepArrays:
    """``step`` as :class:`StepArrays` for ``config`` (rows range-checked against
    ``max_reqs``; everything else is the planners' to judge). Raises the typed input errors
    of :mod:`graphalloc.inputs` (``UnknownRequestError`` for rows, ``PositionError`` for
    counts and positions, ``UnknownHandleError`` for handles, ``TensorSpecError`` for device
    tensors, ``ContractError`` for a malformed pair), before anything is planned. The plain
    forms are converted in C (:data:`normalize_fast`), the rest here."""
    n = config.max_reqs
    if normalize_fast is not None:
        arrays = normalize_fast(step, n)
        if arrays is not None:
            return arrays
    take_h = take_r = take_n = EMPTY
    if step.take is not None:
        h, r, k = _pair(step.take, "take", "(handles, rows, n_tokens)", 3)
        take_h = _handles(h, "take handles")
        take_r = _rows(r, n, "take_handle")
        if len(take_h) != len(take_r):
            raise ContractError(f"take: {len(take_h)} handles for {len(take_r)} rows")
        take_n = as_counts(k, len(take_r), "take_handle n_tokens")
    release = _rows(step.release, n, "release")
    com_r = com_n = EMPTY  # commit_n: tokens kept (accept: 1 + the accepted drafts)
    if step.accept is not None:
        if step.commit is not None:
            raise ContractError(ACCEPT_AND_COMMIT)
        r, k = _pair(step.accept, "accept", "n_accepted")
        com_r = _rows(r, n, "accept")
        com_n = as_counts(k, len(com_r), "accepted draft counts") + 1
    elif step.commit is not None:
        r, k = _pair(step.commit, "commit", "n_kept")
        com_r = _rows(r, n, "commit")
        com_n = as_counts(k, len(com_r), "commit kept counts")
    trim_r = trim_l = EMPTY
    if step.trim is not None:
        r, k = _pair(step.trim, "trim", "new_len")
        trim_r = _rows(r, n, "trim")
        trim_l = as_positions(k, len(trim_r), "trim lengths")
    if not isinstance(step.evict_all, (bool, np.bool_)):
        raise ContractError(f"evict_all must be a bool, got {step.evict_all!r}")
    if isinstance(step.evict, (bool, np.bool_)):
        raise ContractError("evict takes rows; for every live request pass evict_all=True "
                            "(evict=0 would mean row 0)")
    evict = _rows(step.evict, n, "evict")
    adv_r = adv_p = EMPTY
    if step.advance is not None:
        r, k = _pair(step.advance, "advance", "new_frontier_pos")
        adv_r = _rows(r, n, "advance")
        adv_p = as_positions(k, len(adv_r), "advance positions")
    drop = _handles(step.drop, "drop_handle")
    drop_swa = _handles(step.drop_swa, "drop_handle_swa")
    admit = _rows(step.admit, n, "admit")
    on_r = on_h = on_n = EMPTY
    if step.admit_on is not None:
        r, h, k = _pair(step.admit_on, "admit_on", "(rows, handles, n_tokens)", 3)
        on_r = _rows(r, n, "admit(handle=)")
        on_h = _handles(h, "admit(handle=)")
        if len(on_h) != len(on_r):
            raise ContractError(f"admit_on: {len(on_h)} handles for {len(on_r)} rows")
        on_n = (np.full(len(on_r), -1, dtype=np.int64) if k is None
                else as_positions(k, len(on_r), "admit n_tokens"))
        if (on_n < -1).any():
            raise PositionError(f"admit n_tokens must be >= 0 (or None: all of the handle), "
                                f"got {int(on_n.min())}")
    decode = _rows(step.decode, n, "decode")
    look_k = step.lookahead
    if type(look_k) is int and len(decode) and -1 <= look_k <= 64:  # one k for every row
        spec, dec_n = filled(int(look_k >= 0), len(decode)), filled(1 + max(look_k, 0),
                                                                       len(decode))
    elif step.lookahead is not None:
        if not len(decode):
            raise SpeculativeStateError("lookahead= applies to decode rows; none were given")
        look = as_positions(step.lookahead, len(decode), "lookahead")
        if (look < -1).any():
            raise PositionError(f"lookahead must be >= 0 (-1: a plain decode row), got "
                                f"{int(look.min())}")
        spec = (look >= 0).astype(np.int64)
        dec_n = 1 + np.maximum(look, 0)
    elif len(decode):
        dec_n, spec = filled(1, len(decode)), filled(0, len(decode))
    else:
        dec_n = spec = EMPTY
    ext_r = ext_n = EMPTY
    if step.extend is not None:
        r, k = _pair(step.extend, "extend", "n_tokens")
        ext_r = _rows(r, n, "extend")
        ext_n = as_counts(k, len(ext_r), "extend token counts")
    load_r = load_p = EMPTY
    if step.load_back is not None:
        r, k = _pair(step.load_back, "load_back", "new_frontier_pos")
        load_r = _rows(r, n, "load_back")
        load_p = as_positions(k, len(load_r), "load_back frontier")
    return StepArrays(take_h, take_r, take_n, release, com_r, com_n, trim_r, trim_l, evict,
                      int(bool(step.evict_all)), adv_r, adv_p, drop, drop_swa, admit, on_r,
                      on_h, on_n, decode, dec_n, spec, ext_r, ext_n, load_r, load_p)
