"""The public allocator: host planning + device state + an executor, one step at a time.

Example::

    cfg = AllocatorConfig(page_size=16, num_full_pages=1024, num_swa_pages=256,
                          max_reqs=64, max_context_len=4096, sliding_window=512,
                          device="cuda", backend="triton")
    alloc = HybridAllocator(cfg, executor="graph")  # every step is one graph replay
    r = alloc.admit()
    out = alloc.alloc_extend([r], [100])       # prefill: out.full_slots, out.swa_slots
    for _ in range(steps):                      # each iteration is ONE replay
        out = alloc.step(evict_all=True, decode=[r])
    alloc.release([r])
    alloc.check()                               # where the engine synchronises anyway

Every operation is planned on the host by the planner (numpy, never captured; the
one validator) and executed as one step by the executor the allocator was built
with. Nothing on the fast path reads the device back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from .backend import StepKernels
from .config import AllocatorConfig
from .descriptor import DescriptorRing
from .device_state import DeviceState
from .errors import (
    BatchTooLargeError,
    CapacityError,
    ConfigError,
    ContractError,
    NestedGroupError,
    PendingStepError,
    RingOverflowError,
)
from .executor import make_executor
from .fast_plan import FastPlanner  # the compiled planner (fast path of step() / plan())
from .free_group import FreeGroup, GroupedFrees
from .handles import HandleInfo, HandleOps
from .inputs import as_index
from .inspection import Inspection
from .ledger import Ledger
from .planner import StepBuilder
from .prefix_cache import PrefixCache
from .queries import HostQueries
from .results import AllocResult, PlannedStep
from .single_ops import SingleOps
from .step_arguments import StepArguments
from .step_context import StepContext, run_context

__all__ = ["HybridAllocator", "AllocResult", "PlannedStep", "HandleInfo"]

_SHORTAGE = (CapacityError, BatchTooLargeError, RingOverflowError)


class HybridAllocator(SingleOps, StepArguments, GroupedFrees, HandleOps, HostQueries,
                      Inspection):
    """Paged KV-cache allocator for hybrid full-attention + sliding-window models.

    Owns: the host :class:`~graphalloc.ledger.Ledger` (lengths, frontiers, free-ring
    positions), the :class:`~graphalloc.device_state.DeviceState` tables, a ring of
    pinned step descriptors and its executor.

    Invariants: page 0 of each pool is never handed out; a request's frontier is
    page-aligned and only moves forward (``load_back`` is the one backward move); per
    pool, free + owned == pages; ``full_to_swa`` is page-dense. Each public operation
    validates all its inputs first and raises a :class:`~graphalloc.errors.ContractError`
    with nothing changed, host or device.

    Args:
        config: the geometry and frozen step shape (:class:`AllocatorConfig`).
        executor: how steps reach the device: ``"eager"`` (kernel launches, the default),
            ``"graph"`` (one CUDA graph replay per step, :class:`graphalloc.StepGraph`), or
            an :class:`graphalloc.executor.Executor`. Chosen once, here.
        n_descriptor_bufs: pinned descriptor buffers in the ring (>= 1; 2 lets the host plan
            step k+1 while the GPU runs step k).
        fused_step: a step whose pops fit in what each free ring held before it runs as ONE
            kernel (measured about 2.6 us less per replay on an H200); otherwise release,
            then allocation.
        prefix_cache: own a :class:`~graphalloc.prefix_cache.PrefixCache` (``alloc.prefix_cache``)
            on the handles; an allocation that would be refused for lack of pages first
            reclaims cached pages (SWA by tombstoning, then FULL by evicting), in the same step.
        planner: ``"auto"`` (the compiled planner when it was built, else numpy),
            ``"compiled"`` (refused with ``ConfigError`` when it was not built) or ``"numpy"``:
            who plans the hot steps of ``step()`` / ``plan()``; same results either way
            (:mod:`graphalloc.fast_plan`).

    Cost: each operation is O(rows) numpy on the host plus one step (one or two kernel
    launches, or one graph replay); the host queries (``n_free``, ``seq_len``, ...) are
    O(1); no host/device synchronisation except ``check()``, ``snapshot()``,
    ``state_dict()`` and the integrity checks, which read the device on purpose.

    Protocol for the layers above (checkpointing, graphs, replicas use this, not
    privates): ``ledger`` (the host state, read-only outside a step), ``state``, ``ring``,
    ``kernels``, ``executor``, ``pending`` (the planned step not yet submitted),
    ``faulted``, :meth:`install_ledger` and :meth:`launch`.
    """

    def __init__(self, config: AllocatorConfig, *, executor="eager",
                 n_descriptor_bufs: int = 2, fused_step: bool = True,
                 prefix_cache: bool = False, planner: str = "auto"):
        if not isinstance(config, AllocatorConfig):
            raise ConfigError(f"HybridAllocator takes an AllocatorConfig, got "
                              f"{type(config).__name__}")
        if isinstance(n_descriptor_bufs, bool) or not isinstance(n_descriptor_bufs, int) or (
                n_descriptor_bufs < 1):
            raise ConfigError(f"n_descriptor_bufs must be an int >= 1, got {n_descriptor_bufs!r}")
        if not isinstance(fused_step, bool):
            raise ConfigError(f"fused_step must be a bool, got {fused_step!r}")
        if not isinstance(prefix_cache, bool):
            raise ConfigError(f"prefix_cache must be a bool, got {prefix_cache!r}")
        if prefix_cache and (config.ring_mode or config.max_handles == 0):
            raise ConfigError("prefix_cache=True needs pool mode and max_handles > 0 (each "
                              "cache entry is a handle)")
        self.config = config
        self.ledger = Ledger(config)
        self.state = DeviceState(config)
        self.ring = DescriptorRing(config.max_release_rows, config.max_alloc_rows, config.device,
                                   n_bufs=n_descriptor_bufs)
        self.kernels = StepKernels(config, self.state, fused=fused_step)
        self._pending: PlannedStep | None = None
        self._group: FreeGroup | None = None  # the open free_group() block, if any
        self._faulted = False
        self.steps_run = 0
        self.prefix_cache = PrefixCache(self) if prefix_cache else None
        # ---- compiled planner (graphalloc.fast_plan): None plans every step in numpy ----
        self._fast = FastPlanner.for_allocator(self, planner)
        self.executor = make_executor(executor)
        self.executor.bind(self)

    # ---- protocol for the layers above ---------------------------------------------------
    @property
    def pending(self) -> PlannedStep | None:
        """The planned step not yet submitted (``None`` when there is none)."""
        return self._pending

    @property
    def faulted(self) -> bool:
        """True after ``check()`` reported a device fault, until ``reset_faults()``."""
        return self._faulted

    def install_ledger(self, ledger: Ledger, *, steps_run: int | None = None) -> None:
        """Replace the host ledger (a checkpoint load, a broadcast follower catching up).
        The caller guarantees the device tables match it. Refused while a step is pending
        or a free group is open."""
        if self._pending is not None or self._group is not None:
            raise PendingStepError("install_ledger() while a step is planned or a "
                                   "free_group() is open")
        self.ledger = ledger
        if steps_run is not None:
            self.steps_run = int(steps_run)

    # ---- views ---------------------------------------------------------------------------
    @property
    def req_to_token(self) -> torch.Tensor:
        """``[max_reqs, max_context_len]``: full slot of each (request, position)."""
        return self.state.req_to_token

    @property
    def full_to_swa(self) -> torch.Tensor:
        """``[(num_full_pages + 1) * page_size]``: SWA slot of each full slot, 0 = none."""
        return self.state.full_to_swa

    # ---- request lifecycle ---------------------------------------------------------------
    def admit(self, handle=None, n_tokens=None) -> int:
        """Take the lowest free request row; returns it.

        ``handle`` (optional, from :meth:`take_handle`): the request starts sharing the
        handle's pages -- length n (the handle's tokens), frontier the handle's SWA start --
        and holds references to them; its ``req_to_token`` prefix is written on the device
        inside the step (one step, no host gather, no sync). ``n_tokens`` (whole pages, at
        most the handle's): share only that much of it. Without a handle, admit is host-only
        in pool mode; in ring mode the request's R ring pages are popped (one step).
        """
        cfg = self.config
        taken = self.ledger.live if self._group is None else self.ledger.live | self._group.pending
        free_rows = np.flatnonzero(~taken)
        if handle is None and not cfg.ring_mode:  # nothing for the device to do: O(1) host
            self._refuse_planning()
            if len(free_rows) == 0:
                raise CapacityError(f"all {cfg.max_reqs} request rows are in use; release one "
                                    "first")
            row = int(free_rows[0])
            self.ledger.reset_rows(row, live=True)  # in place: an empty request
            if self._group is not None:
                self._group.sync_rows(np.array([row], dtype=np.int64))
            return row

        def op(b):
            if len(free_rows) == 0:
                raise CapacityError(f"all {cfg.max_reqs} request rows are in use; release "
                                    "one first")
            if handle is None:
                b.admit(int(free_rows[0]))
            else:
                b.admit_on_handle(int(free_rows[0]), handle, n_tokens)
        self._run(op)
        return int(free_rows[0])

    # ---- one scheduler step --------------------------------------------------------------
    def step(self, *, release=None, commit=None, trim=None, evict=None,
             evict_all: bool = False, advance=None, decode=None, lookahead=None,
             extend=None) -> AllocResult | None:
        """One scheduler step as one launch (or one graph replay).

        In this order: ``release`` (rows of finished requests), ``commit`` (``(rows,
        n_accepted)``: speculative decoding's accepted counts, resolving each row's oldest
        speculative step), ``trim`` (``(rows, new_len)``: cut requests back), ``evict``
        (rows) or ``evict_all=True`` (every live request): window-rule frontier advance on
        the committed length, ``advance`` (``(rows, new_frontier_pos)``: explicit
        page-aligned frontier moves, the engine's own SWA segment frees), then allocation:
        ``decode`` (rows, one token each; with ``lookahead=k``, an int or one per decode row,
        ``1 + k`` speculative tokens each, the verify tokens) and ``extend`` (``(rows,
        n_tokens)``). Pages freed by the step may be allocated by it. Returns the allocated
        slots (``None`` when nothing was allocated); lanes: decode rows in the order given
        (``1 + k`` lanes each), then extend rows.

        Speculative decoding (C committed, L allocated): a lookahead decode allocates
        ``[L, L + 1 + k)`` as one speculative step; ``commit`` with n accepted of a step of
        s keeps ``C + n`` plus the next step still in flight (at most two: overlap
        scheduling), freeing the pages wholly past it; ``trim`` is the general cut. The
        window follows C only. Cost: O(rows) numpy per argument, one launch or replay.
        """
        # ---- compiled planner fast path (graphalloc.fast_plan): None -> the numpy planner ----
        if self._fast is not None and self._group is None:
            planned = self._fast.plan(self, release, evict, evict_all, advance, decode, extend,
                                      commit, trim, lookahead)
            if planned is not None:
                return self.run(planned)
        # ---- end of the fast path ----
        args = (release, commit, trim, evict, evict_all, advance, decode, lookahead, extend)
        if self._group is not None:
            self._refuse_frees_in_group(*args)
        results: list = []
        return self.run(self._plan(lambda b: self._apply_step(b, *args, results), results))

    @contextlib.contextmanager
    def scheduler_step(self) -> Iterator[StepContext]:
        """Record one scheduler iteration -- releases, evictions, frontier moves, handle
        drops, admits, prefill chunks, decodes -- as ordinary calls on the yielded
        :class:`~graphalloc.step_context.StepContext`, and run them as ONE step at the
        block's end (frees, then admits, then allocations; refused whole with nothing
        changed). An exception inside the block runs nothing. See
        :mod:`graphalloc.step_context`."""
        ctx = StepContext(self)
        yield ctx
        run_context(self, ctx)

    def try_step(self, **step_args) -> AllocResult | None:
        """:meth:`step`, but a step that cannot be met for lack of pages returns ``None``
        (nothing changed) instead of raising :class:`CapacityError` -- the scheduler's
        back-pressure signal, as vLLM's ``allocate_slots`` returns ``None``. Every other
        contract error still raises."""
        try:
            return self.step(**step_args)
        except CapacityError:
            return None

    def fits(self, *, release=None, commit=None, trim=None, evict=None,
             evict_all: bool = False, advance=None, decode=None, lookahead=None,
             extend=None) -> bool:
        """Whether :meth:`step` with these arguments would run (dry run on a ledger copy;
        nothing changes). ``False`` for shortage (pages, ring space, frozen step shape);
        other contract errors (an unknown row, ...) raise. Cost: one plan, no device work."""
        args = (release, commit, trim, evict, evict_all, advance, decode, lookahead, extend)
        b = self._builder()
        refs = b.ledger.refs
        mark = refs.mark() if refs is not None else 0
        try:
            self._apply_step(b, *args, [])
            b.finish()
        except _SHORTAGE:
            return False
        finally:
            if refs is not None:
                refs.rollback(mark)  # a dry run: nothing stays
        return True

    def plan(self, *, release=None, commit=None, trim=None, evict=None,
             evict_all: bool = False, advance=None, decode=None, lookahead=None,
             extend=None) -> PlannedStep:
        """Host half of :meth:`step`: validate, update the ledger, write the next descriptor
        buffer. Pure host work, never captured, never synchronises (except to wait for a
        descriptor buffer the GPU has not consumed, counted in ``ring.stalls``). Must be
        followed by :meth:`run` (or the engine's replay and :meth:`mark_submitted`).
        Refused inside a ``free_group()`` block (steps there run at once: use ``step()``)."""
        if self._group is not None:
            raise NestedGroupError("plan() inside free_group(): the block defers frees to its "
                                   "end, a separately planned step could not keep that order; "
                                   "use step() (it runs at once) or plan after the block")
        # ---- compiled planner fast path (graphalloc.fast_plan): None -> the numpy planner ----
        if self._fast is not None:
            planned = self._fast.plan(self, release, evict, evict_all, advance, decode, extend,
                                      commit, trim, lookahead)
            if planned is not None:
                return planned
        # ---- end of the fast path ----
        args = (release, commit, trim, evict, evict_all, advance, decode, lookahead, extend)
        results: list = []
        return self._plan(lambda b: self._apply_step(b, *args, results), results)

    def run(self, planned: PlannedStep) -> AllocResult | None:
        """Device half of :meth:`step`: launch (or replay) the planned step. Never
        synchronises; returns before the device has finished. Host cost: the executor's
        launch (one graph replay) and one event record."""
        self._check_planned(planned, "run")
        self.executor.execute(planned)
        # mark_submitted(planned), without checking the same step a second time
        self.ring.submitted(planned.buffer_index)
        planned.submitted = True
        self._pending = None
        self.steps_run += 1
        return planned.result

    def launch(self, buffer_index: int, fusable: bool = False, n_rows=None) -> None:
        """Enqueue the step kernels reading descriptor buffer ``buffer_index``.

        Capture-safe: call it inside an engine's own graph capture, one captured graph per
        descriptor buffer (``len(alloc.ring)`` of them). Outside a capture it launches the
        pending planned step only (``buffer_index`` must be its buffer). ``fusable=True``
        (only for steps whose ``PlannedStep.fusable`` is set) makes it one fused launch when
        the allocator was built with ``fused_step=True``; see ``StepKernels``.

        ``n_rows``: the rows launched, ``(n_release_rows, n_alloc_rows)`` or a
        :class:`~graphalloc.buckets.StepGrid` (with programs per row); None launches every
        row inside a capture and exactly the pending step's rows outside one. Rows past a
        step's are padding, so a launch of R release and A allocation rows leaves the same
        state as the full grid for any step with ``p.fits_rows(R, A)``, for programs in
        proportion to R + A: an engine that captures one graph per batch size captures
        ``launch(i, n_rows=(R, A))`` sized to it and replays it only for steps that fit
        (``alloc.kernels.grids.bucket(...)`` gives the allocator's own buckets). Outside a
        capture a step that does not fit is refused (``BatchTooLargeError``)."""
        from .buckets import StepGrid

        index = as_index(buffer_index, "buffer_index", len(self.ring))
        if not isinstance(fusable, bool):
            raise ContractError(f"fusable must be a bool, got {fusable!r}")
        grid = None
        if n_rows is not None:
            cfg = self.config
            if isinstance(n_rows, StepGrid):
                grid = n_rows
            elif isinstance(n_rows, (tuple, list)) and len(n_rows) == 2:
                grid = StepGrid(n_rows[0], 1, n_rows[1], 1)
            else:
                raise ContractError(f"n_rows takes (n_release_rows, n_alloc_rows) or a "
                                    f"StepGrid, got {n_rows!r}")
            for value, top in zip(grid, (cfg.max_release_rows, None, cfg.max_alloc_rows, None),
                                  strict=True):
                if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
                        value < (0 if top is not None else 1)) or (
                        top is not None and value > top):
                    raise ContractError(
                        f"launch(n_rows={n_rows!r}): row counts must be ints in [0, "
                        f"max_release_rows={cfg.max_release_rows}] and [0, max_alloc_rows="
                        f"{cfg.max_alloc_rows}], chunks ints >= 1")
            grid = StepGrid(*(int(v) for v in grid))
        capturing = self.config.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        if not capturing:
            pending = self._pending
            if pending is None or pending.buffer_index != index:
                raise PendingStepError(
                    f"launch({index}) outside a graph capture runs only the pending planned "
                    f"step's buffer ({'none pending' if pending is None else pending.buffer_index})"
                    "; plan() first, and launch the buffer its PlannedStep names")
            if fusable and not pending.fusable:
                raise ContractError("launch(fusable=True) for a step the planner did not mark "
                                    "fusable: its pops may read this step's pushes")
            if grid is None:
                grid = self.kernels.grids.exact(pending.n_release_rows, pending.n_alloc_rows,
                                                pending.n_tokens)
            elif not pending.fits_rows(grid.n_release_rows, grid.n_alloc_rows):
                raise BatchTooLargeError(
                    f"launch(n_rows={n_rows!r}): the pending step has {pending.n_release_rows} "
                    f"release and {pending.n_alloc_rows} allocation rows; launch at least "
                    "that many (the step's PlannedStep.fits_rows tells which captured launch "
                    "fits)")
            if grid.n_programs == 0:
                return  # a step with no rows: nothing to run
        self.kernels(self.ring.release_rows(index), self.ring.alloc_rows(index), fusable=fusable,
                     grid=grid)

    def mark_submitted(self, planned: PlannedStep) -> None:
        """Tell the allocator the planned step was enqueued (engines that replay their own
        graph call this right after the replay, on the stream of the replay): records the
        event that guards the step's descriptor buffer. Once per planned step."""
        self._check_planned(planned, "mark_submitted")
        self.ring.submitted(planned.buffer_index)
        planned.submitted = True
        self._pending = None
        self.steps_run += 1

    # ---- internals -----------------------------------------------------------------------
    def _refuse_planning(self) -> None:
        if self._pending is not None:
            raise PendingStepError("the previous planned step was never run(); run it first")
        if self._faulted:
            raise PendingStepError("a device fault was reported by check(); the allocator "
                                   "refuses steps until reset_faults() (or rebuild it)")
        if not self.executor.plans_locally:
            raise ContractError(f"this allocator's executor ({self.executor.name}) only replays "
                                "steps planned elsewhere; call the replica layer instead")

    def _builder(self) -> StepBuilder:
        b = StepBuilder(self.config, self.ledger.copy(), epoch=self.steps_run + 1)
        group = self._group
        if group is not None:  # see what the open block decided (the page mirror already does)
            g, rows = group.builder.ledger, np.flatnonzero(group.touched)
            b.ledger.frontier[rows] = g.frontier[rows]
            handles = np.flatnonzero(group.touched_handles)
            for name in g.HANDLE_ARRAYS:
                getattr(b.ledger, name)[handles] = getattr(g, name)[handles]
            b.pending = group.pending
            b.pending_handles = group.pending_handles
        if self.prefix_cache is not None:
            b.reclaim = self.prefix_cache.reclaim
        return b

    def _commit(self, b: StepBuilder) -> None:
        touched = np.flatnonzero(b.allocated | (b.ledger.live != self.ledger.live))
        self.ledger = b.ledger
        if self._group is not None and len(touched):
            self._group.sync_rows(touched)

    def _plan(self, apply, results: list) -> PlannedStep:
        self._refuse_planning()
        b = self._builder()
        refs = b.ledger.refs
        mark = refs.mark() if refs is not None else 0
        try:
            apply(b)  # raises with nothing committed (the shared page mirror rolled back)
            release, alloc = b.finish()
        except Exception:
            if refs is not None:
                refs.rollback(mark)
            raise
        if refs is not None:
            refs.release_mark(mark)
        index = self.ring.acquire()
        self.ring.write(index, release, alloc, fusable=b.fusable)
        self._commit(b)
        result = None
        if results:
            rows = np.concatenate([r[0] for r in results])
            first = np.concatenate([r[1] for r in results])
            n_tok = np.concatenate([r[2] for r in results])
            result = AllocResult(rows, first, n_tok, self.state.out_full_buf,
                                 self.state.out_swa_buf, b.n_tokens, self.steps_run + 1, self)
        self._pending = PlannedStep(index, len(release), len(alloc), b.n_tokens,
                                    b.pages_freed, b.pages_allocated, result, b.fusable,
                                    b.pages_evicted, owner=self)
        return self._pending

    def _run(self, apply) -> AllocResult | None:
        return self.run(self._plan(apply, []))

    def _check_planned(self, planned, what: str) -> None:
        if not isinstance(planned, PlannedStep):
            raise PendingStepError(f"{what}() takes the PlannedStep returned by plan(), got "
                                   f"{type(planned).__name__}")
        if planned.owner is not self:
            raise PendingStepError(f"{what}(): that PlannedStep belongs to another allocator")
        if planned.submitted:
            raise PendingStepError(f"{what}(): this step was already submitted (a second "
                                   "mark_submitted would count it twice)")
        if planned is not self._pending:
            raise PendingStepError(f"{what}() takes the step returned by the latest plan()")
