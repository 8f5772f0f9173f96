"""The public allocator: a ledger, a planner pipeline, device tables and an executor, composed.

Example::

    cfg = AllocatorConfig(page_size=16, num_full_pages=1024, num_swa_pages=256, max_reqs=64,
                          max_context_len=4096, model_window=512, device="cuda",
                          backend="triton")
    alloc = HybridAllocator(cfg, executor="graph")   # every step is one graph replay
    r = alloc.admit()
    out = alloc.alloc_extend([r], [100])              # prefill: out.full_slots, out.swa_slots
    for _ in range(steps):                             # each iteration is ONE step
        out = alloc.step(evict_all=True, decode=[r])
    alloc.release([r])
    alloc.check()                                      # where the engine synchronises anyway

Every operation is one :class:`~graphalloc.plan.step.Step` (the single operations are
one-line Steps; ``step()`` takes a Step or its keywords; ``scheduler_step()`` and
``free_group()`` record Steps), planned on the host by the planner pair and run by the
executor chosen at construction (:mod:`graphalloc.plan.pipeline`: plan, run, submit,
cancel). A refused step raises a typed error with nothing changed; a launch that raises
leaves the allocator as before the plan. Nothing on the per-step path reads the device.

Invariants: page 0 of each pool is never handed out; a request's frontier is page-aligned
and only moves forward (``load_back`` is the one backward move); per pool, free + held ==
pages; ``full_to_swa`` is page-dense; a slot of a page more than one holder references is
never written. Cost: each operation is one plan (O(rows + pages) host work) and at most
one launch or graph replay; the queries are O(1) unless stated; ``check()``, ``audit()``,
``snapshot()``, ``state_dict()`` read the device on purpose.

Parts, wired once here (:mod:`graphalloc.parts`): ``config``, ``ledger`` (host state,
read-only outside a step), ``state`` (device tables), ``ring`` (descriptor buffers),
``kernels``, ``tables``, bundled as ``parts`` (:class:`~graphalloc.parts.DeviceParts`) for
the layers below, which get only these, never the allocator: the ``pipeline``
(:class:`~graphalloc.plan.pipeline.StepPipeline`: the parts, the compiled planner, the
``executor``, the prefix cache's index as its reclaim policy), the executor (bound to the
parts), the diagnostics (the parts and the pipeline). Above them, on the front-end floor,
the layers that hold the allocator and call its public operations: ``prefix_cache`` (the
cache's client), ``group`` / ``recorder`` (the open block), the seams, the replicas. The
logic of the operations is in :mod:`graphalloc.operations`; each method here is one line.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

from . import footprint
from . import operations as ops
from .attention.tables import AttentionTables
from .config import AllocatorConfig
from .device.backend import StepKernels
from .device.descriptor import DescriptorRing
from .device.executor import make_executor
from .device.layout import DescriptorLayout
from .device.tables import DeviceState
from .diagnostics import recovery
from .errors import UnknownRequestError
from .kernels.state import check_state_tensors
from .parts import DeviceParts
from .plan.compiled import CompiledPlanner
from .plan.free_group import FreeGroup
from .plan.pipeline import StepPipeline
from .plan.recorder import StepRecorder
from .plan.results import AllocResult, PlannedStep
from .plan.step import Step
from .sharing.prefix_cache import PrefixCache
from .state.ledger import Ledger
from .state.queries import HostQueries

__all__ = ["HybridAllocator", "AllocResult", "PlannedStep", "Step"]


class HybridAllocator:
    """Paged KV-cache allocator for hybrid full-attention + sliding-window models.

    Args:
        config: the geometry and frozen step shape (:class:`AllocatorConfig`).
        executor: ``"eager"`` (kernel launches of the step's rows, the default),
            ``"graph"`` (one CUDA graph replay per step), or an
            :class:`~graphalloc.device.executor.Executor`. Chosen once, here.
        n_descriptor_bufs: pinned descriptor buffers in the ring (2 lets the host plan step
            k+1 while the GPU runs step k).
        fused_step: a step whose pops fit in what each free ring held before it runs as ONE
            kernel (about 2.6 us less per replay on an H200).
        prefix_cache: own a :class:`~graphalloc.sharing.prefix_cache.PrefixCache` on the
            handles (pool mode, ``max_handles > 0``): ``True`` or ``"siphash"`` (page keys
            hashed with SipHash-2-4-128, fast, not cryptographic), ``"blake2b"`` (BLAKE2b,
            for multi-tenant deployments whose users choose tokens; docs/sharing.md).
        planner: ``"auto"`` (the compiled twin when built, else numpy), ``"compiled"`` or
            ``"numpy"``: who plans steps; same results either way.
        page_tables: a :class:`~graphalloc.attention.spec.PageTableSpec`: every step also
            writes the attention page tables of its batch (``alloc.tables``; host copies on
            ``PlannedStep.tables``), in the same replay.
        state_tensors: with ``config.num_state_slots > 0``, the model's recurrent-state
            tensors (each ``[..., num_state_slots + 1, ...]``, slot 0 the sink; a tensor with
            slots on dimension 0 or a ``(tensor, slot_dim)`` pair, contiguous). A snapshot
            taken (``take_handle``) or restored (``admit(handle=)``) copies a slot of each,
            inside the step. Fixed at construction (graphs capture the copies); empty: no
            state is copied (the engine copies itself, from ``PlannedStep.state_copies``).
    """

    def __init__(self, config: AllocatorConfig, *, executor="eager",
                 n_descriptor_bufs: int = 2, fused_step: bool = True,
                 prefix_cache: bool | str = False, planner: str = "auto", page_tables=None,
                 state_tensors=()):
        ops.check_arguments(config, n_descriptor_bufs, fused_step, prefix_cache, page_tables)
        state_tensors = check_state_tensors(state_tensors, config.num_state_slots, config.device,
                                            config.backend)
        layout = DescriptorLayout.of(config, page_tables.max_batch if page_tables else 0)
        footprint.check_fits(config, n_descriptor_bufs, layout)
        self.config = config
        with footprint.building(config):
            self.ledger = Ledger(config)
            self.state = DeviceState(config)
        self.tables = (None if page_tables is None else
                       AttentionTables(page_tables, config, self.state, n_descriptor_bufs))
        self.ring = DescriptorRing(layout, config.device, n_bufs=n_descriptor_bufs)
        self.kernels = StepKernels(config, self.state, fused=fused_step, tables=self.tables,
                                   ring=self.ring, state_tensors=state_tensors)
        self.queries = HostQueries(config, self.ledger)
        self.parts = parts = DeviceParts(config, self.ledger, self.state, self.ring,
                                         self.kernels, self.tables)
        self.group: FreeGroup | None = None  # the open free_group() block
        self.recorder: StepRecorder | None = None  # the open scheduler_step() block
        self.prefix_cache = (PrefixCache(self, ops.key_hash_of(prefix_cache)) if prefix_cache
                             else None)
        executor = make_executor(executor)
        self.pipeline = StepPipeline(parts, executor, CompiledPlanner.for_parts(parts, planner),
                                     None if self.prefix_cache is None
                                     else self.prefix_cache.index)
        executor.bind(parts)

    # ---- state of the parts ----------------------------------------------------------------
    @property
    def executor(self):
        """How a planned step reaches the device (chosen at construction; the pipeline's)."""
        return self.pipeline.executor

    @executor.setter
    def executor(self, executor) -> None:
        # (a benchmark's stand-in, bound with executor.bind(alloc.parts) by the caller)
        self.pipeline.executor = executor

    @property
    def faulted(self) -> bool:
        """A fault was reported by ``check()`` (or a launch's restore failed): steps are
        refused until :meth:`reset_faults` / :meth:`recover`."""
        return self.pipeline.faulted

    @property
    def pending(self) -> PlannedStep | None:
        """The planned step neither submitted nor cancelled (``None`` when there is none)."""
        return self.pipeline.pending

    @property
    def steps_run(self) -> int:
        """Steps submitted so far."""
        return self.pipeline.steps_run

    @property
    def output_epoch(self) -> int:
        """Submitted steps that wrote output lanes (an older result is stale)."""
        return self.pipeline.output_epoch

    @property
    def req_to_token(self) -> torch.Tensor:
        """``[max_reqs, max_context_len]``: the full slot of each (request, position)."""
        return self.state.req_to_token

    @property
    def full_to_swa(self) -> torch.Tensor:
        """``[(num_full_pages + 1) * page_size]``: SWA slot of each full slot, 0 = none."""
        return self.state.full_to_swa

    @property
    def req_to_state(self) -> torch.Tensor:
        """``[max_reqs]``: each request's recurrent-state slot (0: none); with
        ``num_state_slots > 0``. The model reads and updates the state at this slot."""
        return self.state.req_to_state

    @property
    def handle_to_state(self) -> torch.Tensor:
        """``[max_handles]``: each handle's recurrent-state snapshot slot (0: none)."""
        return self.state.handle_to_state

    @property
    def spec_state(self) -> torch.Tensor:
        """``[max_reqs, max_spec_tokens]``: the state slot after each token of a request's
        newest speculative step, ``[r, :1 + k]`` while it is in flight (other entries are
        unspecified: they may name slots freed since); ``accept`` keeps the last kept
        token's as the request's slot."""
        return self.state.spec_state

    @property
    def handle_to_token(self) -> torch.Tensor:
        """``[max_handles, max_context_len]``: the slots each handle holds."""
        return self.state.handle_to_token

    # ---- one step ----------------------------------------------------------------------------
    def step(self, step: Step | None = None, **kinds) -> AllocResult:
        """Plan and run one :class:`Step` (or its keywords; :mod:`graphalloc.plan.step` states
        the kinds and their order). Returns the slots it allocated (an empty result when
        none); refused whole, nothing changed, with the first broken rule's typed error.
        Cost: one plan, one launch or replay; a fixed number of Python calls whatever the
        number of rows (:meth:`~graphalloc.plan.pipeline.StepPipeline.step`; with a block
        open, the blocks' rules first: :func:`graphalloc.operations.step_of`)."""
        pipeline = self.pipeline
        if self.recorder is None and self.group is None:
            return pipeline.step(step, kinds)
        return pipeline.execute(pipeline.plan(ops.step_of(self, step, kinds, "step",
                                                          free_ok=False)))

    def try_step(self, step: Step | None = None, **kinds) -> AllocResult | None:
        """:meth:`step`, but ``None`` (nothing changed) when refused for lack of room (pages,
        slots, ring space, any frozen-shape limit): the scheduler's back-pressure signal."""
        return ops.try_step(self, ops.step_of(self, step, kinds, "try_step", free_ok=False))

    def fits(self, step: Step | None = None, **kinds) -> bool:
        """Whether :meth:`step` would run (a dry run; nothing changes): ``False`` for lack of
        room, other errors raise as :meth:`step` would. Cost: one plan."""
        return ops.fits(self, ops.step_of(self, step, kinds, "fits", free_ok=False,
                                          mutates=False))

    def plan(self, step: Step | None = None, **kinds) -> PlannedStep:
        """Host half of :meth:`step` (validate, update the ledger journaled, write the next
        descriptor buffer); never captured, never syncs. Then :meth:`run`, or a replay and
        :meth:`mark_submitted`, or :meth:`cancel`."""
        return self.pipeline.plan(ops.step_of(self, step, kinds, "plan", free_ok=True,
                                              plan=True))

    def run(self, planned: PlannedStep) -> AllocResult:
        """Device half: launch or replay ``planned``, then submit it; never syncs. A launch
        that raises cancels the step first and raises ``LaunchError`` from the cause."""
        return self.pipeline.run(planned)

    def cancel(self, planned: PlannedStep) -> None:
        """Take back a planned, unsubmitted step: the allocator is as before the plan.
        O(writes of the step)."""
        self.pipeline.cancel(planned)

    def mark_submitted(self, planned: PlannedStep) -> None:
        """After replaying your own graph over ``planned``'s buffer (on its stream): records
        the buffer's event and makes the step final. Once per step."""
        self.pipeline.mark_submitted(planned)

    def launch(self, buffer_index: int, fusable: bool = False, n_rows=None) -> None:
        """Enqueue the step kernels reading descriptor buffer ``buffer_index``; capture-safe
        (see :func:`graphalloc.operations.launch` for ``fusable`` and ``n_rows``)."""
        ops.launch(self, buffer_index, fusable, n_rows)

    def scheduler_step(self) -> StepRecorder:
        """``with alloc.scheduler_step() as it:`` records one scheduler iteration on ``it``;
        it runs as ONE step at the block's end (:mod:`graphalloc.plan.recorder`)."""
        if self.recorder is not None:  # (ops.guard, inline)
            raise ops.recorder_open("scheduler_step")
        return StepRecorder(self)

    @contextlib.contextmanager
    def free_group(self) -> Iterator[None]:
        """Defer the block's frees to one step at its end (:mod:`graphalloc.plan.free_group`)."""
        with ops.grouping(self):
            yield

    def dry_run(self, step: Step, *, use_group: bool = True, oversize: bool = False):
        """Plan ``step`` and roll it back: its :class:`~graphalloc.plan.reference.PlanOutcome`
        (or the typed error :meth:`step` would raise; ``oversize``: not refused for the frozen
        release shape, as a free is not). Cost: one plan."""
        return ops.dry_run(self, step, use_group, oversize)

    def free_row(self, reserved=()) -> int:
        """The lowest free row (not live, not released in an open free group, not in
        ``reserved``); ``CapacityError`` when there is none. O(max_reqs)."""
        return ops.free_row(self, reserved)

    # ---- single operations: one Step each ------------------------------------------------
    def admit(self, handle=None, n_tokens=None) -> int:
        """Take the lowest free row (optionally sharing ``handle``'s first ``n_tokens``);
        returns it. One step (no device work in pool mode without a handle)."""
        return ops.admit(self, handle, n_tokens)

    def alloc_extend(self, rows, extend_lens) -> AllocResult:
        """Prefill: ``extend_lens[i]`` positions for ``rows[i]`` (``Step(extend=)``)."""
        return self.step(extend=(rows, extend_lens))

    def alloc_decode(self, rows, lookahead=None) -> AllocResult:
        """One token per row, or ``1 + k`` speculative (``Step(decode=, lookahead=)``)."""
        ops.given(rows, "alloc_decode", UnknownRequestError)
        return self.step(decode=rows, lookahead=lookahead)

    def accept(self, rows, n_accepted) -> None:
        """Keep ``1 + n_accepted`` tokens of each row's oldest speculative step: the verified
        token and the ``n_accepted`` draft tokens the verifier accepted (vLLM's count;
        ``Step(accept=)``)."""
        ops.no_group(self, "accept")
        self.step(accept=(rows, n_accepted))

    def commit(self, rows, n_kept) -> None:
        """Deprecated (warns): keep ``n_kept`` tokens, the verified one included; use
        :meth:`accept` with ``n_kept - 1``."""
        ops.no_group(self, "commit")
        self.step(commit=(rows, n_kept))

    def trim(self, rows, new_len) -> None:
        """Cut requests to ``new_len`` (``Step(trim=)``; refused below f + W and inside a
        shared page)."""
        ops.no_group(self, "trim")
        self.step(trim=(rows, new_len))

    def release(self, rows) -> None:
        """Free everything the requests hold and return their rows (deferred in a group)."""
        ops.free(self, "release", rows)

    def evict_window(self, rows=None) -> None:
        """Advance frontiers by the window rule (``None``: every live request)."""
        ops.free(self, "evict", rows)

    def advance_frontier(self, rows, new_frontier_pos) -> None:
        """Move frontiers forward to page-aligned positions, freeing SWA pages below."""
        ops.free(self, "advance", (rows, new_frontier_pos))

    def load_back(self, row, new_frontier_pos) -> torch.Tensor:
        """Re-pair ``[new_frontier_pos, frontier)`` with fresh SWA pages; returns their SWA
        slots (copy the KV in before the next step). One step, one allocation row: more
        than ``max_tokens_per_alloc_row`` positions is refused (``BatchTooLargeError``);
        load back in parts, moving the frontier back a few pages per call."""
        return ops.load_back(self, row, new_frontier_pos)

    def take_handle(self, row, n_tokens) -> int:
        """A handle on the first ``n_tokens`` (whole pages) of ``row``; returns it. One step
        (the prefix copied on the device). O(n / page_size)."""
        return ops.take_handle(self, row, n_tokens)

    def drop_handle(self, handle) -> None:
        """Drop every reference ``handle`` (one id) holds (deferred in a free group)."""
        ops.free(self, "drop", handle)

    def drop_handle_swa(self, handle) -> None:
        """Drop only ``handle``'s SWA references: a tombstone (deferred in a group)."""
        ops.free(self, "drop_swa", handle)

    # ---- queries (host only) -----------------------------------------------------------------
    def n_free(self, pool: str = "full") -> int:
        """Free pages of ``pool`` (``"full"`` or ``"swa"``), or free recurrent-state slots
        (``"state"``). O(1)."""
        return self.queries.n_free(pool)

    @property
    def n_live(self) -> int:
        """Live request rows. O(max_reqs)."""
        return self.queries.n_live()

    def live_rows(self) -> np.ndarray:
        """The live request rows, ascending (a new array). O(max_reqs)."""
        return self.queries.live_rows()

    def is_live(self, row) -> bool:
        """Whether ``row`` is live. O(1)."""
        return self.queries.is_live(row)

    def seq_len(self, row) -> int:
        """Allocated length L of ``row``. O(1)."""
        return self.queries.seq_len(row)

    def frontier(self, row) -> int:
        """SWA frontier (page-aligned position) of ``row``. O(1)."""
        return self.queries.frontier(row)

    def committed_len(self, row) -> int:
        """Committed length C of ``row``. O(1)."""
        return self.queries.committed_len(row)

    def spec_len(self, row) -> int:
        """Speculative tail ``L - C`` of ``row``. O(1)."""
        return self.queries.spec_len(row)

    def seq_lens(self) -> np.ndarray:
        """Every row's L (a copy). O(max_reqs)."""
        return self.ledger.seq_len.copy()

    def frontiers(self) -> np.ndarray:
        """Every row's frontier (a copy). O(max_reqs)."""
        return self.ledger.frontier.copy()

    def committed_lens(self) -> np.ndarray:
        """Every row's C (a copy). O(max_reqs)."""
        return self.ledger.committed.copy()

    def pages_needed(self, rows, n_tokens) -> int:
        """New pages per pool that extending ``rows`` by ``n_tokens`` needs. O(rows)."""
        return self.queries.pages_needed(rows, n_tokens)

    def pages_released(self, rows=(), *, advance=None, handles=()) -> tuple[int, int]:
        """``(FULL, SWA)`` pages these frees together would give back, sharing counted: a dry
        run of the planner's own frees (the one rule site). Cost: one plan."""
        return ops.pages_released(self, rows, advance, handles)

    def live_handles(self) -> np.ndarray:
        """Handles held (a new array). O(max_handles)."""
        return self.queries.live_handles()

    def handle_info(self, handle):
        """:class:`~graphalloc.state.queries.HandleInfo`: what ``handle`` holds, what dropping
        it frees (in an open free group: adds to the block's). Cost: one dry run."""
        return ops.handle_info(self, handle)

    # ---- diagnostics: the sanctioned sync points ---------------------------------------------
    def check(self, sync: bool = False) -> None:
        """Raise ``DeviceFaultError`` if a kernel recorded a fault, or ``SubmissionError`` if
        a submitted step never ran on the device (a ``mark_submitted`` without a replay) or
        a step ran unsubmitted. Waits for the submitted steps and reads the error word and
        the step count (one 80-byte read): call it where the engine synchronises anyway."""
        recovery.check(self.parts, self.pipeline, sync)

    def reset_faults(self) -> None:
        """Clear a fault reported by ``check()`` -- only while ``audit()`` is clean; else
        nothing changes and ``IntegrityError`` points to :meth:`recover`. Reads the device."""
        ops.idle(self, "reset_faults")
        recovery.reset_faults(self.parts, self.pipeline)

    def recover(self) -> None:
        """After ``DeviceFaultError`` / ``SubmissionError``: every device table written again
        from the host ledger, the fault cleared, then audited (``IntegrityError`` when not
        clean). Synchronises; O(tables) (:mod:`graphalloc.diagnostics.recovery`)."""
        ops.idle(self, "recover")
        recovery.recover(self.parts, self.pipeline)

    def stats(self) -> dict:
        """Host-side counts for humans (no device read)."""
        return ops.stats(self)

    def snapshot(self) -> dict:
        """A full copy of host and device state (reads the device)."""
        return ops.snapshot(self)

    def audit(self) -> list:
        """Every discrepancy between device tables and host ledger (reads the device); empty
        when healthy, at any point (inside open blocks too)."""
        return ops.audit(self)

    def check_integrity(self) -> None:
        """Raise ``IntegrityError`` on any broken invariant (reads the device)."""
        ops.check_integrity(self)

    def state_dict(self) -> dict:
        """Host ledger + device tables on the CPU (reads the device)."""
        return ops.state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Validate ``sd`` and copy it in place; ``StateError`` (state kept) when it fails."""
        ops.load_state_dict(self, sd)
