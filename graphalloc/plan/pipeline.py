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
                      raises (at any of its kernels), the step is undone: the journal rolled
                      back, every device table it may have written written again from the
                      ledger behind it (graphalloc.device.restore), LaunchError raised.
    run_split(step)   a free past the frozen release shape: planned once, launched in parts,
                      one transaction (committed after the last part, undone whole).
    submit(p)         (mark_submitted: an engine replayed its own graph) the buffer's event
                      is recorded, the journal forgotten: the step is final. A step with
                      rows is counted for ``check()``: its kernels must have counted its
                      stamp on the device (:mod:`graphalloc.device.stamps`).
    cancel(p)         a pending step is taken back: the journal rolled back, the buffer
                      returned; the allocator is exactly as before plan().

One step is pending at a time. A dry run (``fits()``, the queries) plans into a scratch
buffer and always rolls back. When an allocation is short and the pipeline was given a
reclaim policy (:class:`~graphalloc.parts.ReclaimPolicy`: the prefix cache's index), the
step is planned once more with the policy's offer of entries to drop
(:meth:`~graphalloc.sharing.cache_index.CacheIndex.offer`), inside the same step.

Parts (wired once by the allocator, :mod:`graphalloc.parts`): the
:class:`~graphalloc.parts.DeviceParts` (ledger, ring, device tables, kernels, attention
tables), the compiled planner, the executor, the reclaim policy; ``masks`` is the open
free group (:class:`~graphalloc.parts.GroupMasks`: its ``released`` rows and ``dropped``
handles, read at each plan), set by the block while it is open.
The pipeline never holds the allocator: the general path of :meth:`StepPipeline.step` and
the blocks' rules stay above it.

Every planned step gets a stamp (a plan serial) written beside its buffer; a step that is
submitted without its kernels having run shows at the next ``check()``.

Cost: normalising O(rows), planning O(rows + pages) (the compiled twin: microseconds), one
descriptor write and one stamp write, one event record at submit; nothing here reads the
device.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..device.restore import save_held_destinations, undo_launch
from ..device.stamps import SubmissionLedger
from ..errors import ContractError, LaunchError, PendingStepError
from ..kernels.abi import REL_EPOCH, REL_N_PAGES, ROW_WIDTH, ST_N_COPY, ST_N_TABLE
from ..parts import DeviceParts, ExecutorPart, GroupMasks, PlannerPart, ReclaimPolicy
from .context import PlanContext
from .reference import PlanOutcome, plan_step
from .refusals import Refusal, RefusalCode, to_error
from .results import AllocResult, PlannedStep
from .step import Step, StepArrays, normalize, normalize_fast, step_from

__all__ = ["StepPipeline"]

# Refusals a prefix cache can lift by dropping entries (their pages, their state snapshots).
_CACHE_CAN_HELP = (RefusalCode.PAGES_SHORT, RefusalCode.STATE_SLOTS_SHORT)


class StepPipeline:
    """Plans, submits and cancels the steps of one allocator (see the module docstring).

    Holds no state of its own beyond the pending step and two counters: ``steps_run``
    (submitted steps) and ``output_epoch`` (submitted steps that wrote output lanes; an
    :class:`AllocResult` is stale once it moves past the result's step)."""

    def __init__(self, parts: DeviceParts, executor: ExecutorPart,
                 compiled: PlannerPart | None = None, reclaim: ReclaimPolicy | None = None):
        self.parts = parts
        self.state = self._state = parts.state
        self.config, self.ledger, self.ring = parts.config, parts.ledger, parts.ring
        self.kernels, self.tables = parts.kernels, parts.tables
        self.executor = executor  # (ExecutorPart) bound to the same parts by the allocator
        self.compiled = compiled  # (PlannerPart) None: the numpy reference plans
        self.reclaim = reclaim  # (ReclaimPolicy) consulted on a shortage; None: no cache
        self.masks: GroupMasks | None = None  # the open free group's masks, while open
        self.faulted = False  # a fault reported by check(), until reset_faults() / recover()
        self.tables_spec = None if parts.tables is None else parts.tables.spec
        self._n_reqs = self.config.max_reqs
        self._self = weakref.ref(self)  # results and receipts name their pipeline weakly
        self.pending: PlannedStep | None = None
        self.steps_run = 0
        self.output_epoch = 0
        self.n_planned = 0
        self._mark = (0, 0)
        self.submissions = SubmissionLedger(self.ring)
        self._stamp = 0  # the pending step's stamp
        self._state_ring = (0, 0)  # the state free ring's (head, n_free) before the plan

    # ---- planning -----------------------------------------------------------------------
    def refuse_planning(self) -> None:
        if self.pending is not None:
            raise PendingStepError("the previous planned step was neither run() nor "
                                   "cancel()led: run it (or mark_submitted after your replay), "
                                   "or cancel it")
        if self.faulted:
            raise PendingStepError("a device fault was reported by check(); the allocator "
                                   "refuses steps until recover() (or reset_faults(), "
                                   "which needs audit() clean)")
        if not self.executor.plans_locally:
            raise ContractError(f"this allocator's executor ({self.executor.name}) only "
                                "replays steps planned elsewhere; call the replica layer "
                                "instead")

    def outcome(self, step: Step | StepArrays, *, dry_run: bool = False, oversize: bool = False,
                index: int | None = None, use_group: bool = True, mark=None) -> PlanOutcome:
        """Plan ``step`` (journaled; rolled back at once when ``dry_run``). Raises the typed
        error of a refusal with nothing changed. ``use_group``: rows released and handles
        dropped in an open free group are refused (their frees run when it closes).
        ``index``: the descriptor buffer to write (``None``: nothing is written). The
        compiled twin plans unless it is absent or ``oversize`` (a split free: numpy).
        ``mark``: both logs' positions now, when the caller took them already."""
        arrays = step if isinstance(step, StepArrays) else normalize(step, self.config)
        journal = self.ledger.journal
        if mark is None:
            mark = self.mark()  # (compiled twin: its undo log's position too)
        masks = self.masks if use_group else None
        excluded = (None, None) if masks is None else (masks.released, masks.dropped)
        cache = self.reclaim
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

    # ---- the front door: alloc.step ------------------------------------------------------
    def step(self, step: Step | None, kinds: dict) -> AllocResult:
        """``alloc.step(step)`` or ``alloc.step(**kinds)``: plan and run one step. The plain
        forms are converted in C (:data:`~graphalloc.plan.step.normalize_fast`) straight from
        the keywords, when no block is open; everything else takes the general path
        (:func:`~graphalloc.plan.step.step_from`: a Step's checks). Called with no block
        open: while one is, the allocator applies the blocks' rules first
        (:func:`graphalloc.operations.step_of`) and calls :meth:`plan` and :meth:`execute`.
        Cost: a fixed number of Python calls, whatever the number of rows (the benchmark
        ``bench_host_step.py`` counts them), plus the planner's work."""
        arrays = None
        if normalize_fast is not None:
            arrays = normalize_fast(kinds if step is None else None if kinds else step,
                                    self._n_reqs)
        if arrays is None:
            arrays = step_from(step, kinds, "step")
        return self.execute(self.plan(arrays))

    def plan(self, step: Step | StepArrays) -> PlannedStep:
        """Plan ``step`` into the next descriptor buffer; it becomes the pending step."""
        if self.pending is not None or self.faulted or not self.executor.plans_locally:
            self.refuse_planning()  # raises
        compiled = self.compiled
        self._mark = mark = (self.ledger.journal.mark(),
                             0 if compiled is None else compiled.mark())
        states = self.ledger.states  # (head, n_free) of the state slots' free ring, for
        self._state_ring = (states.head, states.n_free)  # a copy into a slot the step frees
        index = self.ring.acquire()
        out = self.outcome(step, index=index, mark=mark)
        self.n_planned += 1
        self._stamp = self.submissions.stamp(index, bool(len(out.release_rows)
                                                         or len(out.alloc_rows)))
        return self._pending(index, out)

    def _pending(self, index: int, out: PlanOutcome) -> PlannedStep:
        state, owner = self._state, self._self
        n_tokens, states = out.n_tokens, out.state_rows
        result = AllocResult(out.result_rows, out.result_first_lane, out.result_n_tokens,
                             state.out_full_buf, state.out_swa_buf, n_tokens,
                             self.output_epoch + (n_tokens > 0), owner)
        counts = None if states is None else _state_counts(states)
        self.pending = PlannedStep(
            index, len(out.release_rows), len(out.alloc_rows), n_tokens, out.pages_freed,
            out.pages_allocated, result, out.fusable, out.pages_evicted, owner_ref=owner,
            reclaimed=out.reclaimed,
            tables=None if out.lanes is None else self._tables(index, out.lanes),
            state_counts=counts,
            state_copies=None if counts is None else _state_copies(states, counts))
        return self.pending

    def _tables(self, index: int, lanes):
        """The step's PlannedTables; the compiled twin wrote the host copies already
        (compiled twin: not copied twice)."""
        tables = self.tables
        if getattr(lanes, "host_written", False):
            return tables.planned(index, lanes.n_lanes, lanes.n_full_pages, lanes.n_swa_pages)
        return tables.write_host(index, lanes)

    def _part(self, release_rows: np.ndarray, whole: PlanOutcome, first: bool,
              windows: tuple = ()) -> PlannedStep:
        """A part of the split free ``whole`` (its release rows planned already; ``first``:
        its first part), written as it is into the next buffer with this step's epoch; the
        ledger already holds the whole free's effect (journaled). The first part carries the
        whole free's state rows (slot-table writes); every part writes its lane and state
        sections, so nothing a buffer held before runs again. ``windows``: this part's
        release rows of each further window pool (their epochs set like the main rows')."""
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
        if planned.owner_ref() is not self:
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
        return self.execute(planned)

    def execute(self, planned: PlannedStep) -> AllocResult:
        """:meth:`run` of the step this pipeline just planned (not checked again)."""
        kernels, executor = self.kernels, self.executor
        kernels.released = False
        saved = None
        try:
            if planned.state_copies is not None:  # slots a copy overwrites, held before
                saved = save_held_destinations(self.parts, planned.state_copies,
                                               self._state_ring)
            executor.execute(planned)
        except BaseException as exc:
            self.undo([planned], exc, kernels.released, self._stamp, "the step", saved=saved)
        self.submit(planned, launched=bool(planned.n_release_rows or planned.n_alloc_rows
                                           or planned.state_counts),
                    stamped=executor.stamps_steps)
        return planned.result

    def run_split(self, step: Step | StepArrays) -> None:
        """A free past the frozen release shape, as ONE transaction over consecutive launches:
        planned once past the shape (numpy), its release rows cut into parts
        (:func:`~graphalloc.plan.release_rows.split_release_rows`: absolute push positions, so the
        parts push what one step would), each part launched from its own descriptor buffer
        and submitted (its own stamp and epoch), the ledger's writes kept journaled until the
        last part is submitted. A launch that raises undoes every part: the host rolled back,
        the device tables restored behind the launched parts, their stamps uncounted and
        the step counters as before. Cost: one plan, one launch per part."""
        from .release_rows import split_release_rows

        self.refuse_planning()
        cfg = self.config
        self._mark = self.mark()
        out = self.outcome(step, oversize=True)
        main = out.release_rows[out.release_rows[:, REL_N_PAGES] > 0]  # (no padded row)
        parts = split_release_rows(main, cfg.max_release_rows, cfg.max_step_pages)
        windows = [split_release_rows(rows, cfg.max_release_rows, cfg.max_step_pages)
                   for rows, _ in out.windows]  # (a model's further window pools: part i
        n_parts = max([len(parts)] + [len(w) for w in windows])  # of each runs in launch i)
        padded, none = np.zeros((1, ROW_WIDTH), np.int64), np.zeros((0, ROW_WIDTH), np.int64)
        kernels, executor = self.kernels, self.executor
        counters = (self.steps_run, self.submissions.n_expected,
                    len(self.submissions.unchecked))
        buffers, first_stamp = [], 0
        for i in range(n_parts):
            part = parts[i] if i < len(parts) else padded.copy()
            planned = self._part(part, out, first=i == 0, windows=tuple(
                w[i] if i < len(w) else none for w in windows))
            buffers.append(planned.buffer_index)
            first_stamp = first_stamp or self._stamp
            kernels.released = False
            try:
                executor.execute(planned)
            except BaseException as exc:
                self.steps_run, self.submissions.n_expected = counters[:2]
                while len(self.submissions.unchecked) > counters[2]:
                    self.submissions.unchecked.pop()
                self.undo([planned], exc, kernels.released, first_stamp,
                          f"part {i + 1} of the {n_parts} launches of a free",
                          buffers=buffers)
            self.submit(planned, stamped=executor.stamps_steps, final=i == n_parts - 1)

    def undo(self, planned: list, exc: BaseException, released: bool, first_stamp: int,
             what: str, buffers: list | None = None, saved=None) -> None:
        """A launch raised: take the step back on the host (the journal rolled back to
        before its plan) and on the device (:func:`~graphalloc.device.restore.undo_launch`,
        enqueued behind whatever was launched), fence its buffers, make earlier results
        stale, and raise :class:`LaunchError` saying what is true. If the device tables
        cannot be restored, the allocator refuses steps until ``recover()``."""
        step = planned[-1]
        buffers = buffers or [step.buffer_index]
        self.rollback(self._mark)
        step.cancelled = True
        self.pending = None
        cause = f"{type(exc).__name__}: {exc}"
        try:
            undo_launch(self.parts, buffers, first_stamp, released, saved)
        except BaseException as undo_exc:
            self.faulted = True
            raise LaunchError(
                f"launching {what} raised {cause}; the host ledger was rolled back to before "
                f"the step, but restoring the device tables it may have written raised "
                f"{type(undo_exc).__name__}: {undo_exc}. The device may disagree with the "
                "host: the allocator refuses steps until recover()") from exc
        for index in buffers:  # the launched work reads them: not rewritten before it ran
            self.ring.submitted(index)
        self.output_epoch += 1  # its outputs may have been written: earlier results stale
        step.result.step_index = -1
        raise LaunchError(
            f"launching {what} raised {cause}; nothing of it took effect: the host ledger was "
            "rolled back to before the step and every device table it may have written "
            "(req_to_token, full_to_swa, free rings, ring pages, state table, state slots it "
            "copied into, step count) was "
            "restored from it, on the stream behind the work already launched; the allocator "
            "is as before the step was planned. Its output slots and page tables are not "
            "valid, and results of earlier steps are stale") from exc

    def mark_submitted(self, planned: PlannedStep) -> None:
        """An engine replayed its own graph over ``planned``'s buffer: submit it."""
        self.check_planned(planned, "mark_submitted")
        self.submit(planned)

    def submit(self, planned: PlannedStep, launched: bool = True, stamped: bool = True,
               final: bool = True) -> None:
        """The step is enqueued (``launched=False``: it had no device work and nothing read
        its buffer, so the buffer is not fenced and is used again next; ``stamped=False``:
        its executor launches kernels that count no stamp, so ``check()`` expects none;
        ``final=False``: a part of a split free, its writes stay journaled)."""
        if launched:
            self.ring.submitted(planned.buffer_index)
        if final:
            self.ledger.journal.commit()  # (self.commit(), inline: both logs forgotten)
            if self.compiled is not None:
                self.compiled.commit()
        planned.submitted = True
        self.pending = None
        self.steps_run += 1
        if stamped and (planned.n_release_rows or planned.n_alloc_rows):
            self.submissions.submitted(self.steps_run, self._stamp, planned.buffer_index)
        if planned.n_tokens:
            self.output_epoch += 1
        cache = self.reclaim
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
