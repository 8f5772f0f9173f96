"""One scheduler iteration as one step: record ordinary calls in a block, run them at its end.

::

    with alloc.scheduler_step() as it:
        it.release(finished_rows)             # frees, in call order ...
        it.commit(spec_rows, n_accepted)      # (speculative decoding; it.trim(rows, lens))
        it.evict(decoding_rows)               # (window rule; it.evict_all(), it.advance(...))
        it.drop_handle(h)                     # (it.drop_handle_swa(h))
        r = it.admit(handle=cached)           # ... admits (rows reserved at the call) ...
        d = it.decode(decoding_rows)          # ... allocations, in call order
        e = it.extend([r], [chunk])
    kv_full, kv_swa = d.full_slots, d.swa_slots   # valid once the step ran

At the block's end everything recorded is planned by the planner as ONE step (one launch or
one graph replay) in this order: the frees in call order, then the admits, then the
allocations in call order (lane order of the outputs: the allocation calls in call order,
each call's rows as given). The step is refused whole -- nothing changes, no row stays
admitted -- if any part breaks a rule; an exception inside the block runs nothing. The
results (:class:`StepSlots`) refuse access before the step ran and after a later step
overwrote the outputs (``StaleResultError``).

Cost: recording is O(1) per call (the arguments are kept); the step at the end costs what
:meth:`HybridAllocator.step` with the same work costs. A block in ``step()``'s own form --
each kind of free at most once and in step()'s order (release, commit, trim, evict or
evict_all, advance), plain admits in pool mode that no free names, at most one decode then
at most one extend, none of them empty -- IS run as one ``alloc.step(...)`` (its admits
made in place first, undone if the step is refused), so the compiled planner plans it
where it covers the step (:func:`step_form`); any other block is planned call by call.
Both give the same state and slots (tested).
"""

from __future__ import annotations

import numpy as np

from .errors import CapacityError, NestedGroupError, PendingStepError
from .inputs import as_counts, is_empty

__all__ = ["StepContext", "StepSlots"]


class StepSlots:
    """The slots one allocation call of a :class:`StepContext` got (its rows' lanes)."""

    def __init__(self, ctx: StepContext, index: int):
        self._ctx, self._index = ctx, index

    def _part(self):
        ctx = self._ctx
        if ctx.result is None:
            raise PendingStepError("the step of this scheduler_step() block has not run yet: "
                                   "read its slots after the block")
        return ctx.result, ctx.parts[self._index]

    @property
    def rows(self) -> np.ndarray:
        result, (a, b) = self._part()
        return result.rows[a:b]

    @property
    def n_tokens(self) -> np.ndarray:
        result, (a, b) = self._part()
        return result.n_tokens[a:b]

    @property
    def full_slots(self):
        """The call's new tokens' full slots, rows in the order given (a device view)."""
        result, (a, b) = self._part()
        lo = int(result.first_lane[a]) if b > a else 0
        hi = int(result.first_lane[b - 1] + result.n_tokens[b - 1]) if b > a else 0
        return result.full_slots[lo:hi]

    @property
    def swa_slots(self):
        """The call's new tokens' SWA slots (a device view)."""
        result, (a, b) = self._part()
        lo = int(result.first_lane[a]) if b > a else 0
        hi = int(result.first_lane[b - 1] + result.n_tokens[b - 1]) if b > a else 0
        return result.swa_slots[lo:hi]


