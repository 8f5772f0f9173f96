"""The public allocator: host planning + device state + a backend, one step at a time.

Example::

    cfg = AllocatorConfig(page_size=16, num_full_pages=1024, num_swa_pages=256,
                          max_reqs=64, max_context_len=4096, sliding_window=512,
                          device="cuda", backend="triton")
    alloc = HybridAllocator(cfg)
    r = alloc.admit()
    out = alloc.alloc_extend([r], [100])       # prefill: out.full_slots, out.swa_slots
    for _ in range(steps):                      # each iteration is ONE launch (or replay)
        out = alloc.step(evict=True, decode=[r])
    alloc.release([r])
    alloc.check()                               # where the engine synchronises anyway

Every operation is planned on the host (numpy, never captured) and executed as
one step: a release kernel then an allocation kernel, reading a fixed-shape
descriptor. Nothing on the fast path reads the device back. To replay steps
from CUDA graphs, wrap the allocator in :class:`graphalloc.StepGraph`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import torch

from .backend import StepKernels
from .config import AllocatorConfig
from .descriptor import DescriptorRing
from .device_state import DeviceState
from .errors import (
    AlignmentError,
    BatchTooLargeError,
    CapacityError,
    DeviceFaultError,
    NestedGroupError,
    PendingStepError,
    PositionError,
    TensorSpecError,
)
from .free_group import FreeGroup
from .kernels.abi import (
    ERR_CODE,
    ERR_CODES,
    ERR_COUNT,
    ERR_PAGE,
    ERR_REQ,
    ERR_ROW,
    ERR_STAGE,
    STAGE_NAMES,
)
from .ledger import Ledger
from .planner import StepBuilder
from .sync_points import sync_allowed

__all__ = ["HybridAllocator", "AllocResult", "PlannedStep"]


def _given(rows) -> bool:
    """True for a non-empty row list (``None``, ``()``, ``[]`` and empty arrays are 'none')."""
    if rows is None:
        return False
    try:
        return len(rows) > 0
    except TypeError:  # a scalar row (int, numpy int, 0-d array)
        return True


@dataclasses.dataclass
class AllocResult:
    """Slots a step allocated, for the model's KV writes.

    ``full_slots`` / ``swa_slots`` are views of the allocator's static output
    buffers (valid until the next step runs): tokens of ``rows[i]`` are at
    ``[first_lane[i], first_lane[i] + n_tokens[i])``.
    """

    rows: np.ndarray
    first_lane: np.ndarray
    n_tokens: np.ndarray
    out_full_buf: torch.Tensor  # the static output buffers (the views are made on access:
    out_swa_buf: torch.Tensor  # slicing a tensor costs microseconds on the per-step path)
    n_step_tokens: int

    @property
    def full_slots(self) -> torch.Tensor:
        """``[n_step_tokens]`` full slots of this step's new tokens, in lane order."""
        return self.out_full_buf[:self.n_step_tokens]

    @property
    def swa_slots(self) -> torch.Tensor:
        """``[n_step_tokens]`` SWA slots of this step's new tokens, in lane order."""
        return self.out_swa_buf[:self.n_step_tokens]

    def slots_of(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        a, b = int(self.first_lane[i]), int(self.first_lane[i] + self.n_tokens[i])
        return self.full_slots[a:b], self.swa_slots[a:b]


@dataclasses.dataclass
class PlannedStep:
    """A step planned on the host and written into descriptor buffer ``buffer_index``;
    it must be run (``HybridAllocator.run``) before the next step is planned."""

    buffer_index: int
    n_release_rows: int
    n_alloc_rows: int
    n_tokens: int
    pages_freed: dict
    pages_allocated: dict
    result: AllocResult | None = None
    fusable: bool = False  # release and allocation may run as one launch (StepBuilder.fusable)


class HybridAllocator:
    """Paged KV-cache allocator for hybrid full-attention + sliding-window models.

    Owns: the host :class:`~graphalloc.ledger.Ledger` (lengths, frontiers,
    free-ring positions), the :class:`~graphalloc.device_state.DeviceState`
    tables and a ring of pinned step descriptors.

    Invariants: page 0 of each pool is never handed out; a request's frontier
    is page-aligned and only moves forward; per pool, free + owned == pages;
    ``full_to_swa`` is page-dense. Each public operation validates all its
    inputs first and raises a :class:`~graphalloc.errors.ContractError` with
    nothing changed, host or device.

    ``fused_step`` (default on): a step whose pops fit in what each free ring
    held before the step runs as ONE kernel (release and allocation programs
    side by side, no dependency between them); other steps run release, then
    allocation. Measured on an H200 the fused replay saves about 2.6 us median
    per step (``benchmarks/results/h200_fused``); ``fused_step=False`` keeps
    every step at two launches.

    Cost: each operation is O(rows) numpy on the host plus one step (one or two
    kernel launches, or one graph replay); no host/device synchronisation
    except ``check()``, ``stats(device=True)``, ``snapshot()`` and the integrity
    checks, which read the device on purpose.
    """

    def __init__(self, config: AllocatorConfig, *, n_descriptor_bufs: int = 2,
                 fused_step: bool = True):
        self.config = config
        self.ledger = Ledger(config)
        self.state = DeviceState(config)
        self.ring = DescriptorRing(config.max_release_rows, config.max_alloc_rows, config.device,
                                   n_bufs=n_descriptor_bufs)
        self.kernels = StepKernels(config, self.state, fused=fused_step)
        self.step_runner: Callable[[int], None] | None = None  # set by StepGraph
        self._pending: PlannedStep | None = None
        self._group: FreeGroup | None = None  # the open free_group() block, if any
        self._faulted = False
        self.steps_run = 0

    # ---- views -----------------------------------------------------------------------
    @property
    def req_to_token(self) -> torch.Tensor:
        """``[max_reqs, max_context_len]``: full slot of each (request, position)."""
        return self.state.req_to_token

    @property
    def full_to_swa(self) -> torch.Tensor:
        """``[(num_full_pages + 1) * page_size]``: SWA slot of each full slot, 0 = none."""
        return self.state.full_to_swa

    # ---- request lifecycle -------------------------------------------------------------
    def admit(self, prefix_slots: torch.Tensor | None = None) -> int:
        """Take the lowest free request row; returns it.

        ``prefix_slots`` (optional, 1-D, index dtype, on the allocator's device,
        length a multiple of ``page_size``): full slots of a cached prefix the
        request shares but does not own. They are copied into ``req_to_token``
        and are never freed by this request; its frontier starts past them.
        In ring mode the request's R ring pages are popped (one step).
        """
        cfg, led = self.config, self.ledger
        self._refuse_if_faulted()
        n_prefix = 0
        if prefix_slots is not None:
            self._check_tensor(prefix_slots, "prefix_slots")
            n_prefix = prefix_slots.shape[0]
            if n_prefix % cfg.page_size:
                raise AlignmentError(
                    f"prefix of {n_prefix} tokens is not a whole number of pages "
                    f"(page_size {cfg.page_size}); share whole pages only")
            if n_prefix > cfg.max_context_len:
                raise PositionError(f"prefix of {n_prefix} tokens exceeds max_context_len "
                                    f"{cfg.max_context_len}")
        taken = led.live if self._group is None else led.live | self._group.pending
        free_rows = np.flatnonzero(~taken)
        if len(free_rows) == 0:
            raise CapacityError(f"all {cfg.max_reqs} request rows are in use; release one first")
        row = int(free_rows[0])
        if cfg.ring_mode and led.swa.n_free < cfg.swa_ring_pages:
            raise CapacityError(f"ring mode admit needs {cfg.swa_ring_pages} SWA pages, "
                                f"{led.swa.n_free} are free")

        def apply(b: StepBuilder) -> None:
            b.ledger.live[row] = True
            b.ledger.seq_len[row] = n_prefix
            b.ledger.frontier[row] = n_prefix
            b.ledger.protected[row] = n_prefix
            if cfg.ring_mode:
                b.ring_admit(row)

        if cfg.ring_mode:
            self._run_step(apply)  # may refuse (a pending plan): copy the prefix only after
        else:  # nothing for the device to do
            apply(StepBuilder(cfg, self.ledger))
        if n_prefix:
            self.state.req_to_token_buf[row, :n_prefix].copy_(prefix_slots)
        return row

    def alloc_extend(self, rows, extend_lens) -> AllocResult:
        """Prefill / chunked prefill: ``extend_lens[i]`` new positions for ``rows[i]``.

        Exact page estimate: a request at length L needs
        ``ceil((L + n) / ps) - ceil(L / ps)`` new pages in each pool (none from
        the SWA pool in ring mode). Refused whole if either pool is short.
        """
        return self.step(extend=(rows, extend_lens))

    def alloc_decode(self, rows) -> AllocResult:
        """One token for each request: a new page in both pools only where the
        position starts a page."""
        return self.step(decode=rows)

    def evict_window(self, rows=None) -> None:
        """Advance frontiers by the window rule (``rows=None``: every live request)."""
        if self._group is not None:
            self._group.evict(rows)
            return
        self.step(evict=True if rows is None else rows)

    def advance_frontier(self, rows, new_frontier_pos) -> None:
        """Move frontiers to the given page-aligned positions, freeing the SWA pages
        of ``[old, new)`` (the low-level form of :meth:`evict_window`)."""
        if self._group is None:
            self._run_step(lambda b: b.advance_frontier(b.live_rows(rows, "advance_frontier"),
                                                        new_frontier_pos))
            return
        self._group.advance(rows, new_frontier_pos)

    def release(self, rows) -> None:
        """Free everything the requests own (finished or retracted) and return their rows.

        Positions below the frontier free only FULL pages; the rest free both; a
        partial tail page is freed whole; a protected prefix is not freed.
        """
        if self._group is None:
            self.step(release=rows)
            return
        self._group.release(rows)

    @contextlib.contextmanager
    def free_group(self) -> Iterator[None]:
        """Defer every free in the block to one step at its end.

        Inside the block, ``release``, ``evict_window`` and ``advance_frontier``
        are validated at once but executed at exit, in call order, as one step
        that keeps request boundaries (rows of different requests are never
        merged). Capacity is unchanged until then. Allocations inside the block
        run at once and cannot use the deferred pages; a request released in
        the block cannot allocate. Frees accepted before an exception in the
        block are still flushed, so no page is lost. Nesting raises
        :class:`NestedGroupError`.
        """
        if self._group is not None:
            raise NestedGroupError("free_group() blocks cannot be nested; "
                                   "close the outer block first")
        self._group = FreeGroup(self)
        try:
            yield
        finally:
            group, self._group = self._group, None
            self._flush(group.intents)

    # ---- one scheduler step ------------------------------------------------------------
    def step(self, *, release=(), evict=None, advance=None, decode=(),
             extend=None) -> AllocResult:
        """One scheduler step as one launch (or one graph replay).

        In this order: ``release`` (rows of finished requests), ``evict``
        (``True`` for every live request, or rows: window-rule frontier
        advance), ``advance`` (``(rows, new_frontier_pos)``: explicit page-aligned
        frontier moves, the engine's own SWA segment frees), then allocation:
        ``decode`` (rows, one token each) and ``extend`` (``(rows, n_tokens)``).
        Pages freed by the step may be allocated by it.
        """
        self._check_not_in_group_alloc(release, evict)
        if self._group is not None and advance is not None:
            raise NestedGroupError("inside free_group() call advance_frontier() (deferred)")
        return self.run(self.plan(release=release, evict=evict, advance=advance, decode=decode,
                                  extend=extend))

    def plan(self, *, release=(), evict=None, advance=None, decode=(),
             extend=None) -> PlannedStep:
        """Host half of :meth:`step`: validate, update the ledger, write the next descriptor
        buffer. Pure host work, never captured, never synchronises (except to wait for a
        descriptor buffer the GPU has not consumed, counted in ``ring.stalls``).
        Must be followed by :meth:`run` (or the engine's replay and :meth:`mark_submitted`)."""

        def apply(b: StepBuilder) -> None:
            if _given(release):
                b.release(b.live_rows(release, "release"))
            if evict is not None and evict is not False:
                rows = (np.flatnonzero(b.ledger.live) if evict is True
                        else b.live_rows(evict, "evict"))
                b.advance_frontier(rows, b.window_frontier(rows))
            if advance is not None:
                b.advance_frontier(b.live_rows(advance[0], "advance"), advance[1])
            if _given(decode):
                d_rows = self._refuse_group_released(b.live_rows(decode, "alloc_decode"),
                                                  "alloc_decode")
                first = b.extend(d_rows, np.ones(len(d_rows), dtype=np.int64))
                results.append((d_rows, first, np.ones(len(d_rows), dtype=np.int64)))
            if extend is not None:
                e_rows = self._refuse_group_released(b.live_rows(extend[0], "alloc_extend"),
                                                  "alloc_extend")
                n = np.asarray(extend[1], dtype=np.int64).reshape(-1)
                first = b.extend(e_rows, n)
                results.append((e_rows, first, n))

        results: list = []
        return self._plan(apply, results)

    def run(self, planned: PlannedStep) -> AllocResult | None:
        """Device half of :meth:`step`: launch (or replay) the planned step. Never
        synchronises; returns before the device has finished."""
        if planned is not self._pending:
            raise PendingStepError("run() takes the step returned by the latest plan()")
        if self.step_runner is not None:
            self.step_runner(planned.buffer_index)
        else:
            self.launch(planned.buffer_index, fusable=planned.fusable)
        self.mark_submitted(planned)
        return planned.result

    def launch(self, buffer_index: int, fusable: bool = False) -> None:
        """Enqueue the step kernels reading descriptor buffer ``buffer_index``.
        Capture-safe: call it inside an engine's own graph capture, one captured
        graph per descriptor buffer (``len(alloc.ring)`` of them). ``fusable=True``
        (only for steps whose ``PlannedStep.fusable`` is set) makes it one fused launch
        when the allocator was built with ``fused_step=True``; see ``StepKernels``."""
        self.kernels(self.ring.release_rows(buffer_index), self.ring.alloc_rows(buffer_index),
                     fusable=fusable)

    def mark_submitted(self, planned: PlannedStep) -> None:
        """Tell the allocator the planned step was enqueued (engines that replay their own
        graph call this right after the replay)."""
        self.ring.submitted(planned.buffer_index)
        self._pending = None
        self.steps_run += 1

    # ---- faults ------------------------------------------------------------------------
    def check(self, sync: bool = False) -> None:
        """Raise :class:`DeviceFaultError` if a kernel recorded a fault.

        Reads the 8-word device error word: a device-to-host read that waits for
        the steps already queued, so call it where the engine synchronises anyway
        (after reading sampled tokens) and it costs no extra wait. ``sync=True``
        synchronises the whole device first (for faults from other streams).
        """
        with sync_allowed():
            if sync and self.config.device.type == "cuda":
                torch.cuda.synchronize(self.config.device)  # sync ok: requested by the caller
            err = self.state.err_buf.cpu().tolist()  # sync ok: the documented check point
        if err[ERR_CODES]:
            self._faulted = True
            stage = STAGE_NAMES.get(err[ERR_STAGE], "?")
            raise DeviceFaultError(err[ERR_CODES], err[ERR_COUNT], err[ERR_CODE], stage,
                                   err[ERR_ROW], err[ERR_REQ], err[ERR_PAGE])

    def reset_faults(self) -> None:
        """Clear the error word and accept steps again (after the caller repaired or audited)."""
        self.state.err_buf.zero_()
        self._faulted = False

    # ---- introspection -----------------------------------------------------------------
    def stats(self) -> dict:
        """Host-side counts (no device read)."""
        led, cfg = self.ledger, self.config
        live = np.flatnonzero(led.live)
        return {
            "full_free_pages": led.full.n_free,
            "full_used_pages": cfg.num_full_pages - led.full.n_free,
            "swa_free_pages": led.swa.n_free,
            "swa_used_pages": cfg.num_swa_pages - led.swa.n_free,
            "live_requests": len(live),
            "seq_len": {int(r): int(led.seq_len[r]) for r in live},
            "frontier": {int(r): int(led.frontier[r]) for r in live},
            "steps_run": self.steps_run,
            "descriptor_stalls": self.ring.stalls,
        }

    def snapshot(self) -> dict:
        """A full copy of host and device state (reads the device)."""
        from .integrity import snapshot
        return snapshot(self)

    def audit(self) -> list:
        """Every discrepancy between device tables and host ledger (leaked pages, pages
        owned twice, stale mappings, ...) as :class:`~graphalloc.integrity.Finding`s; an
        empty list when healthy. Reads the device: for tests and periodic health checks."""
        from .integrity import audit
        return audit(self)

    def state_dict(self) -> dict:
        """Host ledger + device tables on the CPU (PyTorch convention; reads the device)."""
        from .checkpoint import state_dict
        with sync_allowed():
            return state_dict(self)

    def load_state_dict(self, sd: dict) -> None:
        """Validate ``sd`` (audit of the incoming state) and copy it in place; refuses with
        :class:`~graphalloc.errors.StateError`, keeping the current state, when it fails."""
        from .checkpoint import load_state_dict
        with sync_allowed():
            load_state_dict(self, sd)

    def load_back(self, row: int, new_frontier_pos: int) -> torch.Tensor:
        """Re-pair the full pages of ``[new_frontier_pos, frontier)`` with fresh SWA pages
        after their KV came back from host memory; returns the SWA slots to fill. See
        :func:`graphalloc.checkpoint.load_back`."""
        from .checkpoint import load_back
        with sync_allowed():
            return load_back(self, row, new_frontier_pos)

    def check_integrity(self) -> None:
        """Raise :class:`~graphalloc.errors.IntegrityError` on any broken invariant (reads the
        device; see ``graphalloc.integrity``)."""
        from .integrity import check_integrity
        check_integrity(self)

    # ---- internals ---------------------------------------------------------------------
    def _refuse_if_faulted(self) -> None:
        if self._faulted:
            raise PendingStepError("a device fault was reported by check(); the allocator "
                                   "refuses steps until reset_faults() (or rebuild it)")

    def _plan(self, apply, results: list) -> PlannedStep:
        if self._pending is not None:
            raise PendingStepError("the previous planned step was never run(); run it first")
        self._refuse_if_faulted()
        builder = StepBuilder(self.config, self.ledger.copy(), epoch=self.steps_run + 1)
        apply(builder)  # raises with nothing committed
        release, alloc = builder.finish()
        index = self.ring.acquire()
        self.ring.write(index, release, alloc, fusable=builder.fusable)
        self.ledger = builder.ledger  # commit
        result = None
        if results:
            rows = np.concatenate([r[0] for r in results])
            first = np.concatenate([r[1] for r in results])
            n_tok = np.concatenate([r[2] for r in results])
            result = AllocResult(rows, first, n_tok, self.state.out_full_buf,
                                 self.state.out_swa_buf, builder.n_tokens)
        self._pending = PlannedStep(index, len(release), len(alloc), builder.n_tokens,
                                    builder.pages_freed, builder.pages_allocated, result,
                                    builder.fusable)
        return self._pending

    def _run_step(self, apply) -> AllocResult | None:
        return self.run(self._plan(apply, []))

    def _flush(self, intents: list) -> None:
        """Run a closed block's frees: one step, or -- when that step would exceed the
        frozen descriptor shape -- intent by intent, an intent's rows halved until each
        part fits, one step per part in call order (the same pages end up in the same
        free-ring order). The split is planned on ledger copies first: if even one row
        cannot fit a step, :class:`BatchTooLargeError` is raised before anything runs."""
        if not intents:
            return
        parts: list = []
        self._split(intents, self.ledger.copy(), parts)
        for part in parts:
            self._run_step(lambda b, part=part: FreeGroup.apply_intents(b, part))

    def _split(self, intents: list, ledger, parts: list):
        """Append to ``parts`` the groups of intents that each fit one step, planning them on
        ``ledger`` (a copy); returns the ledger after them."""
        builder = StepBuilder(self.config, ledger.copy())
        try:
            FreeGroup.apply_intents(builder, intents)
            builder.finish()
        except BatchTooLargeError:
            if len(intents) == 1 and len(intents[0][1]) <= 1:
                raise
            if len(intents) > 1:
                pieces = [[intent] for intent in intents]
            else:
                kind, rows, pos = intents[0]
                half = len(rows) // 2
                pieces = [[(kind, rows[:half], None if pos is None else pos[:half])],
                          [(kind, rows[half:], None if pos is None else pos[half:])]]
            for piece in pieces:
                ledger = self._split(piece, ledger, parts)
            return ledger
        parts.append(intents)
        return builder.ledger

    def _refuse_group_released(self, rows: np.ndarray, what: str) -> np.ndarray:
        return rows if self._group is None else self._group.refuse_released(rows, what)

    def _check_not_in_group_alloc(self, release, evict) -> None:
        if self._group is None:
            return
        evicts = evict is True or (evict is not None and evict is not False
                                   and len(np.atleast_1d(evict)) > 0)
        if (release is not None and len(np.atleast_1d(release))) or evicts:
            raise NestedGroupError("inside free_group() call release()/evict_window() "
                                   "(deferred) instead of step(release=..., evict=...)")

    def _check_tensor(self, t, name: str) -> None:
        cfg = self.config
        if not isinstance(t, torch.Tensor):
            raise TensorSpecError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != cfg.index_dtype:
            raise TensorSpecError(f"{name} has dtype {t.dtype}; the allocator's index_dtype "
                                  f"is {cfg.index_dtype}")
        if t.device != cfg.device and not (t.device.type == cfg.device.type == "cuda"
                                           and cfg.device.index is None):
            raise TensorSpecError(f"{name} is on {t.device}; the allocator is on {cfg.device}")
        if t.dim() != 1:
            raise TensorSpecError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
