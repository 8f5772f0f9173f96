"""A step's life on the host: normalise, plan, write the descriptor, submit -- or take it back.

:class:`StepPipeline` is the allocator's one path from a :class:`~graphalloc.plan.step.Step`
to a submitted step. Lifecycle of one step, as facts about state::

    plan(step)        the Step is normalised (typed input errors, nothing changed), the next
                      descriptor buffer acquired (waits only when the device is that many
                      steps behind), the planner pair plans it into that buffer, updating the
                      ledger in place through its journal. A refusal rolls the journal back
                      and raises the documented typed error: nothing changed. Otherwise the
                      step is *pending*: its writes stay journaled.
    run(p)            the executor enqueues the device work, then submit(p). If the launch
                      raises, the step is cancelled first and LaunchError raised from it.
    submit(p)         (mark_submitted: an engine replayed its own graph) the buffer's event
                      is recorded, the journal forgotten: the step is final. A step with
                      rows is counted for ``check()``: its kernels must have counted its
                      stamp on the device (:mod:`graphalloc.device.stamps`).
    cancel(p)         a pending step is taken back: the journal rolled back, the buffer
                      returned; the allocator is exactly as before plan().

One step is pending at a time. A dry run (``fits()``, the queries) plans into a scratch
buffer and always rolls back. When an allocation is short and the allocator owns a prefix
cache, the step is planned once more with the cache's offer of entries to drop
(:meth:`~graphalloc.sharing.prefix_cache.PrefixCache.offer`), inside the same step.

Every planned step gets a stamp (a plan serial) written beside its buffer; a step that is
submitted without its kernels having run shows at the next ``check()``.

Cost: normalising O(rows), planning O(rows + pages) (the compiled twin: microseconds), one
descriptor write and one stamp write, one event record at submit; nothing here reads the
device.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..device.stamps import SubmissionLedger
from ..errors import ContractError, LaunchError, PendingStepError
from ..kernels.abi import REL_EPOCH, REL_N_PAGES, ROW_WIDTH, ST_N_COPY, ST_N_TABLE
from .context import PlanContext
from .reference import PlanOutcome, plan_step
from .refusals import Refusal, RefusalCode, to_error
from .results import AllocResult, PlannedStep
from .step import Step, StepArrays, normalize

__all__ = ["StepPipeline"]

# Refusals a prefix cache can lift by dropping entries (their pages, their state snapshots).
_CACHE_CAN_HELP = (RefusalCode.PAGES_SHORT, RefusalCode.STATE_SLOTS_SHORT)


class StepPipeline:
    """Plans, submits and cancels the steps of one allocator (see the module docstring).

    Holds no state of its own beyond the pending step and two counters: ``steps_run``
    (submitted steps) and ``output_epoch`` (submitted steps that wrote output lanes; an
    :class:`AllocResult` is stale once it moves past the result's step)."""

    def __init__(self, alloc, compiled=None):
        self._alloc = weakref.ref(alloc)  # the allocator holds its pipeline: no cycle
        self._state = alloc.state
        self.config, self.ledger, self.ring = alloc.config, alloc.ledger, alloc.ring
        self.compiled = compiled
        self.tables_spec = None if alloc.tables is None else alloc.tables.spec
        self.pending: PlannedStep | None = None
        self.steps_run = 0
        self.output_epoch = 0
        self.n_planned = 0
        self._mark = (0, 0)
        self.submissions = SubmissionLedger(self.ring)
        self._stamp = 0  # the pending step's stamp
        cfg = self.config
        self._scratch = np.zeros((cfg.max_release_rows + cfg.max_alloc_rows, ROW_WIDTH),
                                 dtype=np.int64)

    @property
    def alloc(self):
        return self._alloc()

    # ---- planning -----------------------------------------------------------------------
    def refuse_planning(self) -> None:
        alloc = self.alloc
        if self.pending is not None:
            raise PendingStepError("the previous planned step was neither run() nor "
                                   "cancel()led: run it (or mark_submitted after your replay), "
                                   "or cancel it")
        if alloc.faulted:
            raise PendingStepError("a device fault was reported by check(); the allocator "
                                   "refuses steps until reset_faults() (or rebuild it)")
        if not alloc.executor.plans_locally:
            raise ContractError(f"this allocator's executor ({alloc.executor.name}) only "
                                "replays steps planned elsewhere; call the replica layer "
                                "instead")

    def outcome(self, step: Step | StepArrays, *, dry_run: bool = False, oversize: bool = False,
                index: int | None = None, use_group: bool = True) -> PlanOutcome:
        """Plan ``step`` (journaled; rolled back at once when ``dry_run``). Raises the typed
        error of a refusal with nothing changed. ``use_group``: rows released and handles
        dropped in an open free group are refused (their frees run when it closes).
        ``index``: the descriptor buffer to write (``None``: nothing is written). The
        compiled twin plans unless it is absent or ``oversize`` (a split free: numpy)."""
        arrays = step if isinstance(step, StepArrays) else normalize(step, self.config)
        journal = self.ledger.journal
        mark = self.mark()  # (compiled twin: its undo log's position too)
        group = self.alloc.group if use_group else None
        excluded = (None, None) if group is None else (group.released, group.dropped)
        cache = self.alloc.prefix_cache
        compiled = None if oversize else self.compiled
        reclaim, offered = None, 0
        while True:
            try:
                if compiled is not None:  # writes every section of the descriptor itself
                    # (release, allocation, lanes, states; index None: its scratch buffer)
                    out = compiled.plan(arrays, self.steps_run + 1, None if dry_run else index,
                                        *excluded, reclaim)
                else:
                    ctx = PlanContext(self.config, self.ledger, self.steps_run + 1, *excluded,
                                      reclaim=reclaim, oversize=oversize,
                                      tables=self.tables_spec)
                    out = plan_step(ctx, arrays)
            except Refusal as refusal:
                journal.rollback(mark[0])  # (the compiled twin rolled its own writes back)
                if (refusal.code in _CACHE_CAN_HELP and cache is not None
                        and cache.n_unlocked > offered):
                    offered = max(64, 2 * offered)  # the cache's entries, a few at a time
                    reclaim = cache.offer(offered)
                    continue
                raise to_error(refusal) from None
            except BaseException:
                self.rollback(mark)
                raise
            break
        if dry_run:
            self.rollback(mark)
        elif index is not None and compiled is None:  # numpy: the outcome's rows copied in
            self.ring.write(index, out.release_rows, out.alloc_rows, fusable=out.fusable)
            if out.lanes is not None:
                self.ring.write_lanes(index, out.lanes.rows)
            if out.state_rows is not None:
                self.ring.write_states(index, out.state_rows)
            if out.windows:  # a model's further window pools' sections
                self.ring.write_windows(index, out.windows)
        return out

    def mark(self) -> tuple[int, int]:
        """Positions in both planners' logs (the journal's, the compiled twin's)."""
        compiled = self.compiled
        return self.ledger.journal.mark(), 0 if compiled is None else compiled.mark()

    def rollback(self, mark: tuple[int, int]) -> None:
        """Undo every planning write after ``mark`` (both planners' logs)."""
        self.ledger.journal.rollback(mark[0])
        if self.compiled is not None:
            self.compiled.rollback(mark[1])

    def commit(self) -> None:
        """Make every planning write final (both planners' logs)."""
        self.ledger.journal.commit()
        if self.compiled is not None:
            self.compiled.commit()

    def plan(self, step: Step | StepArrays) -> PlannedStep:
        """Plan ``step`` into the next descriptor buffer; it becomes the pending step."""
        self.refuse_planning()
        self._mark = self.mark()
        index = self.ring.acquire()
        out = self.outcome(step, index=index)
        self.n_planned += 1
        self._stamp = self.submissions.stamp(index, bool(len(out.release_rows)
                                                         or len(out.alloc_rows)))
        return self._pending(index, out)

    def _pending(self, index: int, out: PlanOutcome) -> PlannedStep:
        state = self._state
        result = AllocResult(out.result_rows, out.result_first_lane, out.result_n_tokens,
                             state.out_full_buf, state.out_swa_buf, out.n_tokens,
                             self.output_epoch + (out.n_tokens > 0), self._alloc)
        self.pending = PlannedStep(
            index, len(out.release_rows), len(out.alloc_rows), out.n_tokens, out.pages_freed,
            out.pages_allocated, result, out.fusable, out.pages_evicted, owner_ref=self._alloc,
            reclaimed=out.reclaimed,
            tables=None if out.lanes is None else self._tables(index, out.lanes),
            state_counts=(counts := _state_counts(out.state_rows)),
            state_copies=_state_copies(out.state_rows, counts))
        return self.pending

    def _tables(self, index: int, lanes):
        """The step's PlannedTables; the compiled twin wrote the host copies already
        (compiled twin: not copied twice)."""
        tables = self.alloc.tables
        if getattr(lanes, "host_written", False):
            return tables.planned(index, lanes.n_lanes, lanes.n_full_pages, lanes.n_swa_pages)
        return tables.write_host(index, lanes)

    def plan_rows(self, release_rows: np.ndarray, whole: PlanOutcome,
                  first: bool, windows: tuple = ()) -> PlannedStep:
        """A step of release rows planned already (a part of the split free ``whole``;
        ``first``: its first part): written as they are into the next buffer (with this
        step's epoch); the ledger already holds their effect (journaled). The first part
        carries the whole free's state rows (slot-table writes); every part writes its lane
        and state sections, so nothing a buffer held before runs again. ``windows``: this
        part's release rows of each further window pool (their epochs set like the main
        rows')."""
        self.refuse_planning()
        self._mark = self.mark()
        index = self.ring.acquire()
        empty = np.zeros((0, ROW_WIDTH), dtype=np.int64)
        release_rows[:, REL_EPOCH] = self.steps_run + 1
        self.ring.write(index, release_rows, empty, fusable=True)
        if whole.lanes is not None:
            self.ring.write_lanes(index, whole.lanes.rows)
        states = whole.state_rows
        if states is not None:
            states = states if first else np.zeros((1, ROW_WIDTH), dtype=np.int64)
            self.ring.write_states(index, states)
        if windows:
            for part in windows:
                part[:, REL_EPOCH] = self.steps_run + 1
            self.ring.write_windows(index, [(part, empty) for part in windows])
        self._stamp = self.submissions.stamp(index, bool(len(release_rows)))
        pages = int(release_rows[:, REL_N_PAGES].sum())
        out = PlanOutcome(release_rows, empty, 0, (pages, 0), (0, 0), 0, True, empty[:, 0],
                          empty[:, 0], empty[:, 0], [], state_rows=states)
        return self._pending(index, out)

    # ---- the device half ----------------------------------------------------------------
    def check_planned(self, planned, what: str) -> None:
        if not isinstance(planned, PlannedStep):
            raise PendingStepError(f"{what}() takes the PlannedStep returned by plan(), got "
                                   f"{type(planned).__name__}")
        if planned.owner is not self.alloc:
            raise PendingStepError(f"{what}(): that PlannedStep belongs to another allocator")
        if planned.submitted:
            raise PendingStepError(f"{what}(): this step was already submitted (a second "
                                   "mark_submitted would count it twice)")
        if planned.cancelled:
            raise PendingStepError(f"{what}(): this step was cancelled; plan it again")
        if planned is not self.pending:
            raise PendingStepError(f"{what}() takes the step returned by the latest plan()")

    def run(self, planned: PlannedStep) -> AllocResult:
        self.check_planned(planned, "run")
        try:
            self.alloc.executor.execute(planned)
        except BaseException as exc:
            self.cancel(planned)
            raise LaunchError(f"launching the planned step raised {type(exc).__name__}: "
                              f"{exc}; the step was cancelled and the allocator is as before "
                              "it was planned") from exc
        self.submit(planned, launched=bool(planned.n_release_rows or planned.n_alloc_rows
                                           or planned.state_counts),
                    stamped=self.alloc.executor.stamps_steps)
        return planned.result

    def mark_submitted(self, planned: PlannedStep) -> None:
        """An engine replayed its own graph over ``planned``'s buffer: submit it."""
        self.check_planned(planned, "mark_submitted")
        self.submit(planned)

    def submit(self, planned: PlannedStep, launched: bool = True, stamped: bool = True) -> None:
        """The step is enqueued (``launched=False``: it had no device work and nothing read
        its buffer, so the buffer is not fenced and is used again next; ``stamped=False``:
        its executor launches kernels that count no stamp, so ``check()`` expects none)."""
        if launched:
            self.ring.submitted(planned.buffer_index)
        self.commit()
        planned.submitted = True
        self.pending = None
        self.steps_run += 1
        if stamped and (planned.n_release_rows or planned.n_alloc_rows):
            self.submissions.submitted(self.steps_run, self._stamp, planned.buffer_index)
        if planned.n_tokens:
            self.output_epoch += 1
        cache = self.alloc.prefix_cache
        if cache is not None and planned.reclaimed:
            cache.on_reclaimed(planned.reclaimed)

    def cancel(self, planned: PlannedStep) -> None:
        self.check_planned(planned, "cancel")
        self.rollback(self._mark)
        planned.cancelled = True
        self.pending = None


def _state_copies(rows, counts):
    """``[n_copy, 2]`` (source, destination) slots of a state section, owned by the receipt
    (the compiled twin's rows are a view of a descriptor buffer the ring plans again)."""
    if counts is None:
        return None
    copies = rows[1:1 + counts[0], 1:3]
    return copies.copy() if counts[0] else copies


def _state_counts(rows) -> tuple[int, int] | None:
    """``(n_copy, n_table)`` from a state section's header; None for no state rows."""
    if rows is None or len(rows) < 2:
        return None
    return int(rows[0, ST_N_COPY]), int(rows[0, ST_N_TABLE])