class StepContext:
    """The calls of one ``alloc.scheduler_step()`` block (see the module docstring)."""

    def __init__(self, alloc):
        self.alloc = alloc
        self.frees: list = []
        self.free_calls: list = []  # (kind, args) of each free, in call order
        self.admits: list = []  # (row, handle, n_tokens)
        self.allocs: list = []  # ("decode", rows) | ("extend", rows, n)
        self.result = None
        self.parts: list = []  # per allocation call: its [a, b) in the result's rows

    # ---- frees -------------------------------------------------------------------------
    def release(self, rows) -> None:
        self.frees.append(lambda b, rows=rows: b.release(b.live_rows(rows, "release")))
        self.free_calls.append(("release", rows))

    def evict(self, rows) -> None:
        self.frees.append(lambda b, rows=rows: b.evict(b.live_rows(rows, "evict")))
        self.free_calls.append(("evict", rows))

    def evict_all(self) -> None:
        self.frees.append(lambda b: b.evict(np.flatnonzero(b.ledger.live)))
        self.free_calls.append(("evict_all", None))

    def advance(self, rows, new_frontier_pos) -> None:
        self.frees.append(lambda b, rows=rows, pos=new_frontier_pos: b.advance_frontier(
            b.live_rows(rows, "advance"), pos, "advance"))
        self.free_calls.append(("advance", (rows, new_frontier_pos)))

    def commit(self, rows, n_accepted) -> None:
        """Speculative decoding: resolve each row's oldest speculative step (a free)."""
        self.frees.append(lambda b, rows=rows, n=n_accepted: b.commit(
            b.live_rows(rows, "commit"), n))
        self.free_calls.append(("commit", (rows, n_accepted)))

    def trim(self, rows, new_len) -> None:
        """Cut requests back to ``new_len`` tokens (a free)."""
        self.frees.append(lambda b, rows=rows, n=new_len: b.trim(b.live_rows(rows, "trim"), n))
        self.free_calls.append(("trim", (rows, new_len)))

    def drop_handle(self, handle) -> None:
        self.frees.append(lambda b, h=handle: b.drop_handle(h))
        self.free_calls.append(("drop_handle", handle))

    def drop_handle_swa(self, handle) -> None:
        self.frees.append(lambda b, h=handle: b.drop_handle(h, swa_only=True))
        self.free_calls.append(("drop_handle", handle))

    # ---- admits and allocations ----------------------------------------------------------
    def admit(self, handle=None, n_tokens=None) -> int:
        """Reserve the lowest free row (the step admits it); returns it."""
        led = self.alloc.ledger
        taken = led.live.copy()
        taken[[row for row, _, _ in self.admits]] = True
        free = np.flatnonzero(~taken)
        if len(free) == 0:
            raise CapacityError(f"all {self.alloc.config.max_reqs} request rows are in use or "
                                "reserved in this block")
        row = int(free[0])
        self.admits.append((row, handle, n_tokens))
        return row

    def decode(self, rows, lookahead=None) -> StepSlots:
        """One token per row; ``lookahead=k``: ``1 + k`` speculative tokens per row."""
        self.allocs.append(("decode", rows, lookahead))
        return StepSlots(self, len(self.allocs) - 1)

    def extend(self, rows, n_tokens) -> StepSlots:
        self.allocs.append(("extend", rows, n_tokens))
        return StepSlots(self, len(self.allocs) - 1)

    # ---- the step ------------------------------------------------------------------------
    def plan_into(self, b, results: list) -> None:
        """Apply every recorded call to the planner ``b`` (frees, admits, allocations)."""
        for free in self.frees:
            free(b)
        for row, handle, n_tokens in self.admits:
            if handle is None:
                b.admit(row)
            else:
                b.admit_on_handle(row, handle, n_tokens)
        start = 0
        for kind, rows, n in self.allocs:
            what = "alloc_decode" if kind == "decode" else "alloc_extend"
            arr = b.live_rows(rows, what) if not is_empty(rows) else np.zeros(0, np.int64)
            speculative = kind == "decode" and n is not None
            if kind == "decode":
                n = np.ones(len(arr), dtype=np.int64) if n is None else 1 + as_counts(
                    n, len(arr), "lookahead")
            else:
                n = as_counts(n, len(arr), f"{what} token counts")
            results.append((arr, b.extend(arr, n, what, speculative), n))
            self.parts.append((start, start + len(arr)))
            start += len(arr)


_STEP_ORDER = {"release": 0, "commit": 1, "trim": 2, "evict": 3, "evict_all": 3, "advance": 4}


def _host_rows(rows):
    """``rows`` as a flat int array when that is plain host data, else ``None``."""
    try:
        arr = np.asarray(rows)
    except Exception:  # a CUDA tensor, an odd object: the planner path reports it
        return None
    return arr.ravel() if arr.dtype.kind in "iu" else None


def step_form(ctx: StepContext):
    """The block as ONE ``alloc.step(...)`` call, when that is exactly the same step: each
    free kind at most once and in step()'s order, plain admits (pool mode) that no free
    names, at most one decode then at most one extend, none empty. ``None`` otherwise
    (the block is planned call by call). Cost: O(rows)."""
    alloc = ctx.alloc
    if ctx.admits and (alloc.config.ring_mode or any(h is not None for _, h, _ in ctx.admits)):
        return None
    order = [_STEP_ORDER.get(kind, -1) for kind, _ in ctx.free_calls]
    if -1 in order or any(b <= a for a, b in zip(order, order[1:], strict=False)):
        return None
    kinds = [kind for kind, _, _ in ctx.allocs]
    if kinds not in ([], ["decode"], ["extend"], ["decode", "extend"]):
        return None
    reserved = np.array([row for row, _, _ in ctx.admits], dtype=np.int64)
    if len(reserved) and alloc.ledger.live[reserved].any():
        return None
    args: dict = {}
    for kind, value in ctx.free_calls:
        rows = None if kind == "evict_all" else value if kind in ("release", "evict") \
            else value[0]
        if rows is not None:
            arr = _host_rows(rows)
            if arr is None or (len(reserved) and np.isin(arr, reserved).any()):
                return None
        args["evict_all" if kind == "evict_all" else kind] = True if kind == "evict_all" \
            else value
    sizes = []
    for kind, rows, n in ctx.allocs:
        arr = _host_rows(rows)
        if arr is None or len(arr) == 0:
            return None
        sizes.append(len(arr))
        if kind == "decode":
            args["decode"], args["lookahead"] = rows, n
        else:
            args["extend"] = (rows, n)
    return args, sizes


def run_context(alloc, ctx: StepContext) -> None:
    """The block's end: one planned step (refused whole with nothing changed)."""
    if alloc._group is not None:
        raise NestedGroupError("scheduler_step() inside free_group(): the block is one step of "
                               "its own; close the free group first")
    form = step_form(ctx)
    if form is not None:  # one alloc.step(...): the compiled planner's path where it covers it
        args, sizes = form
        led = alloc.ledger
        rows = np.array([row for row, _, _ in ctx.admits], dtype=np.int64)
        saved = [(name, getattr(led, name)[rows].copy()) for name in led.ROW_ARRAYS]
        led.reset_rows(rows, live=True)  # the block's admits, in place (undone on refusal)
        try:
            result = alloc.step(**args)
        except BaseException:
            for name, old in saved:
                getattr(alloc.ledger, name)[rows] = old
            raise
        start = 0
        for n in sizes:
            ctx.parts.append((start, start + n))
            start += n
        ctx.result = result
        return
    results: list = []
    planned = alloc._plan(lambda b: ctx.plan_into(b, results), results)
    ctx.result = alloc.run(planned)
